"""Read-through from the writer's Postgres mirror (sync and asyncio), on a
database of its own with the writer's migrations."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import idem
import idem.asyncio
from idem import errors
from idem.testing import free_port
from idem.types import InFlight, Mismatch, New, Replay, StoredResponse

from conftest import Blackhole, key

STORED = StoredResponse(201, b'{"id":"pay_1"}', (("content-type", b"application/json"),))


def mirror(
    url: str,
    k: str,
    fingerprint: bytes,
    response: StoredResponse = STORED,
    *,
    expires_in: timedelta = timedelta(hours=1),
    status: str = "completed",
) -> None:
    """A row as the writer leaves it."""
    flat = [x for name, value in response.headers for x in (name.encode(), value)]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO idempotency_keys (key, fingerprint, status, token, created_at,"
            " expires_at, response_status, response_body, response_headers, completed_at)"
            " VALUES (%s, %s, %s, 1, now(), %s, %s, %s, %s, now())",
            (k, idem.stored_hex(fingerprint), status, datetime.now(timezone.utc) + expires_in,
             response.status, response.body, flat),
        )  # fmt: skip


@pytest.fixture
def pool(database_url: str) -> Iterator[ConnectionPool]:
    with ConnectionPool(database_url, min_size=1, max_size=2, open=True) as p:
        yield p


@pytest.fixture
async def apool(database_url: str) -> AsyncIterator[AsyncConnectionPool]:
    async with AsyncConnectionPool(database_url, min_size=1, max_size=2, open=False) as p:
        yield p


def test_replays_from_the_mirror_and_refills_redis(
    client: idem.IdemClient, pool: ConnectionPool, database_url: str
) -> None:
    rt = idem.ReadThrough(pool)
    k = key()
    mirror(database_url, k, b"fp")
    assert rt.begin(client, k, b"fp", ttl=60) == Replay(STORED)
    record = client.get(k)
    assert record is not None and record.state == "completed"
    assert record.mirror == "mirrored" and record.response == STORED
    # Redis answers from now on.
    assert client.begin(k, b"fp", ttl=60) == Replay(STORED)


def test_no_row_is_new_and_another_fingerprint_a_mismatch(
    client: idem.IdemClient, pool: ConnectionPool, database_url: str
) -> None:
    rt = idem.ReadThrough(pool)
    k = key()
    assert isinstance(rt.begin(client, k, b"fp", ttl=60), New)
    other = key()
    mirror(database_url, other, b"fp")
    assert rt.begin(client, other, b"another request", ttl=60) == Mismatch()
    assert client.get(other) is None, "the key is released"


def test_expired_and_unfinished_rows_are_ignored(
    client: idem.IdemClient, pool: ConnectionPool, database_url: str
) -> None:
    rt = idem.ReadThrough(pool)
    expired, unfinished = key(), key()
    mirror(database_url, expired, b"fp", expires_in=timedelta(seconds=-1))
    mirror(database_url, unfinished, b"fp", status="in_progress")
    assert isinstance(rt.begin(client, expired, b"fp", ttl=60), New)
    assert isinstance(rt.begin(client, unfinished, b"fp", ttl=60), New)


def test_a_key_redis_holds_never_reaches_postgres(
    client: idem.IdemClient, pool: ConnectionPool, database_url: str
) -> None:
    rt = idem.ReadThrough(pool)
    k = key()
    assert isinstance(client.begin(k, b"fp", ttl=60, lease=5), New)
    mirror(database_url, k, b"fp")
    assert isinstance(rt.begin(client, k, b"fp", ttl=60), InFlight)


def test_an_unreachable_mirror_is_unavailable_and_releases(client: idem.IdemClient) -> None:
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?connect_timeout=1"
    with ConnectionPool(dead, min_size=0, max_size=1, open=True) as broken:
        rt = idem.ReadThrough(broken, timeout=0.5)
        k = key()
        with pytest.raises(errors.PostgresError) as err:
            rt.begin(client, k, b"fp", ttl=60)
        assert err.value.is_unavailable and err.value.is_unreachable
        assert client.get(k) is None, "the key is released"


def test_bad_rows_are_postgres_errors(
    client: idem.IdemClient, pool: ConnectionPool, database_url: str
) -> None:
    k = key()
    mirror(database_url, k, b"fp", StoredResponse(200, b"", (("x", b"1"),)))
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE idempotency_keys SET response_headers = '{\"\\\\x78\"}' WHERE key = %s", (k,)
        )
    with pytest.raises(errors.PostgresError, match="odd number"):
        idem.ReadThrough(pool).lookup(k)


async def test_async_read_through(
    aclient: idem.asyncio.IdemClient, apool: AsyncConnectionPool, database_url: str
) -> None:
    rt = idem.AsyncReadThrough(apool)
    k = key()
    mirror(database_url, k, b"fp")
    assert await rt.begin(aclient, k, b"fp", ttl=60) == Replay(STORED)
    record = await aclient.get(k)
    assert record is not None and record.mirror == "mirrored"
    other = key()
    mirror(database_url, other, b"fp")
    assert await rt.begin(aclient, other, b"x", ttl=60) == Mismatch()
    assert isinstance(await rt.begin(aclient, key(), b"fp", ttl=60), New)


async def test_async_unreachable_mirror(aclient: idem.asyncio.IdemClient) -> None:
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?connect_timeout=1"
    async with AsyncConnectionPool(dead, min_size=0, max_size=1, open=False) as broken:
        rt = idem.AsyncReadThrough(broken, timeout=0.5)
        k = key()
        with pytest.raises(errors.PostgresError):
            await rt.begin(aclient, k, b"fp", ttl=60)
        assert await aclient.get(k) is None


async def test_a_blackholed_mirror_answers_within_the_timeout(
    aclient: idem.asyncio.IdemClient, database_url: str, blackhole: Blackhole
) -> None:
    # Postgres stops answering mid-connection (no reset, no refusal): the
    # lookup gives up after its timeout, not after psycopg's cancel of the
    # query (which waits on the same dead path; it took 10.5 s for 0.5 s).
    async with AsyncConnectionPool(
        blackhole.url(database_url), min_size=1, max_size=1, open=False
    ) as pool:
        await pool.wait()
        rt = idem.AsyncReadThrough(pool, timeout=0.5)
        k = key()
        assert isinstance(await rt.begin(aclient, k, b"fp", ttl=60), New)
        await aclient.abort(k, (await aclient.get(k)).token)  # type: ignore[union-attr]
        blackhole.freeze()
        started = time.monotonic()
        with pytest.raises(errors.PostgresError, match=r"within 0\.5 s"):
            await rt.begin(aclient, k, b"fp", ttl=60)
        took = time.monotonic() - started
        assert took < 1.5, f"the lookup took {took:.1f} s"
        assert await aclient.get(k) is None, "released"
        blackhole.thaw()
