"""The fence's one-statement commit, ``commit_effect`` (spec/fence.json
``protocol.commit_effect``), sync and asyncio, on both table layouts: the
completion and one INSERT, UPDATE or DELETE commit together in one
autocommitted statement, or neither does; a holder that lost the key gets
``Lost``; an effect that fails is the error, the key still held; other
statements and connections inside a transaction are refused, nothing sent."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import idem
import idem._spec
import idem.fence
from idem.fence import AsyncFence, Committed, Fence, Layout, Lost, Proceed, _Report
from idem.types import InFlight, Replay, StoredResponse

from conftest import SlowLink, moving_takeover, waiting_for_a_lock

CREATED = StoredResponse(201, b'{"id":1}', (("content-type", b"application/json"),))
RETRIED = StoredResponse(201, b'{"id":2}', (("content-type", b"application/json"),))
PAY = "INSERT INTO payments (key, amount) VALUES ($7, $8)"
IDLE = TransactionStatus.IDLE
_tokens = iter(range(10**9, 2 * 10**9))


def token() -> int:
    return next(_tokens)


def new_key() -> str:
    return f"idem:{{e:{uuid.uuid4().hex}}}"


@pytest.fixture(params=["unpartitioned", "partitioned"])
def layout(request: pytest.FixtureRequest) -> tuple[Layout, str]:
    """Each table layout with its database."""
    name: Layout = request.param
    fixture = "fence_database_url" if name == "unpartitioned" else "partitioned_database_url"
    return name, str(request.getfixturevalue(fixture))


def paid(url: str, key: str) -> list[int]:
    """The amounts of the payments made under ``key``."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT amount FROM payments WHERE key = %s ORDER BY id", (key,)
        ).fetchall()
    return [int(row[0]) for row in rows]


def row_of(url: str, key: str) -> tuple[Any, ...] | None:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT * FROM idempotency_keys WHERE key = %s", (key,)).fetchone()


def held_by(url: str, key: str) -> tuple[str, int] | None:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT status, token FROM idempotency_keys WHERE key = %s", (key,)
        ).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def claimed(url: str, fence: Fence) -> Fence:
    with psycopg.connect(url, autocommit=True) as conn:
        assert fence.claim(conn) == Proceed()
    return fence


@pytest.mark.parametrize("autocommit", [True, False])
def test_commit_effect_commits_the_effect_with_the_row(
    layout: tuple[Layout, str], autocommit: bool
) -> None:
    name, url = layout
    k = new_key()
    fence = claimed(url, Fence(k, token(), b"fp", 60, layout=name))
    report = fence._report = _Report()
    with psycopg.connect(url, autocommit=autocommit) as conn:
        assert fence.commit_effect(conn, CREATED, PAY, [k, 10]) == Committed()
        # Left as it was: outside any transaction, its autocommit setting kept.
        assert conn.info.transaction_status == IDLE
        assert conn.autocommit is autocommit
        assert Fence(k, token(), b"fp", 60, layout=name).claim(conn) == Replay(CREATED)
    assert paid(url, k) == [10]
    assert (report.kind, report.committed) == ("committed", CREATED), "the middleware is told"


def test_commit_effect_through_a_pool(layout: tuple[Layout, str]) -> None:
    name, url = layout
    with ConnectionPool(url, min_size=1, max_size=1, open=True) as pool:
        k = new_key()
        fence = Fence(k, token(), b"fp", 60, layout=name)
        assert fence.claim(pool) == Proceed()
        assert fence.commit_effect(pool, CREATED, PAY, (k, 10)) == Committed()
        assert Fence(k, token(), b"fp", 60, layout=name).claim(pool) == Replay(CREATED)
        with pool.connection() as conn:
            assert conn.autocommit is False, "the pool's connection switched back"
    assert paid(url, k) == [10]


def test_a_holder_that_lost_the_key_commits_nothing(layout: tuple[Layout, str]) -> None:
    # The stale holder's lease lapsed and a retry took the key over: its
    # statement commits nothing, the effect neither, and answers what the key
    # holds: InFlight while the retry runs, then the retry's response.
    name, url = layout
    k = new_key()
    slow = claimed(url, Fence(k, token(), b"fp", 60, lease=0.2, layout=name))
    report = slow._report = _Report()
    time.sleep(0.3)
    retry = claimed(url, Fence(k, token(), b"fp", 60, lease=30, layout=name))
    with psycopg.connect(url) as conn:
        assert slow.commit_effect(conn, CREATED, PAY, [k, 10]) == Lost(InFlight(1000))
        assert conn.info.transaction_status == IDLE
        assert paid(url, k) == [], "the stale holder's effect did not commit"
        assert held_by(url, k) == ("in_progress", retry.token), "the retry still holds the key"
        assert (report.kind, report.claim) == ("decided", InFlight(1000))
        assert retry.commit_effect(conn, RETRIED, PAY, [k, 20]) == Committed()
        assert slow.commit_effect(conn, CREATED, PAY, [k, 10]) == Lost(Replay(RETRIED))
        assert (report.kind, report.claim) == ("decided", Replay(RETRIED))
    assert paid(url, k) == [20]


@pytest.mark.parametrize("autocommit", [True, False])
def test_an_effect_that_fails_commits_nothing_and_the_key_stays_held(
    layout: tuple[Layout, str], autocommit: bool
) -> None:
    name, url = layout
    k = new_key()
    fence = claimed(url, Fence(k, token(), b"fp", 60, layout=name))
    report = fence._report = _Report()
    before = row_of(url, k)
    with psycopg.connect(url, autocommit=autocommit) as conn:
        with pytest.raises(idem.PostgresError, match="null value") as raised:
            fence.commit_effect(conn, CREATED, PAY, [None, 10])
        assert isinstance(raised.value.__cause__, psycopg.errors.NotNullViolation)
        assert conn.info.transaction_status == IDLE
        assert conn.autocommit is autocommit
        assert row_of(url, k) == before, "the completion did not commit"
        # The effect's own 22P02 is its error, not the fence's "not held".
        cast = "INSERT INTO payments (key, amount) VALUES ($7, $8::text::int)"
        with pytest.raises(idem.PostgresError) as raised:
            fence.commit_effect(conn, CREATED, cast, [k, "ten"])
        assert isinstance(raised.value.__cause__, psycopg.errors.InvalidTextRepresentation)
        assert row_of(url, k) == before
        assert report.kind == "unused", "the middleware was told nothing"
        # Still held: the same holder commits.
        assert fence.commit_effect(conn, CREATED, PAY, [k, 10]) == Committed()
    assert paid(url, k) == [10]


REFUSED = [
    "SELECT 1",
    "  select amount from payments",
    "WITH x AS (SELECT 1) INSERT INTO payments (key, amount) VALUES ($7, $8)",
    "-- the payment\nINSERT INTO payments (key, amount) VALUES ($7, $8)",
    "(INSERT INTO payments (key, amount) VALUES ($7, $8))",
    "INSERTED",
    "TRUNCATE payments",
    ";",
    "",
]


@pytest.mark.parametrize("effect", REFUSED)
def test_an_effect_other_than_one_insert_update_or_delete_is_refused(
    fence_database_url: str, effect: str
) -> None:
    url = fence_database_url
    k = new_key()
    fence = claimed(url, Fence(k, token(), b"fp", 60))
    before = row_of(url, k)
    with psycopg.connect(url) as conn:
        with pytest.raises(ValueError, match="INSERT, UPDATE or DELETE"):
            fence.commit_effect(conn, CREATED, effect, [k, 10])
        assert conn.info.transaction_status == IDLE, "nothing was sent"
        # Refused before the connection is looked at.
        conn.close()
        with pytest.raises(ValueError, match="INSERT, UPDATE or DELETE"):
            fence.commit_effect(conn, CREATED, effect, [k, 10])
    assert row_of(url, k) == before
    assert paid(url, k) == []


@pytest.mark.parametrize("effect", [PAY + ";", f"\n  {PAY.lower()} ;\n", f"{PAY};;", f"\t{PAY}\n"])
def test_a_trailing_semicolon_and_spacing_are_accepted(
    fence_database_url: str, effect: str
) -> None:
    url = fence_database_url
    k = new_key()
    fence = claimed(url, Fence(k, token(), b"fp", 60))
    with psycopg.connect(url) as conn:
        assert fence.commit_effect(conn, CREATED, effect, [k, 10]) == Committed()
    assert paid(url, k) == [10]


def test_update_and_delete_effects(layout: tuple[Layout, str]) -> None:
    name, url = layout
    k = new_key()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1), (%s, 2)", (k, k))
        fence = Fence(k, token(), b"fp", 60, layout=name)
        assert fence.claim(conn) == Proceed()
        update = "UPDATE payments SET amount = amount + $8 WHERE key = $7"
        assert fence.commit_effect(conn, CREATED, update, [k, 10]) == Committed()
        assert paid(url, k) == [11, 12]
        other = new_key()
        conn.execute("UPDATE payments SET key = %s WHERE key = %s AND amount = 11", (other, k))
        second = Fence(other, token(), b"fp", 60, layout=name)
        assert second.claim(conn) == Proceed()
        # The effect may use the fence's parameters: $1 is the key.
        delete = "delete from payments where key = $1;"
        assert second.commit_effect(conn, CREATED, delete) == Committed()
    assert paid(url, other) == []
    assert paid(url, k) == [12]


def test_a_connection_inside_a_transaction_is_refused(fence_database_url: str) -> None:
    url = fence_database_url
    k = new_key()
    fence = claimed(url, Fence(k, token(), b"fp", 60))
    before = row_of(url, k)
    for autocommit in (True, False):
        with psycopg.connect(url, autocommit=autocommit) as conn:
            refused: list[idem.PostgresError] = []
            with conn.transaction():
                conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1)", (k,))
                try:
                    fence.commit_effect(conn, CREATED, PAY, [k, 10])
                except idem.PostgresError as err:
                    refused.append(err)
                    raise psycopg.Rollback() from err
            assert refused and "outside any transaction" in str(refused[0])
            assert conn.info.transaction_status == IDLE
    with psycopg.connect(url) as conn:
        conn.execute("SELECT 1")  # psycopg began a transaction
        with pytest.raises(idem.PostgresError, match="outside any transaction"):
            fence.commit_effect(conn, CREATED, PAY, [k, 10])
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        conn.rollback()
        with conn.pipeline(), pytest.raises(idem.PostgresError, match=r"conn\.pipeline\(\)"):
            fence.commit_effect(conn, CREATED, PAY, [k, 10])
    assert row_of(url, k) == before
    assert paid(url, k) == []


def _assert_moved_and_lost(url: str, k: str, taker: int) -> None:
    assert paid(url, k) == [], "the stale holder's effect did not commit"
    with psycopg.connect(url) as other:
        held = other.execute(
            "SELECT status, token, tableoid::regclass::text FROM idempotency_keys WHERE key = %s",
            (k,),
        ).fetchone()
    assert held == ("in_progress", taker, "idempotency_keys_d2"), "the takeover holds the key"


@pytest.mark.parametrize("autocommit", [True, False])
def test_a_commit_effect_whose_row_a_takeover_moved_is_lost(
    daily_partitioned_database_url: str, autocommit: bool
) -> None:
    # On the partitioned layout the stale holder's statement waits for the
    # gate a takeover holds; the takeover, with a longer TTL, moved the row to
    # another day's partition. Once it commits, the statement fails with a
    # serialization failure (40001): Lost with what the row holds, the effect
    # not committed.
    url = daily_partitioned_database_url
    k = new_key()
    slow = Fence(k, token(), b"fp", 60, lease=0.2, idle_timeout=5, layout="partitioned")
    claimed(url, slow)
    time.sleep(0.3)  # the lease lapses
    with psycopg.connect(url, autocommit=autocommit) as conn:
        taker_conn, taker = moving_takeover(url, k, token())
        with taker_conn:
            answer: list[object] = []
            waiting = threading.Thread(
                target=lambda: answer.append(slow.commit_effect(conn, CREATED, PAY, [k, 10]))
            )
            waiting.start()
            try:
                waiting_for_a_lock(url, conn.info.backend_pid)
            finally:
                taker_conn.commit()
                waiting.join()
        assert answer == [Lost(InFlight(1000))]
        assert conn.info.transaction_status == IDLE
        assert conn.autocommit is autocommit
    _assert_moved_and_lost(url, k, taker)


async def test_async_commit_effect(layout: tuple[Layout, str]) -> None:
    name, url = layout
    async with AsyncConnectionPool(url, min_size=1, max_size=1, open=False) as pool:
        k = new_key()
        fence = AsyncFence(k, token(), b"fp", 60, layout=name)
        report = fence._report = _Report()
        assert await fence.claim(pool) == Proceed()
        assert await fence.commit_effect(pool, CREATED, PAY, [k, 10]) == Committed()
        assert (report.kind, report.committed) == ("committed", CREATED)
        assert await AsyncFence(k, token(), b"fp", 60, layout=name).claim(pool) == Replay(CREATED)
        async with pool.connection() as conn:
            assert conn.autocommit is False, "the pool's connection switched back"
    assert paid(url, k) == [10]

    k = new_key()
    async with await psycopg.AsyncConnection.connect(url) as conn:
        slow = AsyncFence(k, token(), b"fp", 60, lease=0.2, layout=name)
        assert await slow.claim(conn) == Proceed()
        # An effect that fails: the error, nothing committed, still held.
        with pytest.raises(idem.PostgresError, match="null value"):
            await slow.commit_effect(conn, CREATED, PAY, [None, 10])
        assert held_by(url, k) == ("in_progress", slow.token)
        with pytest.raises(ValueError, match="INSERT, UPDATE or DELETE"):
            await slow.commit_effect(conn, CREATED, "SELECT 1")
        await asyncio.sleep(0.3)
        retry = AsyncFence(k, token(), b"fp", 60, lease=30, layout=name)
        assert await retry.claim(conn) == Proceed()
        assert await slow.commit_effect(conn, CREATED, PAY, [k, 10]) == Lost(InFlight(1000))
        assert paid(url, k) == []
        assert await retry.commit_effect(conn, RETRIED, PAY + ";", [k, 20]) == Committed()
        assert await slow.commit_effect(conn, CREATED, PAY, [k, 10]) == Lost(Replay(RETRIED))
        assert conn.info.transaction_status == IDLE
        assert conn.autocommit is False
        await conn.execute("SELECT 1")
        with pytest.raises(idem.PostgresError, match="outside any transaction"):
            await retry.commit_effect(conn, RETRIED, PAY, [k, 30])
        await conn.rollback()
    assert paid(url, k) == [20]


async def test_async_commit_effect_whose_row_a_takeover_moved_is_lost(
    daily_partitioned_database_url: str,
) -> None:
    url = daily_partitioned_database_url
    k = new_key()
    slow = AsyncFence(k, token(), b"fp", 60, lease=0.2, idle_timeout=5, layout="partitioned")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        assert await slow.claim(conn) == Proceed()
        await asyncio.sleep(0.3)
        taker_conn, taker = await asyncio.to_thread(moving_takeover, url, k, token())
        with taker_conn:
            committing = asyncio.create_task(slow.commit_effect(conn, CREATED, PAY, [k, 10]))
            try:
                await asyncio.to_thread(waiting_for_a_lock, url, conn.info.backend_pid)
            finally:
                await asyncio.to_thread(taker_conn.commit)
            assert await committing == Lost(InFlight(1000))
        assert conn.info.transaction_status == IDLE
    await asyncio.to_thread(_assert_moved_and_lost, url, k, taker)


@pytest.mark.parametrize("autocommit", [True, False])
async def test_commit_effect_is_one_round_trip(
    fence_database_url: str, slow_link: SlowLink, autocommit: bool
) -> None:
    # Every answer from Postgres comes 0.2 s late: the completion with its
    # effect waits for one, whatever the connection's autocommit (no BEGIN
    # nor COMMIT of its own).
    url = slow_link.url(fence_database_url)
    async with await psycopg.AsyncConnection.connect(url, autocommit=autocommit) as conn:
        k = new_key()
        fence = AsyncFence(k, token(), b"fp", 60)
        assert await fence.claim(conn) == Proceed()
        started = time.monotonic()
        assert await fence.commit_effect(conn, CREATED, PAY, [k, 10]) == Committed()
        elapsed = time.monotonic() - started
        assert conn.info.transaction_status == IDLE
    assert slow_link.delay <= elapsed < 1.5 * slow_link.delay
    assert paid(fence_database_url, k) == [10]


def test_the_effect_statement_is_the_specs() -> None:
    # commit_effect's parameters follow the spec: the completion's (without
    # fail_when_not_held), then the effect's from effect_first_param.
    spec = idem._spec.load("fence.json")
    effect = spec["statements"]["complete_with_effect"]
    assert effect["params"] == spec["statements"]["complete"]["params"][:6]
    assert idem.fence.EFFECT_FIRST_PARAM == effect["effect_first_param"] == 7
    assert effect["sql"].count(effect["effect_placeholder"]) == 1
    sql = idem.fence._effect_statement(f" {PAY} ;")
    assert sql == effect["sql"].replace(effect["effect_placeholder"], PAY)
    fence = Fence(new_key(), token(), b"fp", 60, idle_timeout=1.5)
    params = fence._effect_params(CREATED, ["k", 10])
    assert params == [
        fence.key, fence.token, 201, CREATED.body,
        [b"content-type", b"application/json"], "1500", "k", 10,
    ]  # fmt: skip
