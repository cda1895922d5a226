"""Where the IDEM.* commands run (spec/functions.json, "backends"): the
module where ``IDEM.BEGIN`` exists, else the Functions library
(``functions/idem.lua``, loaded by the client with ``FUNCTION LOAD REPLACE``
when missing or older than this package's), else the same source as scripts
(``EVALSHA``, Redis 6). The library answers byte for byte what the module
answers, so the replies are read by the same readers.

What the sync and the asyncio client share, without I/O: the command a
module command becomes on each backend, the error meaning "the library is
not loaded here", and ``resolve``, the start-up probe as a generator of
commands the client sends (a reply is sent back in, a ``ResponseError``
thrown in)."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Generator
from dataclasses import dataclass
from functools import cache
from typing import Any

import redis.exceptions as rexc
from redis.crc import key_slot

from idem import _spec
from idem.errors import BackendMissingError


class Backend(str, enum.Enum):
    """``auto`` (the default) picks the first of module, functions, scripts
    the server offers; the others force one."""

    AUTO = "auto"
    MODULE = "module"
    FUNCTIONS = "functions"
    SCRIPTS = "scripts"

    @classmethod
    def of(cls, value: str | Backend) -> Backend:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(b.value for b in cls)
            raise ValueError(f"backend {value!r}: one of {choices}") from None


@dataclass(frozen=True)
class Function:
    """One library function standing for a module command."""

    name: bytes
    outbox: bool
    """Its second key is the record key's outbox (``idem_complete``)."""
    read_only: bool
    """Flagged ``no-writes``: called with ``FCALL_RO``."""


@dataclass(frozen=True)
class Library:
    name: str
    version: int
    source: bytes
    """``FUNCTION LOAD``'s argument: the file as shipped."""
    script: bytes
    """The scripts form: the source without its first line (``#!lua ...``)."""
    sha: bytes
    """SHA-1 of ``script``, in hex: ``EVALSHA``'s argument."""
    functions: dict[bytes, Function]
    """By the module command each stands for (``b"IDEM.BEGIN"``, ...)."""
    version_function: bytes


@cache
def library() -> Library:
    """The library this package ships, and its contract."""
    spec = _spec.functions()
    source = _spec.library_source().encode()
    _, _, script = source.partition(b"\n")
    functions: dict[bytes, Function] = {}
    for entry in spec["functions"].values():
        keys = entry["keys"]
        if entry["module"] is None or keys not in (["record"], ["record", "outbox"]):
            continue  # the version, and the writer's functions (keys of another shape)
        functions[entry["module"].encode()] = Function(
            name=entry["name"].encode(),
            outbox=len(keys) == 2,
            read_only="no-writes" in entry.get("flags", ()),
        )
    return Library(
        name=spec["library"],
        version=int(spec["version"]),
        source=source,
        script=script,
        sha=hashlib.sha1(script).hexdigest().encode(),
        functions=functions,
        version_function=spec["functions"]["version"]["name"].encode(),
    )


@cache
def _outbox_parts() -> tuple[bytes, bytes, tuple[bytes, ...]]:
    slots = _spec.outbox_slots()
    return (
        slots["prefix"].encode(),
        slots["suffix"].encode(),
        tuple(tag.encode() for tag in slots["tags"]),
    )


def outbox(key: bytes) -> bytes:
    """The mirror outbox of a record key: prefix + tags[slot] + suffix, the
    slot as Redis Cluster hashes the key (its hash tag when it has one), so
    the outbox is in the key's slot."""
    prefix, suffix, tags = _outbox_parts()
    return prefix + tags[key_slot(key)] + suffix


def command(backend: Backend, args: list[bytes]) -> list[bytes]:
    """What the module command ``args`` becomes on ``backend``: ``FCALL
    <function> <numkeys> <key> [outbox] <the command's other arguments>``, or
    the scripts form ``EVALSHA <sha> <numkeys> <keys> <function> <args>``.
    A command the library does not stand for is sent as it is."""
    if backend is Backend.MODULE:
        return args
    lib = library()
    function = lib.functions.get(args[0].upper())
    if function is None:
        return args
    key = args[1]
    keys = [key, outbox(key)] if function.outbox else [key]
    numkeys = str(len(keys)).encode()
    if backend is Backend.FUNCTIONS:
        verb = b"FCALL_RO" if function.read_only else b"FCALL"
        return [verb, function.name, numkeys, *keys, *args[2:]]
    return [b"EVALSHA", lib.sha, numkeys, *keys, function.name, *args[2:]]


def load_command(backend: Backend) -> list[bytes]:
    """What loads the library on ``backend`` (functions or scripts)."""
    lib = library()
    if backend is Backend.FUNCTIONS:
        return [b"FUNCTION", b"LOAD", b"REPLACE", lib.source]
    return [b"SCRIPT", b"LOAD", lib.script]


def _missing_text(name: str) -> tuple[str, ...]:
    # redis-py strips a leading "ERR " from the errors it raises.
    word = _spec.functions()["errors"][name]
    return (word, word.removeprefix("ERR "))


def is_missing(backend: Backend, err: BaseException) -> bool:
    """Whether ``err`` says the library is not loaded: ``ERR Function not
    found`` on functions, ``NOSCRIPT`` on scripts."""
    if not isinstance(err, rexc.ResponseError):
        return False
    if backend is Backend.FUNCTIONS:
        return str(err).startswith(_missing_text("missing_function"))
    if backend is Backend.SCRIPTS:
        return isinstance(err, rexc.NoScriptError) or str(err).startswith(
            _missing_text("missing_script")
        )
    return False


def _said(err: BaseException) -> str:
    """An error reply, without the arguments Redis echoes after an unknown
    command (here the library's source)."""
    text = str(err)
    cut = text.find(", with args beginning with")
    return text if cut < 0 else text[:cut]


def module_missing(backend: Backend, err: BaseException) -> BackendMissingError | None:
    """On the module, Redis' ``unknown command 'IDEM.…'``: the clear error
    for a server without the module (a backend forced to ``module``, or a
    failover to a node without it), else None."""
    if backend is not Backend.MODULE or not isinstance(err, rexc.ResponseError):
        return None
    # Redis 7 quotes the name with ', Redis 6 with `.
    if not str(err).startswith(("unknown command 'IDEM.", "unknown command `IDEM.")):
        return None
    return BackendMissingError(backend.value, [f"the module is not loaded ({_said(err)})"])


def reload_failed(
    backend: Backend, missing: BaseException, err: BaseException
) -> BackendMissingError:
    """The error for a library found missing by a call that could not load
    it again (say a user allowed FCALL but not FUNCTION LOAD, after a flush)."""
    return BackendMissingError(
        backend.value,
        [f"the library is missing ({_said(missing)}) and loading it answered: {_said(err)}"],
    )


Probe = Generator[list[bytes], Any, Backend]


def resolve(requested: Backend) -> Probe:
    """The backend to use, as ``backends.order`` says: yields the commands
    to send and answers the backend, or raises ``BackendMissingError``
    naming what each step answered. Connection errors thrown in go through."""
    if requested is Backend.MODULE:
        return Backend.MODULE
    reasons: list[str] = []
    if requested is Backend.AUTO:
        try:
            info = yield [b"COMMAND", b"INFO", b"IDEM.BEGIN"]
            if isinstance(info, list | tuple) and info and info[0] is not None:
                return Backend.MODULE
            reasons.append("IDEM.BEGIN is not a command (the module is not loaded)")
        except rexc.ResponseError as err:
            reasons.append(f"COMMAND INFO IDEM.BEGIN answered: {_said(err)}")
    if requested in (Backend.AUTO, Backend.FUNCTIONS):
        why = yield from _functions()
        if why is None:
            return Backend.FUNCTIONS
        reasons.append(why)
    if requested in (Backend.AUTO, Backend.SCRIPTS):
        why = yield from _scripts()
        if why is None:
            return Backend.SCRIPTS
        reasons.append(why)
    raise BackendMissingError(requested.value, reasons)


def _functions() -> Generator[list[bytes], Any, str | None]:
    """None when the library is loaded (by this call when it was missing or
    older), else why not."""
    try:
        lib = library()
    except RuntimeError as err:
        return str(err)
    try:
        version = yield [b"FCALL_RO", lib.version_function, b"0"]
        if isinstance(version, int) and version >= lib.version:
            return None
    except rexc.ResponseError as err:
        if not is_missing(Backend.FUNCTIONS, err):
            return f"FCALL_RO {lib.version_function.decode()} answered: {_said(err)}"
    try:
        yield load_command(Backend.FUNCTIONS)
    except rexc.ResponseError as err:
        return f"FUNCTION LOAD answered: {_said(err)}"
    return None


def _scripts() -> Generator[list[bytes], Any, str | None]:
    try:
        lib = library()
    except RuntimeError as err:
        return str(err)
    try:
        sha = yield load_command(Backend.SCRIPTS)
    except rexc.ResponseError as err:
        return f"SCRIPT LOAD answered: {_said(err)}"
    if sha != lib.sha:
        return f"SCRIPT LOAD answered {sha!r}, not the script's SHA-1 {lib.sha.decode()}"
    return None
