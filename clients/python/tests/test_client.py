"""The sync and asyncio clients against redis-server with the module, and
(the tests taking ``client``, ``aclient`` or ``target``) against a managed
server with the library's functions and scripts: the four outcomes, takeover
and fencing, the error codes, WAIT (polled on the library), TOUCH, GET, the
PACKED fallback, and an unreachable server."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aredis

import idem
import idem.asyncio
from idem import errors
from idem.testing import RedisServer, free_port
from idem.types import InFlight, Mismatch, New, Replay, StoredResponse

from conftest import key

RESPONSE = StoredResponse.of(201, b'{"id":1}', [("content-type", "application/json")])


def test_the_four_outcomes(client: idem.IdemClient) -> None:
    k = key()
    first = client.begin(k, b"fp", ttl=60, lease=5)
    assert isinstance(first, New) and first.token > 0
    second = client.begin(k, b"fp", ttl=60, lease=5)
    assert isinstance(second, InFlight) and 0 < second.retry_after_ms <= 5000
    assert client.begin(k, b"other", ttl=60) == Mismatch()
    client.complete(k, first.token, RESPONSE)
    assert client.begin(k, b"fp", ttl=60) == Replay(RESPONSE)
    assert client.begin(k, b"other", ttl=60) == Mismatch()


def test_replays_in_both_layouts(target: RedisServer, backend: str) -> None:
    for packed in (True, False):
        c = idem.IdemClient(redis.Redis(port=target.port), packed_replies=packed, backend=backend)
        k = key()
        new = c.begin(k, b"fp", ttl=60)
        assert isinstance(new, New)
        stored = StoredResponse(200, b"\x00\xff", (("set-cookie", b"a"), ("set-cookie", b"")))
        c.complete(k, new.token, stored)
        assert c.begin(k, b"fp", ttl=60) == Replay(stored)
        c.close()


def test_a_client_with_decoded_responses_still_gets_bytes(
    target: RedisServer, backend: str
) -> None:
    c = idem.IdemClient(redis.Redis(port=target.port, decode_responses=True), backend=backend)
    k = key()
    new = c.begin(k, b"fp", ttl=60)
    assert isinstance(new, New)
    c.complete(k, new.token, StoredResponse(200, b"\xff"))
    assert c.begin(k, b"fp", ttl=60) == Replay(StoredResponse(200, b"\xff"))
    c.close()


def test_abort_touch_get_and_takeover(client: idem.IdemClient) -> None:
    k = key()
    first = client.begin(k, b"fp", ttl=60, lease=0.05)
    assert isinstance(first, New)
    record = client.get(k)
    assert record is not None and record.state == "in_progress"
    assert record.token == first.token and record.fingerprint_hex == idem.stored_hex(b"fp")
    assert record.lease_until is not None and record.expires_at is not None
    assert record.expires_at - record.created_at == 60_000
    assert client.touch(k, first.token, 0.2) == pytest.approx(0.2)
    time.sleep(0.25)
    second = client.begin(k, b"fp", ttl=60, lease=5)
    assert isinstance(second, New) and second.token > first.token
    # The first holder is fenced off.
    assert client.abort(k, first.token) is False
    with pytest.raises(errors.StaleError):
        client.touch(k, first.token, 1)
    with pytest.raises(errors.StaleError):
        client.complete(k, first.token, RESPONSE)
    assert client.abort(k, second.token) is True
    assert client.get(k) is None
    third = client.begin(k, b"fp", ttl=60)
    assert isinstance(third, New)
    client.complete(k, third.token, RESPONSE, origin=idem.Origin.MIRROR)
    done = client.get(k)
    assert done is not None and done.state == "completed" and done.mirror == "mirrored"
    assert done.response == RESPONSE


def test_every_error_the_module_answers(fresh_redis: RedisServer) -> None:
    c = idem.IdemClient.from_url(fresh_redis.url)
    raw = fresh_redis.raw()
    k = key()
    with pytest.raises(errors.BadArgError, match="ttl"):
        c.begin(k, b"fp", ttl=10**9)
    with pytest.raises(errors.NotFoundError):
        c.touch(k, 1, 1)
    new = c.begin(k, b"fp", ttl=60)
    assert isinstance(new, New)
    c.complete(k, new.token, RESPONSE)
    with pytest.raises(errors.CompletedError):
        c.touch(k, new.token, 1)
    raw.set("plain", "x")
    with pytest.raises(errors.WrongTypeError):
        c.begin("plain", b"fp", ttl=60)
    raw.config_set("idem.max-body-bytes", 4)
    big = c.begin(key(), b"fp", ttl=60)
    assert isinstance(big, New)
    with pytest.raises(errors.TooLargeError) as too_large:
        c.complete(k + "x", 1, StoredResponse(200, b"0123456789"))
    assert not too_large.value.is_transient
    raw.config_set("idem.max-body-bytes", 1048576)
    with pytest.raises(errors.NoPermError):
        c._query([b"IDEM._PUT", b"k", b"blob"])
    raw.config_set("maxmemory", 1)
    with pytest.raises(errors.OomError) as oom:
        c.begin(key(), b"fp", ttl=60)
    assert oom.value.is_transient and not oom.value.is_unavailable
    # A replay still answers above maxmemory.
    assert c.begin(k, b"fp", ttl=60) == Replay(RESPONSE)
    raw.config_set("maxmemory", 0)
    c.close()


def test_the_errors_every_backend_answers(client: idem.IdemClient, target: RedisServer) -> None:
    k = key()
    with pytest.raises(errors.BadArgError, match="ttl"):
        client.begin(k, b"fp", ttl=10**9)
    with pytest.raises(errors.NotFoundError):
        client.touch(k, 1, 1)
    with pytest.raises(errors.NotFoundError):
        client.complete(k, 1, RESPONSE)
    new = client.begin(k, b"fp", ttl=60)
    assert isinstance(new, New)
    with pytest.raises(errors.StaleError):
        client.complete(k, new.token + 1, RESPONSE)
    client.complete(k, new.token, RESPONSE)
    with pytest.raises(errors.CompletedError):
        client.touch(k, new.token, 1)
    with pytest.raises(errors.CompletedError):
        client.complete(k, new.token, RESPONSE)
    plain = key()
    target.raw().set(plain, "x")
    with pytest.raises(errors.WrongTypeError):
        client.begin(plain, b"fp", ttl=60)
    with pytest.raises(errors.WrongTypeError):
        client.get(plain)


def test_an_unreachable_server_is_unavailable() -> None:
    c = idem.IdemClient.from_url(f"redis://127.0.0.1:{free_port()}/", call_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(errors.UnavailableError) as err:
        c.begin(key(), b"fp", ttl=60)
    assert err.value.is_unreachable and err.value.is_unavailable
    assert time.monotonic() - started < 2


def test_wait_replays_the_holders_answer(client: idem.IdemClient) -> None:
    k = key()
    holder = client.begin(k, b"fp", ttl=60, lease=5)
    assert isinstance(holder, New)
    timer = threading.Timer(0.2, lambda: client.complete(k, holder.token, RESPONSE))
    timer.start()
    started = time.monotonic()
    assert client.begin(k, b"fp", ttl=60, wait=5) == Replay(RESPONSE)
    assert 0.15 < time.monotonic() - started < 3
    timer.join()


def test_wait_takes_over_when_the_holder_aborts(client: idem.IdemClient) -> None:
    k = key()
    holder = client.begin(k, b"fp", ttl=60, lease=5)
    assert isinstance(holder, New)
    timer = threading.Timer(0.1, lambda: client.abort(k, holder.token))
    timer.start()
    waited = client.begin(k, b"fp", ttl=60, wait=5)
    timer.join()  # before the fixture closes the client the timer uses
    assert isinstance(waited, New) and waited.token > holder.token


def test_wait_longer_than_the_call_timeout(target: RedisServer, backend: str) -> None:
    # The wait is bounded by wait + call timeout, not by the socket timeout.
    c = idem.IdemClient.from_url(target.url, call_timeout=0.2, backend=backend)
    k = key()
    holder = c.begin(k, b"fp", ttl=60, lease=5)
    assert isinstance(holder, New)
    timer = threading.Timer(0.6, lambda: c.complete(k, holder.token, RESPONSE))
    timer.start()
    assert c.begin(k, b"fp", ttl=60, wait=3) == Replay(RESPONSE)
    # The pool's connections still work.
    assert c.begin(k, b"fp", ttl=60) == Replay(RESPONSE)
    timer.join()
    c.close()


def test_wait_running_out_answers_in_flight(client: idem.IdemClient) -> None:
    k = key()
    assert isinstance(client.begin(k, b"fp", ttl=60, lease=5), New)
    started = time.monotonic()
    answer = client.begin(k, b"fp", ttl=60, wait=0.2)
    assert isinstance(answer, InFlight)
    assert 0.15 < time.monotonic() - started < 2


class _OldModule(redis.Redis):
    """A module from before PACKED, as the client sees it."""

    calls: list[tuple[Any, ...]]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls.append(args)
        if b"PACKED" in args:
            raise redis.ResponseError("BADARG unknown option 'PACKED'")
        return super().execute_command(*args, **options)


def test_a_module_refusing_packed_is_asked_once(redis_server: RedisServer) -> None:
    old = _OldModule(port=redis_server.port)
    old.calls = []
    c = idem.IdemClient(old)
    k = key()
    new = c.begin(k, b"fp", ttl=60)
    assert isinstance(new, New)
    c.complete(k, new.token, RESPONSE)
    assert c.begin(k, b"fp", ttl=60) == Replay(RESPONSE)
    begins = [call for call in old.calls if call[0] == b"IDEM.BEGIN"]
    assert [b"PACKED" in call for call in begins] == [True, False, False]
    c.close()


# ---------------------------------------------------------------- asyncio


async def test_async_outcomes_and_commands(aclient: idem.asyncio.IdemClient) -> None:
    k = key()
    first = await aclient.begin(k, b"fp", ttl=60, lease=5)
    assert isinstance(first, New)
    assert isinstance(await aclient.begin(k, b"fp", ttl=60), InFlight)
    assert await aclient.begin(k, b"x", ttl=60) == Mismatch()
    assert await aclient.touch(k, first.token, 10) == pytest.approx(10)
    record = await aclient.get(k)
    assert record is not None and record.state == "in_progress"
    await aclient.complete(k, first.token, RESPONSE)
    assert await aclient.begin(k, b"fp", ttl=60) == Replay(RESPONSE)
    with pytest.raises(errors.CompletedError):
        await aclient.touch(k, first.token, 1)
    k2 = key()
    other = await aclient.begin(k2, b"fp", ttl=60)
    assert isinstance(other, New)
    assert await aclient.abort(k2, other.token) is True
    assert await aclient.abort(k2, other.token) is False
    assert await aclient.get(k2) is None


async def test_async_wait_does_not_hold_up_other_calls(target: RedisServer, backend: str) -> None:
    c = idem.asyncio.IdemClient.from_url(target.url, call_timeout=0.3, backend=backend)
    k = key()
    holder = await c.begin(k, b"fp", ttl=60, lease=5)
    assert isinstance(holder, New)
    waiting = asyncio.ensure_future(c.begin(k, b"fp", ttl=60, wait=3))
    await asyncio.sleep(0.1)
    # Other calls go on meanwhile.
    for _ in range(5):
        assert isinstance(await c.begin(key(), b"fp", ttl=60), New)
    await asyncio.sleep(0.5)
    assert not waiting.done()
    await c.complete(k, holder.token, RESPONSE)
    assert await asyncio.wait_for(waiting, 3) == Replay(RESPONSE)
    await c.aclose()


async def test_async_errors_and_unreachable(target: RedisServer, backend: str) -> None:
    c = idem.asyncio.IdemClient(aredis.Redis(port=target.port), backend=backend)
    with pytest.raises(errors.BadArgError):
        await c.begin(key(), b"fp", ttl=0.0, lease=10**12)
    with pytest.raises(errors.NotFoundError):
        await c.touch(key(), 1, 1)
    await c.aclose()
    dead = idem.asyncio.IdemClient.from_url(f"redis://127.0.0.1:{free_port()}/", call_timeout=0.5)
    with pytest.raises(errors.UnavailableError):
        await dead.begin(key(), b"fp", ttl=60)
    await dead.aclose()
