"""Backends (spec/functions.json): the client picks the module where
``IDEM.BEGIN`` exists, else the Functions library (loaded when missing or
older), else the scripts form; a library flushed between two calls is loaded
again and the call sent once more; the library's waits poll; a server with
no way to run idem is one clear error at start-up; an error reply that is
not UTF-8 is an error reply, not a broken connection."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import threading
import time
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest
import redis
import redis.asyncio as aredis

import idem
import idem.asyncio
from idem import _spec, errors
from idem.backend import Backend, library, outbox
from idem.testing import RedisServer, stop_redis
from idem.types import InFlight, New, Replay, StoredResponse

from conftest import key, start_redis

RESPONSE = StoredResponse.of(201, b'{"id":1}', [("content-type", "application/json")])
FINGERPRINT = bytes(range(200, 232))
"""A fingerprint as the middleware sends it: 32 bytes, not UTF-8."""


@pytest.fixture
def fresh_managed() -> Iterator[RedisServer]:
    """A managed server of its own (nothing loaded yet)."""
    server = start_redis(module=False)
    try:
        yield server
    finally:
        stop_redis(server)


def loaded_version(server: RedisServer) -> int | None:
    try:
        return int(server.raw().execute_command("FCALL_RO", "idem_version", 0))
    except redis.ResponseError:
        return None


def test_the_package_ships_the_library_its_contract_names() -> None:
    # The tests run against the installed wheel: its idem/_spec/ holds the
    # library and both contract files.
    shipped = resources.files("idem").joinpath("_spec/functions/idem.lua")
    assert shipped.is_file(), "the wheel ships functions/idem.lua"
    spec = _spec.functions()
    source = _spec.library_source()
    assert source == shipped.read_text(encoding="utf-8")
    assert source.startswith(f"#!lua name={spec['library']}")
    lib = library()
    assert lib.sha == hashlib.sha1(source.encode().partition(b"\n")[2]).hexdigest().encode()
    assert set(lib.functions) == {
        b"IDEM.BEGIN",
        b"IDEM.COMPLETE",
        b"IDEM.ABORT",
        b"IDEM.TOUCH",
        b"IDEM.GET",
        b"IDEM.MIRROR.ACK",
    }
    assert len(_spec.outbox_slots()["tags"]) == 16384


def test_the_outbox_is_in_the_keys_slot() -> None:
    from redis.crc import key_slot

    for k in (b"idem:{t:abc}", b"plain", b"idem:{}x", "idem:{é}".encode()):
        assert key_slot(outbox(k)) == key_slot(k)
        assert outbox(k).startswith(b"idem:outbox:{")


def test_auto_picks_the_module_where_it_is_loaded(redis_server: RedisServer) -> None:
    c = idem.IdemClient.from_url(redis_server.url)
    assert c.backend is None
    assert c.prepare() is Backend.MODULE
    assert c.backend is Backend.MODULE
    c.close()


def test_auto_loads_the_library_where_there_is_no_module(fresh_managed: RedisServer) -> None:
    assert loaded_version(fresh_managed) is None
    c = idem.IdemClient.from_url(fresh_managed.url)
    new = c.begin(key(), b"fp", ttl=60)  # the first call settles the backend
    assert isinstance(new, New)
    assert c.backend is Backend.FUNCTIONS
    assert loaded_version(fresh_managed) == library().version
    c.close()


def test_an_older_library_is_replaced(fresh_managed: RedisServer) -> None:
    old = "#!lua name=idem\nredis.register_function{function_name='idem_version', "
    old += "callback=function() return 0 end, flags={'no-writes'}}\n"
    fresh_managed.raw().execute_command("FUNCTION", "LOAD", old)
    assert loaded_version(fresh_managed) == 0
    c = idem.IdemClient.from_url(fresh_managed.url)
    assert c.prepare() is Backend.FUNCTIONS
    assert loaded_version(fresh_managed) == library().version
    c.close()


def test_a_current_library_is_not_loaded_again(fresh_managed: RedisServer) -> None:
    fresh_managed.raw().execute_command("FUNCTION", "LOAD", _spec.library_source())
    calls: list[tuple[Any, ...]] = []

    class Counting(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            calls.append(args)
            return super().execute_command(*args, **options)

    c = idem.IdemClient(Counting(port=fresh_managed.port))
    assert c.prepare() is Backend.FUNCTIONS
    assert not [call for call in calls if call[0] == b"FUNCTION"]
    c.close()


@pytest.mark.parametrize("flush", [b"FUNCTION", b"SCRIPT"])
def test_a_flushed_library_is_loaded_and_the_call_sent_once_more(
    managed_server: RedisServer, flush: bytes
) -> None:
    backend = "functions" if flush == b"FUNCTION" else "scripts"
    c = idem.IdemClient.from_url(managed_server.url, backend=backend)
    raw = managed_server.raw()
    k = key()
    new = c.begin(k, FINGERPRINT, ttl=60, lease=5)
    assert isinstance(new, New)
    raw.execute_command(flush, b"FLUSH")
    c.complete(k, new.token, RESPONSE)
    raw.execute_command(flush, b"FLUSH")
    assert c.begin(k, FINGERPRINT, ttl=60) == Replay(RESPONSE)
    raw.execute_command(flush, b"FLUSH")
    record = c.get(k)
    assert record is not None and record.response == RESPONSE
    raw.execute_command(flush, b"FLUSH")
    assert c.abort(key(), 1) is False
    c.close()


async def test_async_a_flushed_library_is_loaded_and_the_call_sent_once_more(
    managed_server: RedisServer,
) -> None:
    for backend, flush in (("functions", b"FUNCTION"), ("scripts", b"SCRIPT")):
        c = idem.asyncio.IdemClient.from_url(managed_server.url, backend=backend)
        raw = managed_server.raw()
        k = key()
        new = await c.begin(k, FINGERPRINT, ttl=60, lease=5)
        assert isinstance(new, New)
        raw.execute_command(flush, b"FLUSH")
        assert await c.touch(k, new.token, 10) == pytest.approx(10)
        raw.execute_command(flush, b"FLUSH")
        await c.complete(k, new.token, RESPONSE)
        raw.execute_command(flush, b"FLUSH")
        assert await c.begin(k, FINGERPRINT, ttl=60) == Replay(RESPONSE)
        await c.aclose()


class _NeverLoads(redis.Redis):
    """A server where the library stays missing whatever is loaded."""

    calls: list[tuple[Any, ...]]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls.append(args)
        if args[0] == b"FCALL":
            raise redis.ResponseError("Function not found")
        return super().execute_command(*args, **options)


def test_the_call_is_sent_once_more_only(managed_server: RedisServer) -> None:
    server = _NeverLoads(port=managed_server.port)
    server.calls = []
    c = idem.IdemClient(server, backend="functions")
    c.prepare()
    server.calls.clear()
    with pytest.raises(errors.OtherRedisError, match="Function not found"):
        c.begin(key(), b"fp", ttl=60)
    assert [call[0] for call in server.calls] == [b"FCALL", b"FUNCTION", b"FCALL"]
    c.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_same_answers_in_resp2_and_resp3(
    target: RedisServer, backend: str, protocol: int
) -> None:
    c = idem.IdemClient(redis.Redis(port=target.port, protocol=protocol), backend=backend)
    k = key()
    new = c.begin(k, FINGERPRINT, ttl=60, lease=5)
    assert isinstance(new, New)
    assert isinstance(c.begin(k, FINGERPRINT, ttl=60), InFlight)
    assert c.begin(k, b"other", ttl=60) == idem.Mismatch()
    assert c.touch(k, new.token, 10) == pytest.approx(10)
    stored = StoredResponse(200, b"\x00\xff", (("set-cookie", b"a"), ("set-cookie", b"\xff")))
    c.complete(k, new.token, stored)
    assert c.begin(k, FINGERPRINT, ttl=60) == Replay(stored)
    record = c.get(k)
    assert record is not None and record.response == stored and record.mirror == "pending"
    assert record.fingerprint_hex == idem.stored_hex(FINGERPRINT)
    assert c.get(key()) is None
    other = c.begin(key(), b"fp", ttl=60)
    assert isinstance(other, New)
    c.close()


# ---------------------------------------------------------------- waiting


def test_the_librarys_waiters_share_one_watch_with_a_growing_interval(
    managed_server: RedisServer,
) -> None:
    sent: list[tuple[Any, float]] = []

    class Counting(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            sent.append((args[:2], time.monotonic()))
            return super().execute_command(*args, **options)

    c = idem.IdemClient(Counting(port=managed_server.port), backend="functions")
    k = key()
    holder = c.begin(k, b"fp", ttl=60, lease=30)
    assert isinstance(holder, New)
    sent.clear()
    answers: list[idem.Outcome] = []
    waiters = [
        threading.Thread(target=lambda: answers.append(c.begin(k, b"fp", ttl=60, wait=5)))
        for _ in range(20)
    ]
    for t in waiters:
        t.start()
    time.sleep(1)
    c.complete(k, holder.token, RESPONSE)
    for t in waiters:
        t.join()
    assert answers == [Replay(RESPONSE)] * 20
    begins = [at for call, at in sent if call == (b"FCALL", b"idem_begin")]
    gets = [at for call, at in sent if call == (b"FCALL_RO", b"idem_get")]
    assert len(begins) == 20, "each waiter's first BEGIN, then none"
    # One GET per interval for all of them: from 10 ms doubling to 200 ms.
    assert 4 <= len(gets) <= 15
    gaps = [b - a for a, b in itertools.pairwise(gets)]
    assert gaps[-2] > gaps[0]
    assert not c._watches
    c.close()


def test_a_waiter_alone_runs_out_in_flight(managed_server: RedisServer) -> None:
    c = idem.IdemClient.from_url(managed_server.url, backend="functions")
    k = key()
    assert isinstance(c.begin(k, b"fp", ttl=60, lease=30), New)
    started = time.monotonic()
    assert isinstance(c.begin(k, b"fp", ttl=60, wait=0.5), InFlight)
    assert 0.45 < time.monotonic() - started < 1.5
    stops_by = time.monotonic() + 2  # the watch sees nobody waits, at its next pause
    while c._watches and time.monotonic() < stops_by:
        time.sleep(0.01)
    assert not c._watches
    c.close()


def test_the_librarys_wait_takes_over_when_the_lease_lapses(managed_server: RedisServer) -> None:
    # The pause is cut to the answer's retry-after: the lapsed lease is
    # seen at once, not at the next poll.
    c = idem.IdemClient.from_url(managed_server.url, backend="functions")
    k = key()
    holder = c.begin(k, b"fp", ttl=60, lease=0.3)
    assert isinstance(holder, New)
    started = time.monotonic()
    waited = c.begin(k, b"fp", ttl=60, lease=5, wait=5)
    assert isinstance(waited, New) and waited.token > holder.token
    assert 0.25 < time.monotonic() - started < 1
    c.close()


async def test_many_waiters_on_the_library_get_the_answer(managed_server: RedisServer) -> None:
    c = idem.asyncio.IdemClient.from_url(managed_server.url, backend="functions")
    k = key()
    holder = await c.begin(k, b"fp", ttl=60, lease=30)
    assert isinstance(holder, New)
    waiters = [asyncio.ensure_future(c.begin(k, b"fp", ttl=60, wait=5)) for _ in range(50)]
    await asyncio.sleep(0.3)
    assert not any(w.done() for w in waiters)
    completed = time.monotonic()
    await c.complete(k, holder.token, RESPONSE)
    answers = await asyncio.gather(*waiters)
    assert all(a == Replay(RESPONSE) for a in answers)
    assert time.monotonic() - completed < 1  # one poll interval (200 ms), on a busy machine
    await c.aclose()


class _CountingAsync(aredis.Redis):
    sent: list[tuple[Any, ...]]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent.append(args[:2])
        return await super().execute_command(*args, **options)


async def test_async_waiters_share_one_watch(managed_server: RedisServer) -> None:
    server = _CountingAsync(port=managed_server.port, max_connections=300)
    server.sent = []
    c = idem.asyncio.IdemClient(server, backend="functions")
    k = key()
    holder = await c.begin(k, b"fp", ttl=60, lease=30)
    assert isinstance(holder, New)
    server.sent.clear()
    waiters = [asyncio.ensure_future(c.begin(k, b"fp", ttl=60, wait=5)) for _ in range(200)]
    await asyncio.sleep(1)
    await c.complete(k, holder.token, RESPONSE)
    answers = await asyncio.gather(*waiters)
    assert all(a == Replay(RESPONSE) for a in answers)
    begins = [s for s in server.sent if s == (b"FCALL", b"idem_begin")]
    gets = [s for s in server.sent if s == (b"FCALL_RO", b"idem_get")]
    assert len(begins) == 200, "each waiter's first BEGIN, then none"
    assert 3 <= len(gets) <= 15, "one GET per interval for all of them"
    assert not c._watches
    await c.aclose()


async def test_async_waiters_after_an_abort_one_takes_over(managed_server: RedisServer) -> None:
    c = idem.asyncio.IdemClient.from_url(managed_server.url, backend="functions")
    k = key()
    holder = await c.begin(k, b"fp", ttl=60, lease=30)
    assert isinstance(holder, New)
    waiters = [asyncio.ensure_future(c.begin(k, b"fp", ttl=60, wait=1)) for _ in range(5)]
    await asyncio.sleep(0.1)
    assert await c.abort(k, holder.token)
    answers = await asyncio.gather(*waiters)
    news = [a for a in answers if isinstance(a, New)]
    assert len(news) == 1 and news[0].token > holder.token
    assert all(isinstance(a, InFlight) for a in answers if not isinstance(a, New))
    await asyncio.sleep(0)
    assert not c._watches, "the watch stops when its waiters are gone"
    await c.aclose()


async def test_async_a_waiter_of_another_request_gets_a_mismatch(
    managed_server: RedisServer,
) -> None:
    c = idem.asyncio.IdemClient.from_url(managed_server.url, backend="functions")
    k = key()
    holder = await c.begin(k, b"fp", ttl=60, lease=30)
    assert isinstance(holder, New)
    same = asyncio.ensure_future(c.begin(k, b"fp", ttl=60, wait=3))
    await asyncio.sleep(0.05)
    await c.complete(k, holder.token, RESPONSE)
    assert await same == Replay(RESPONSE)
    assert await c.begin(k, b"other", ttl=60, wait=3) == idem.Mismatch()
    await c.aclose()


# ---------------------------------------------------------------- no idem


@pytest.fixture
def no_idem() -> Iterator[RedisServer]:
    """A server with neither the module nor a way to load the library:
    FUNCTION renamed away, and the scripting commands too."""
    server = start_redis(module=False, renamed=("FUNCTION", "EVAL", "EVALSHA", "SCRIPT"))
    try:
        yield server
    finally:
        stop_redis(server)


def test_a_server_without_idem_says_so_at_start_up(no_idem: RedisServer) -> None:
    c = idem.IdemClient.from_url(no_idem.url)
    with pytest.raises(errors.BackendMissingError) as missing:
        c.prepare()
    text = str(missing.value)
    assert "IDEM.BEGIN is not a command" in text
    assert "FUNCTION LOAD answered: unknown command" in text
    assert "SCRIPT LOAD answered: unknown command" in text
    assert "Load the module" in text and "functions/idem.lua" in text
    assert not missing.value.is_unavailable and not missing.value.is_unreachable
    assert c.backend is None
    # A call says the same (the middleware's requests before any prepare).
    with pytest.raises(errors.BackendMissingError):
        c.begin(key(), FINGERPRINT, ttl=60)
    c.close()


async def test_a_user_denied_the_library_is_told_what_to_do(fresh_managed: RedisServer) -> None:
    fresh_managed.raw().execute_command(
        "ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "-function", "-eval", "-evalsha",
        "-script",
    )  # fmt: skip
    url = f"redis://app:pw@127.0.0.1:{fresh_managed.port}/"
    c = idem.asyncio.IdemClient.from_url(url)
    with pytest.raises(errors.BackendMissingError) as missing:
        await c.prepare()
    assert "FUNCTION LOAD answered" in str(missing.value)
    assert "SCRIPT LOAD answered" in str(missing.value)
    await c.aclose()
    # Loaded by an operator, the same user runs it.
    fresh_managed.raw().execute_command("FUNCTION", "LOAD", _spec.library_source())
    c = idem.asyncio.IdemClient.from_url(url)
    assert await c.prepare() is Backend.FUNCTIONS
    assert isinstance(await c.begin(key(), FINGERPRINT, ttl=60), New)
    # Flushed, it cannot load it again: the same clear error.
    fresh_managed.raw().execute_command("FUNCTION", "FLUSH")
    with pytest.raises(errors.BackendMissingError, match="loading it answered"):
        await c.begin(key(), FINGERPRINT, ttl=60)
    await c.aclose()


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="one of auto, module, functions, scripts"):
        idem.IdemClient(redis.Redis(port=1), backend="lua")


# ---------------------------------------------------------------- bytes


def test_an_error_reply_that_is_not_utf8_is_an_error_reply(
    managed_server: RedisServer,
) -> None:
    # Redis' "unknown command" echoes the arguments: the binary fingerprint.
    # It is an error of the server's (500, never fail-open), not a broken
    # connection (503), and the connection goes on working.
    c = idem.IdemClient.from_url(managed_server.url, backend="module")
    with pytest.raises(errors.BackendMissingError) as err:
        c.begin(key(), FINGERPRINT, ttl=60)
    assert "the module is not loaded (unknown command 'IDEM.BEGIN')" in str(err.value)
    assert isinstance(err.value, errors.OtherRedisError) and not err.value.is_unavailable
    assert c.redis.ping()
    c.close()


async def test_async_an_error_reply_that_is_not_utf8_is_an_error_reply(
    managed_server: RedisServer,
) -> None:
    for protocol in (2, 3):
        c = idem.asyncio.IdemClient(
            aredis.Redis(port=managed_server.port, protocol=protocol), backend="module"
        )
        with pytest.raises(errors.BackendMissingError) as err:
            await c.begin(key(), FINGERPRINT, ttl=60)
        assert "unknown command 'IDEM.BEGIN'" in str(err.value)
        assert not err.value.is_unavailable
        assert await c.redis.ping()
        await c.aclose()


def test_a_module_error_that_is_not_utf8_keeps_its_code(client: idem.IdemClient) -> None:
    # BADARG naming an option of raw bytes, on every backend.
    args = [b"IDEM.BEGIN", key().encode(), FINGERPRINT, b"60", b"\xff\xfe"]
    with pytest.raises(errors.BadArgError):
        client._query(args)
    assert isinstance(client.begin(key(), FINGERPRINT, ttl=60), New)


def test_waiting_threads_share_one_probe(fresh_managed: RedisServer) -> None:
    c = idem.IdemClient.from_url(fresh_managed.url)
    found: list[Backend] = []
    threads = [threading.Thread(target=lambda: found.append(c.prepare())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found == [Backend.FUNCTIONS] * 8
    c.close()


# ---------------------------------------------------------------- differential


def _normalize(reply: Any, tokens: list[int]) -> Any:
    """A reply with what differs between two servers for the same history
    replaced: tokens (time-based) by their order of appearance on the key,
    times by placeholders (a TTL as expires_at - created_at)."""
    if isinstance(reply, list):
        if reply[:1] == [b"in_flight"]:
            return [b"in_flight", "*"]
        if reply[:1] == [b"state"]:
            fields = dict(zip(reply[::2], reply[1::2], strict=True))
            out: list[Any] = []
            for name, value in zip(reply[::2], reply[1::2], strict=True):
                if name in (b"created_at", b"lease_until", b"completed_at"):
                    value = "*"
                elif name == b"expires_at":
                    value = "ttl", int(value) - int(fields[b"created_at"])
                out += [name, _normalize(value, tokens)]
            return out
        return [_normalize(item, tokens) for item in reply]
    if isinstance(reply, int) and reply in tokens:
        return f"token{tokens.index(reply)}"
    return reply


def _history(seed: int, tag: str) -> list[tuple[str, Any]]:
    """Forty random commands on three keys (named with ``tag``): the same
    commands for the same seed whatever the tag."""
    rng = random.Random(seed)
    keys = [f"idem:{{diff:{tag}:{seed}:{i}}}".encode() for i in range(3)]
    fingerprints = [b"a", FINGERPRINT, b""]
    ops: list[tuple[str, Any]] = []
    for _ in range(40):
        k = rng.choice(keys)
        kind = rng.choice(["begin", "begin", "complete", "complete", "abort", "touch", "get"])
        token = rng.choice(["last", "last", "last", "first", "bogus"])
        if kind == "begin":
            options = rng.choice(
                [[], [b"LEASE", b"30000"], [b"PACKED"], [b"LEASE", b"20000", b"PACKED"]]
            )
            ttl = rng.choice([b"60", b"3600"])
            ops.append((kind, [b"IDEM.BEGIN", k, rng.choice(fingerprints), ttl, *options]))
        elif kind == "complete":
            headers: list[bytes] = []
            for _ in range(rng.randrange(3)):
                headers += [
                    b"HEADER",
                    rng.choice([b"content-type", b"set-cookie"]),
                    rng.randbytes(3),
                ]
            body = rng.choice([b"", b"{}", rng.randbytes(20)])
            status = rng.choice([b"200", b"201", b"500", b"99"])
            extra = [b"MIRRORED"] if rng.random() < 0.2 else []
            ops.append((kind, (k, token, [status, body, *headers, *extra])))
        elif kind in ("abort", "touch"):
            ops.append((kind, (k, token, [b"20000"] if kind == "touch" else [])))
        else:
            ops.append((kind, [b"IDEM.GET", k]))
    return ops


def _play(client: idem.IdemClient, ops: list[tuple[str, Any]]) -> list[Any]:
    by_key: dict[bytes, list[int]] = {}
    answers: list[Any] = []
    for kind, op in ops:
        if kind in ("complete", "abort", "touch"):
            k, which, rest = op
            held = by_key.get(k, [])
            token = {"last": held[-1:], "first": held[:1]}.get(which) or [1]
            verb = {"complete": b"IDEM.COMPLETE", "abort": b"IDEM.ABORT", "touch": b"IDEM.TOUCH"}
            args = [verb[kind], k, str(token[0]).encode(), *rest]
        else:
            args = op
        try:
            reply = client._query(args)
        except errors.IdemError as err:
            answers.append((type(err).__name__, str(err)))
            continue
        tokens = by_key.setdefault(args[1], [])
        if kind == "begin" and isinstance(reply, list) and reply[0] == b"new":
            tokens.append(reply[1])
        if kind == "touch" and isinstance(reply, int):
            reply = "remaining"
        answers.append(_normalize(reply, tokens))
    return answers


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_library_answers_what_the_module_answers(
    redis_server: RedisServer, managed_server: RedisServer, protocol: int
) -> None:
    # The same random histories on the module and on the library (functions
    # and scripts): every reply the same bytes, tokens and times aside.
    module = idem.IdemClient(redis.Redis(port=redis_server.port, protocol=protocol))
    libraries = [
        idem.IdemClient(redis.Redis(port=managed_server.port, protocol=protocol), backend=b)
        for b in ("functions", "scripts")
    ]
    for seed in range(15):
        expected = _play(module, _history(seed, f"module{protocol}"))
        for c in libraries:
            tag = f"{c._requested.value}{protocol}"
            assert _play(c, _history(seed, tag)) == expected, f"seed {seed}, {tag}"
    module.close()
    for c in libraries:
        c.close()
