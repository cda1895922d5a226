"""Typed errors: one class per module error code (the codes come from the
spec's errors.json, shared with the Rust client), plus "the store is
unreachable", "writes refused for now", any other Redis error, an
unexpected reply, and Postgres (read-through).

The three questions a caller asks, as in the Rust client:

- ``is_unavailable``: answer 503 (the store could not be reached, is down for
  now, or refuses writes for now);
- ``is_unreachable``: the subset a fail-open caller runs the handler on;
- ``is_transient``: a produced response is retried, never released (also
  ``OOM``).
"""

from __future__ import annotations

from typing import ClassVar

import redis.exceptions as rexc

from idem import _spec


class IdemError(Exception):
    """Everything a call to the module (or the read-through mirror) can fail with."""

    unreachable: ClassVar[bool] = False
    writes_refused: ClassVar[bool] = False

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail

    @property
    def is_unreachable(self) -> bool:
        """The store could not be reached or did not answer: fail-open runs the handler."""
        return self.unreachable

    @property
    def is_unavailable(self) -> bool:
        """Answer 503: unreachable, or a primary refusing writes for now."""
        return self.unreachable or self.writes_refused

    @property
    def is_transient(self) -> bool:
        """The store may take a write it refused a moment later."""
        return self.is_unavailable

    @property
    def code(self) -> str | None:
        """The module's error code, for errors the module answered."""
        return None


class ModuleError(IdemError):
    """An error reply of the idem module; ``code`` is its code word."""

    CODE: ClassVar[str] = ""

    @property
    def code(self) -> str | None:
        return self.CODE

    def __str__(self) -> str:
        return f"{self.CODE}: {self.detail}"


class BadArgError(ModuleError):
    """``BADARG``: malformed or out-of-range argument."""

    CODE = "BADARG"


class StaleError(ModuleError):
    """``STALE``: the token is no longer the holder's (the key was taken over)."""

    CODE = "STALE"


class NotFoundError(ModuleError):
    """``NOTFOUND``: no record under the key."""

    CODE = "NOTFOUND"


class CompletedError(ModuleError):
    """``COMPLETED``: the record is completed and can no longer change."""

    CODE = "COMPLETED"


class TooLargeError(ModuleError):
    """``TOOLARGE``: body plus headers exceed the module's ``max-body-bytes``."""

    CODE = "TOOLARGE"


class WrongTypeError(ModuleError):
    """``WRONGTYPE``: the key holds a value that is not an idem record."""

    CODE = "WRONGTYPE"


class CorruptError(ModuleError):
    """``CORRUPT``: the stored value could not be decoded."""

    CODE = "CORRUPT"


class NoPermError(ModuleError):
    """``NOPERM``: the connection's ACL user may not run the command."""

    CODE = "NOPERM"


class OomError(ModuleError):
    """``OOM``: Redis is above ``maxmemory``; transient."""

    CODE = "OOM"

    @property
    def is_transient(self) -> bool:
        return True


class InternalError(ModuleError):
    """``INTERNAL``: the module caught a bug at its command boundary."""

    CODE = "INTERNAL"


class UnavailableError(IdemError):
    """Redis could not be reached or did not answer in time, or is down for
    now (loading, read-only, cluster down). Nothing is known about the
    command's effect."""

    unreachable = True

    def __str__(self) -> str:
        return f"redis unavailable: {self.detail}"


class WritesRefusedError(IdemError):
    """``NOREPLICAS`` or ``MISCONF``: the primary answers but refuses writes
    for now. Unavailable (503), but never a reason to fail open."""

    writes_refused = True

    def __str__(self) -> str:
        return f"redis refuses writes for now: {self.detail}"


class OtherRedisError(IdemError):
    """Any other Redis error (refused credentials or settings, an unknown
    error code): a configuration error, 500, never fail-open."""

    def __str__(self) -> str:
        return f"redis error: {self.detail}"


class BackendMissingError(OtherRedisError):
    """The server offers no way to run idem: the module is not loaded and
    the Functions library could neither be found nor loaded (nor the
    scripts). A configuration error, raised at start-up (``prepare``) or by
    the first call; ``reasons`` says what each step answered."""

    def __init__(self, backend: str = "auto", reasons: list[str] | None = None) -> None:
        self.backend = backend
        self.reasons = list(reasons or ())
        super().__init__("; ".join(self.reasons))

    def __str__(self) -> str:
        return (
            f"no idem on this Redis (backend={self.backend}): {self.detail}. "
            "Load the module (loadmodule libidem.so), or load the Functions library "
            "functions/idem.lua (FUNCTION LOAD REPLACE, as a user allowed to), or let "
            "this client's user run FUNCTION LOAD and FCALL, or SCRIPT LOAD and EVALSHA"
        )


class UnexpectedReplyError(IdemError):
    """The module answered something this client does not understand."""

    def __str__(self) -> str:
        return f"unexpected reply from the idem module: {self.detail}"


class PostgresError(IdemError):
    """Postgres could not be read or written (the read-through mirror)."""

    unreachable = True

    def __str__(self) -> str:
        return f"postgres mirror unavailable: {self.detail}"


MODULE_ERRORS: dict[str, type[ModuleError]] = {
    cls.CODE: cls
    for cls in (
        BadArgError,
        StaleError,
        NotFoundError,
        CompletedError,
        TooLargeError,
        WrongTypeError,
        CorruptError,
        NoPermError,
        OomError,
        InternalError,
    )
}
"""One class per module error code, keyed by its code word."""


def _check_against_spec() -> None:
    spec = _spec.errors()
    codes = [c["code"] for c in spec["module_codes"]]
    if sorted(codes) != sorted(MODULE_ERRORS):
        raise RuntimeError(f"idem: error classes {sorted(MODULE_ERRORS)} != spec {codes}")
    for entry in spec["module_codes"]:
        if MODULE_ERRORS[entry["code"]].__name__ != entry["name"] + "Error":
            raise RuntimeError(f"idem: the class of {entry['code']} is not {entry['name']}Error")
    transient = {code for code, cls in MODULE_ERRORS.items() if cls("").is_transient}
    if transient != set(spec["transient_codes"]):
        raise RuntimeError(f"idem: transient codes {transient} != spec")


_check_against_spec()

# redis-py answers some error replies with classes of its own and strips
# their code word; these give the word back, so the spec's lists decide.
_REDIS_PY_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (rexc.MasterDownError, "MASTERDOWN"),
    (rexc.ClusterDownError, "CLUSTERDOWN"),
    (rexc.TryAgainError, "TRYAGAIN"),
    (rexc.BusyLoadingError, "LOADING"),
    (rexc.ReadOnlyError, "READONLY"),
    (rexc.OutOfMemoryError, "OOM"),
    (rexc.NoPermissionError, "NOPERM"),
)


def _code_of(err: rexc.RedisError) -> tuple[str | None, str]:
    """The error reply's code word and the rest of its text."""
    text = str(err)
    for cls, code in _REDIS_PY_CODES:
        if isinstance(err, cls):
            word, _, rest = text.partition(" ")
            return code, (rest if word == code else text)
    if isinstance(err, rexc.ResponseError):
        word, _, rest = text.partition(" ")
        if word and word.isupper():
            return word, rest
    return None, text


def from_redis(err: BaseException) -> IdemError:
    """The typed error for what redis-py raised (or an ``OSError``)."""
    if isinstance(err, IdemError):
        return err
    spec = _spec.errors()
    if isinstance(err, rexc.RedisError):
        code, detail = _code_of(err)
        if code in MODULE_ERRORS:
            return MODULE_ERRORS[code](detail)
        if code in spec["writes_refused_codes"]:
            return WritesRefusedError(str(err))
        if code in spec["unavailable_codes"]:
            return UnavailableError(str(err))
        if isinstance(
            err,
            rexc.AuthenticationError
            | rexc.AuthorizationError
            | rexc.AuthenticationWrongNumberOfArgsError,
        ):
            return OtherRedisError(str(err))
        if isinstance(err, rexc.ConnectionError | rexc.TimeoutError | rexc.InvalidResponse):
            return UnavailableError(str(err) or type(err).__name__)
        return OtherRedisError(str(err))
    if isinstance(err, OSError | TimeoutError):
        return UnavailableError(str(err) or type(err).__name__)
    raise TypeError(f"not a Redis error: {err!r}") from err
