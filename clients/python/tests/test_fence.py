"""The Postgres fence (sync and asyncio) on the writer's table: durable
claims with a lease, completion only while held, takeover after the lease,
release, the one-transaction shape, concurrency, both table layouts."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import idem
import idem._fence_core
import idem._spec
import idem.fence
from idem.fence import AsyncFence, Committed, Fence, Held, Lost, Proceed
from idem.types import InFlight, Mismatch, Replay, StoredResponse

from conftest import SlowLink, moving_takeover, waiting_for_a_lock

CREATED = StoredResponse(201, b'{"id":1}', (("content-type", b"application/json"),))
_tokens = iter(range(1_000_000, 10**9))


def token() -> int:
    return next(_tokens)


def new_key() -> str:
    return f"idem:{{t:{uuid.uuid4().hex}}}"


@pytest.fixture
def pool(fence_database_url: str) -> Iterator[ConnectionPool]:
    with ConnectionPool(fence_database_url, min_size=1, max_size=4, open=True) as p:
        yield p


def pay(conn: psycopg.Connection[Any], key: str, amount: int = 10) -> None:
    conn.execute("INSERT INTO payments (key, amount) VALUES (%s, %s)", (key, amount))


def payments(url: str, key: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM payments WHERE key = %s", (key,)).fetchone()
        assert row is not None
        return int(row[0])


def test_claim_commit_replay(pool: ConnectionPool, fence_database_url: str) -> None:
    k = new_key()
    fence = Fence(k, token(), b"fp", 60, lease=30)
    assert fence.claim(pool) == Proceed()
    # While the lease runs, another holder (a retry Redis let in) waits.
    assert Fence(k, token(), b"fp", 60).claim(pool) == InFlight(1000)
    assert Fence(k, token(), b"other", 60).claim(pool) == Mismatch()
    with pool.connection() as conn:
        pay(conn, k)
        assert fence.commit(conn, CREATED) == Committed()
    assert payments(fence_database_url, k) == 1
    assert Fence(k, token(), b"fp", 60).claim(pool) == Replay(CREATED)
    assert Fence(k, token(), b"other", 60).claim(pool) == Mismatch()
    # Claiming again with the holder's own token is idempotent until completed.
    again = new_key()
    same = Fence(again, token(), b"fp", 60)
    assert same.claim(pool) == Proceed()
    assert same.claim(pool) == Proceed()


def test_a_lapsed_lease_is_taken_over_and_the_old_holder_commits_nothing(
    pool: ConnectionPool, fence_database_url: str
) -> None:
    k = new_key()
    slow = Fence(k, token(), b"fp", 60, lease=0.2)
    assert slow.claim(pool) == Proceed()
    time.sleep(0.3)
    retry = Fence(k, token(), b"fp", 60, lease=30)
    assert retry.claim(pool) == Proceed()
    with pool.connection() as conn:
        pay(conn, k)
        lost = slow.commit(conn, CREATED)
    assert isinstance(lost, Lost) and lost.claim == InFlight(1000)
    assert payments(fence_database_url, k) == 0, "the stale holder's effect rolled back"
    with pool.connection() as conn:
        pay(conn, k)
        assert retry.commit(conn, StoredResponse(201, b"retry")) == Committed()
    assert payments(fence_database_url, k) == 1
    # The stale holder now finds the retry's answer.
    with pool.connection() as conn:
        late = slow.commit(conn, CREATED)
    assert late == Lost(Replay(StoredResponse(201, b"retry")))


def test_release_lets_the_next_claim_proceed_at_once(pool: ConnectionPool) -> None:
    k = new_key()
    fence = Fence(k, token(), b"fp", 60, lease=30)
    assert fence.claim(pool) == Proceed()
    fence.release(pool)
    assert Fence(k, token(), b"fp", 60).claim(pool) == Proceed()


def test_hold_renews_the_lease(pool: ConnectionPool) -> None:
    k = new_key()
    fence = Fence(k, token(), b"fp", 60, lease=0.3)
    assert fence.claim(pool) == Proceed()
    time.sleep(0.2)
    with pool.connection() as conn:
        assert fence.hold(conn) == Held()
    time.sleep(0.2)  # past the first lease, within the renewed one
    assert Fence(k, token(), b"fp", 60).claim(pool) == InFlight(1000)


def test_the_one_transaction_shape(pool: ConnectionPool, fence_database_url: str) -> None:
    k = new_key()
    fence = Fence(k, token(), b"fp", 60)
    with pool.connection() as conn:
        assert fence.claim_in(conn) == Proceed()
        pay(conn, k)
        conn.rollback()
    # The rollback took the claim with it.
    second = Fence(k, token(), b"fp", 60)
    with pool.connection() as conn:
        assert second.claim_in(conn) == Proceed()
        # An open holder's transaction makes others InFlight at once.
        assert Fence(k, token(), b"fp", 60).claim(pool) == InFlight(1000)
        pay(conn, k)
        assert second.commit(conn, CREATED) == Committed()
    assert payments(fence_database_url, k) == 1
    assert Fence(k, token(), b"fp", 60).claim(pool) == Replay(CREATED)


def test_concurrent_holders_commit_one_effect(
    pool: ConnectionPool, fence_database_url: str
) -> None:
    k = new_key()
    answers: list[Any] = []
    lock = threading.Lock()

    def attempt() -> None:
        fence = Fence(k, token(), b"fp", 60, lease=30)
        claim = fence.claim(pool)
        if claim == Proceed():
            with pool.connection() as conn:
                pay(conn, k)
                claim = fence.commit(conn, CREATED)
        with lock:
            answers.append(claim)

    threads = [threading.Thread(target=attempt) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert payments(fence_database_url, k) == 1
    assert answers.count(Committed()) == 1
    assert all(a in (Committed(), InFlight(1000), Replay(CREATED)) for a in answers)


def test_the_downstream_key_follows_the_request() -> None:
    first = Fence("idem:{a:k}", 10, b"fp", 60)
    assert first.downstream_key() == Fence("idem:{a:k}", 20, b"fp", 60).downstream_key()
    assert first.downstream_key() == idem.downstream_key("idem:{a:k}", b"fp")
    assert first.downstream_key() != Fence("idem:{a:k}", 30, b"x", 60).downstream_key()
    with pytest.raises(ValueError, match="positive"):
        Fence("k", 0, b"fp", 60)


def test_the_partitioned_layout(partitioned_database_url: str) -> None:
    with ConnectionPool(partitioned_database_url, min_size=1, max_size=2, open=True) as pool:
        k = new_key()
        fence = Fence(k, token(), b"fp", 60, layout="partitioned")
        assert fence.claim(pool) == Proceed()
        assert Fence(k, token(), b"fp", 60, layout="partitioned").claim(pool) == InFlight(1000)
        with pool.connection() as conn:
            pay(conn, k)
            assert fence.commit(conn, CREATED) == Committed()
        assert Fence(k, token(), b"fp", 60, layout="partitioned").claim(pool) == Replay(CREATED)
        # A stricter transaction could claim a key twice there: refused.
        with pool.connection() as conn:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            with pytest.raises(idem.PostgresError, match="READ COMMITTED"):
                Fence(new_key(), token(), b"fp", 60, layout="partitioned").claim_in(conn)
            conn.rollback()
        # The default layout's claim fails on a partitioned table, saying why.
        with pytest.raises(idem.PostgresError, match="looks partitioned"):
            Fence(new_key(), token(), b"fp", 60).claim(pool)


async def test_async_fence(fence_database_url: str) -> None:
    async with AsyncConnectionPool(fence_database_url, min_size=1, max_size=2, open=False) as p:
        k = new_key()
        fence = AsyncFence(k, token(), b"fp", 60, lease=0.3)
        assert await fence.claim(p) == Proceed()
        assert await AsyncFence(k, token(), b"fp", 60).claim(p) == InFlight(1000)
        async with p.connection() as conn:
            assert await fence.hold(conn) == Held()
            await conn.commit()
            await conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1)", (k,))
            assert await fence.commit(conn, CREATED) == Committed()
        assert await AsyncFence(k, token(), b"x", 60).claim(p) == Mismatch()
        assert await AsyncFence(k, token(), b"fp", 60).claim(p) == Replay(CREATED)
        other = new_key()
        first = AsyncFence(other, token(), b"fp", 60)
        assert await first.claim(p) == Proceed()
        await first.release(p)
        assert await AsyncFence(other, token(), b"fp", 60).claim(p) == Proceed()
    assert payments(fence_database_url, k) == 1


def test_a_durable_claim_on_an_autocommit_connection(fence_database_url: str) -> None:
    with psycopg.connect(fence_database_url, autocommit=True) as conn:
        k = new_key()
        fence = Fence(k, token(), b"fp", 60)
        assert fence.claim(conn) == Proceed()
        with psycopg.connect(fence_database_url) as other:
            assert Fence(k, token(), b"fp", 60).claim(other) == InFlight(1000)
        fence.release(conn)
        assert Fence(k, token(), b"fp", 60).claim(conn) == Proceed()
        # Inside a transaction a durable claim is refused: it would not be durable.
        with conn.transaction():
            conn.execute("SELECT 1")
            with pytest.raises(idem.PostgresError, match="outside any"):
                Fence(new_key(), token(), b"fp", 60).claim(conn)


def test_a_partitioned_durable_claim_is_read_committed_whatever_the_default(
    partitioned_database_url: str,
) -> None:
    # The Rust fence begins its claiming transaction at READ COMMITTED; a
    # REPEATABLE READ default must not turn every durable claim into an error.
    with psycopg.connect(partitioned_database_url, autocommit=True) as conn:
        conn.execute("SET default_transaction_isolation = 'repeatable read'")
        k = new_key()
        fence = Fence(k, token(), b"fp", 60, layout="partitioned")
        assert fence.claim(conn) == Proceed()
        assert Fence(k, token(), b"fp", 60, layout="partitioned").claim(conn) == InFlight(1000)


def test_a_frozen_partitioned_claimer_holds_the_gate_no_longer_than_its_idle_timeout(
    partitioned_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The partitioned durable claim runs two statements in a transaction of
    # its own; a claimer frozen (or vanished) between them holds the key's
    # gate. The fence's idle timeout (the lease) bounds that: Postgres ends
    # the session and a retry proceeds.
    k = new_key()
    frozen = Fence(k, token(), b"fp", 60, lease=0.4, layout="partitioned")
    run_statement = Fence._raw

    def freezing(self: Fence, conn: psycopg.Connection[Any], name: str, params: list[Any]) -> Any:
        cursor = run_statement(self, conn, name, params)
        if self is frozen and name == "partitioned_gate":
            time.sleep(2.0)
        return cursor

    monkeypatch.setattr(Fence, "_raw", freezing)
    errors: list[Exception] = []

    def claim_and_freeze() -> None:
        with psycopg.connect(partitioned_database_url, autocommit=True) as conn:
            try:
                frozen.claim(conn)
            except idem.PostgresError as err:
                errors.append(err)

    thread = threading.Thread(target=claim_and_freeze)
    thread.start()
    try:
        time.sleep(1.2)  # well past the idle timeout, the claimer still frozen
        with psycopg.connect(partitioned_database_url, autocommit=True) as conn:
            retry = Fence(k, token(), b"fp", 60, layout="partitioned").claim(conn)
    finally:
        thread.join()
    assert retry == Proceed(), "the frozen claimer still held the gate"
    assert errors, "Postgres ended the frozen claimer's session"


def _row_of(url: str, key: str) -> tuple[Any, ...] | None:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT * FROM idempotency_keys WHERE key = %s", (key,)).fetchone()


def test_writes_outside_a_transaction_are_refused(
    pool: ConnectionPool, fence_database_url: str
) -> None:
    # On an autocommit connection outside a transaction each statement commits
    # on its own: the write gate's lock ends with its statement, and a Lost
    # holder's rollback undoes nothing (its payment stays, the retry pays
    # again). complete, commit, hold and claim_in refuse such a connection
    # and write nothing.
    k = new_key()
    fence = Fence(k, token(), b"fp", 60, lease=30)
    assert fence.claim(pool) == Proceed()
    before = _row_of(fence_database_url, k)
    with psycopg.connect(fence_database_url, autocommit=True) as conn:
        for write in (
            lambda: fence.complete(conn, CREATED),
            lambda: fence.commit(conn, CREATED),
            lambda: fence.hold(conn),
        ):
            with pytest.raises(idem.PostgresError, match="in a transaction"):
                write()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        fresh = new_key()
        with pytest.raises(idem.PostgresError, match="in a transaction"):
            Fence(fresh, token(), b"fp", 60).claim_in(conn)
        assert _row_of(fence_database_url, fresh) is None, "claim_in wrote nothing"
        assert _row_of(fence_database_url, k) == before, "nothing written"
        # In an explicit transaction the same connection works.
        with conn.transaction():
            pay(conn, k)
            assert fence.complete(conn, CREATED) == Committed()
    assert payments(fence_database_url, k) == 1
    assert Fence(k, token(), b"fp", 60).claim(pool) == Replay(CREATED)


async def test_async_writes_outside_a_transaction_are_refused(fence_database_url: str) -> None:
    k = new_key()
    fence = AsyncFence(k, token(), b"fp", 60, lease=30)
    async with await psycopg.AsyncConnection.connect(fence_database_url, autocommit=True) as conn:
        assert await fence.claim(conn) == Proceed()
        before = _row_of(fence_database_url, k)
        for write in (
            lambda: fence.complete(conn, CREATED),
            lambda: fence.commit(conn, CREATED),
            lambda: fence.hold(conn),
        ):
            with pytest.raises(idem.PostgresError, match="in a transaction"):
                await write()
        fresh = new_key()
        with pytest.raises(idem.PostgresError, match="in a transaction"):
            await AsyncFence(fresh, token(), b"fp", 60).claim_in(conn)
        assert _row_of(fence_database_url, fresh) is None, "claim_in wrote nothing"
        assert _row_of(fence_database_url, k) == before, "nothing written"
        async with conn.transaction():
            await conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1)", (k,))
            assert await fence.complete(conn, CREATED) == Committed()
    assert payments(fence_database_url, k) == 1


def test_commit_rolls_back_when_complete_fails(
    pool: ConnectionPool, fence_database_url: str
) -> None:
    # Another transaction holds the key's write gate: complete's gate gives
    # up after the idle timeout (the lease), and commit rolls the payment back
    # at once instead of leaving the failed transaction open on the connection.
    k = new_key()
    fence = Fence(k, token(), b"fp", 60, lease=0.3)
    assert fence.claim(pool) == Proceed()
    with pool.connection() as gate, psycopg.connect(fence_database_url) as conn:
        holder = Fence(k, fence.token, b"fp", 60, lease=0.3, idle_timeout=None)
        assert holder.hold(gate) == Held()
        pay(conn, k)
        with pytest.raises(idem.PostgresError, match="lock timeout"):
            fence.commit(conn, CREATED)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        gate.rollback()
    assert payments(fence_database_url, k) == 0


@pytest.fixture(params=["pipelined", "sequential"])
def commit_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with ``commit`` in each of its forms: the completion and
    COMMIT in one round trip (pipeline mode), and one after the other (what
    it does with a libpq without pipeline mode)."""
    form = str(request.param)
    if form == "pipelined":
        assert psycopg.Pipeline.is_supported(), "this libpq cannot pipeline"
    else:
        # The twins ask ``idem._fence_core`` at each commit.
        monkeypatch.setattr(idem._fence_core, "_pipelined", lambda: False)
    return form


def _session_state(url: str, pid: int) -> str | None:
    """The session's state as another connection sees it (pg_stat_activity)."""
    with psycopg.connect(url, autocommit=True) as other:
        row = other.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        return None if row is None else str(row[0])


def test_a_lost_commit_leaves_the_session_outside_any_transaction(
    pool: ConnectionPool, fence_database_url: str, commit_form: str
) -> None:
    # The stale holder's completion finds the row taken over: nothing of its
    # transaction commits, and its session ends outside any transaction (not
    # "idle in transaction (aborted)", holding the payment's locks), ready
    # for the next statement.
    k = new_key()
    slow = Fence(k, token(), b"fp", 60, lease=0.2)
    assert slow.claim(pool) == Proceed()
    time.sleep(0.3)
    retry = Fence(k, token(), b"fp", 60, lease=30)
    assert retry.claim(pool) == Proceed()
    with psycopg.connect(fence_database_url) as conn:
        pay(conn, k)
        assert slow.commit(conn, CREATED) == Lost(InFlight(1000))
        assert _session_state(fence_database_url, conn.info.backend_pid) == "idle"
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert payments(fence_database_url, k) == 0, "the stale holder's payment rolled back"
        with psycopg.connect(fence_database_url) as other:
            held = other.execute(
                "SELECT status, token FROM idempotency_keys WHERE key = %s", (k,)
            ).fetchone()
        assert held == ("in_progress", retry.token), "the retry still holds the key"
        # The same connection then commits the retry's payment.
        pay(conn, k)
        assert retry.commit(conn, StoredResponse(201, b"retry")) == Committed()
        # And the stale holder, once more, finds the retry's answer.
        pay(conn, k)
        assert slow.commit(conn, CREATED) == Lost(Replay(StoredResponse(201, b"retry")))
        assert _session_state(fence_database_url, conn.info.backend_pid) == "idle"
    assert payments(fence_database_url, k) == 1


async def test_async_lost_commit_leaves_the_session_outside_any_transaction(
    fence_database_url: str, commit_form: str
) -> None:
    k = new_key()
    async with await psycopg.AsyncConnection.connect(fence_database_url) as conn:
        slow = AsyncFence(k, token(), b"fp", 60, lease=0.2)
        assert await slow.claim(conn) == Proceed()
        await asyncio.sleep(0.3)
        retry = AsyncFence(k, token(), b"fp", 60, lease=30)
        assert await retry.claim(conn) == Proceed()
        await conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1)", (k,))
        assert await slow.commit(conn, CREATED) == Lost(InFlight(1000))
        assert _session_state(fence_database_url, conn.info.backend_pid) == "idle"
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert payments(fence_database_url, k) == 0
        await conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1)", (k,))
        assert await retry.commit(conn, CREATED) == Committed()
    assert payments(fence_database_url, k) == 1


def _assert_moved_and_lost(url: str, k: str, taker: int, pid: int) -> None:
    assert _session_state(url, pid) == "idle"
    assert payments(url, k) == 0, "the stale holder's payment rolled back"
    with psycopg.connect(url) as other:
        held = other.execute(
            "SELECT status, token, tableoid::regclass::text FROM idempotency_keys WHERE key = %s",
            (k,),
        ).fetchone()
    assert held == ("in_progress", taker, "idempotency_keys_d2"), "the takeover holds the key"


def test_a_commit_whose_row_a_takeover_moved_is_lost(
    daily_partitioned_database_url: str, commit_form: str
) -> None:
    # On the partitioned layout the stale holder's completion waits for the
    # gate a takeover holds; the takeover, with a longer TTL, moved the row
    # to another day's partition. Once it commits, the completion fails with
    # a serialization failure (40001, under READ COMMITTED too): commit
    # answers Lost with what the row holds, and nothing of it commits.
    url = daily_partitioned_database_url
    k = new_key()
    slow = Fence(k, token(), b"fp", 60, lease=0.2, idle_timeout=5, layout="partitioned")
    with psycopg.connect(url, autocommit=True) as conn:
        assert slow.claim(conn) == Proceed()
    time.sleep(0.3)  # the lease lapses
    with psycopg.connect(url) as conn:
        pay(conn, k)
        taker_conn, taker = moving_takeover(url, k, token())
        with taker_conn:
            answer: list[object] = []
            waiting = threading.Thread(target=lambda: answer.append(slow.commit(conn, CREATED)))
            waiting.start()
            try:
                waiting_for_a_lock(url, conn.info.backend_pid)
            finally:
                taker_conn.commit()
                waiting.join()
        assert answer == [Lost(InFlight(1000))]
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        _assert_moved_and_lost(url, k, taker, conn.info.backend_pid)


async def test_async_commit_whose_row_a_takeover_moved_is_lost(
    daily_partitioned_database_url: str, commit_form: str
) -> None:
    url = daily_partitioned_database_url
    k = new_key()
    slow = AsyncFence(k, token(), b"fp", 60, lease=0.2, idle_timeout=5, layout="partitioned")
    async with await psycopg.AsyncConnection.connect(url) as conn:
        assert await slow.claim(conn) == Proceed()
        await asyncio.sleep(0.3)
        await conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1)", (k,))
        taker_conn, taker = await asyncio.to_thread(moving_takeover, url, k, token())
        with taker_conn:
            committing = asyncio.create_task(slow.commit(conn, CREATED))
            try:
                await asyncio.to_thread(waiting_for_a_lock, url, conn.info.backend_pid)
            finally:
                await asyncio.to_thread(taker_conn.commit)
            assert await committing == Lost(InFlight(1000))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        await asyncio.to_thread(_assert_moved_and_lost, url, k, taker, conn.info.backend_pid)


def test_moved_is_a_serialization_failure_anywhere_in_the_chain() -> None:
    failure = psycopg.errors.SerializationFailure("tuple to be locked was already moved")
    assert idem.fence._moved(failure)
    assert not idem.fence._moved(psycopg.errors.LockNotAvailable("lock timeout"))

    # psycopg's pipeline may raise the skipped COMMIT's PipelineAborted, the
    # completion's failure as its context.
    def aborted_after(err: psycopg.Error) -> None:
        try:
            raise err
        except psycopg.Error:
            raise psycopg.errors.PipelineAborted("pipeline aborted")  # noqa: B904

    with pytest.raises(psycopg.errors.PipelineAborted) as raised:
        aborted_after(failure)
    assert idem.fence._moved(raised.value)

    # A serialization failure that left the row this holder's is its own
    # transaction's failure, not a takeover: commit raises it (None here).
    fence = Fence(new_key(), token(), b"fp", 60, layout="partitioned")
    mine = (fence.fingerprint_hex, "in_progress", fence.token, True, None, None, [])
    taken = (fence.fingerprint_hex, "in_progress", fence.token + 1, True, None, None, [])
    assert fence._failed(failure, mine) is None
    assert fence._failed(failure, taken) == Lost(InFlight(1000))
    assert fence._failed(failure, None) == Lost(InFlight(1000))


async def test_commit_is_one_round_trip(fence_database_url: str, slow_link: SlowLink) -> None:
    # Every answer from Postgres comes 0.2 s late: a commit of the pipelined
    # form waits for one, the sequential form (complete, then COMMIT) for two.
    async def commit_time(fence: AsyncFence) -> float:
        async with await psycopg.AsyncConnection.connect(slow_link.url(fence_database_url)) as conn:
            assert await fence.claim(conn) == Proceed()
            await conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1)", (fence.key,))
            started = time.monotonic()
            assert await fence.commit(conn, CREATED) == Committed()
            elapsed = time.monotonic() - started
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            return elapsed

    pipelined = await commit_time(AsyncFence(new_key(), token(), b"fp", 60))
    assert slow_link.delay <= pipelined < 1.5 * slow_link.delay
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(idem._fence_core, "_pipelined", lambda: False)
        sequential = await commit_time(AsyncFence(new_key(), token(), b"fp", 60))
    assert sequential >= 2 * slow_link.delay, "the measure tells one round trip from two"


def test_commit_without_an_effect_on_a_fresh_connection(
    pool: ConnectionPool, fence_database_url: str, commit_form: str
) -> None:
    # psycopg opens the transaction at the completion itself.
    k = new_key()
    fence = Fence(k, token(), b"fp", 60)
    assert fence.claim(pool) == Proceed()
    with psycopg.connect(fence_database_url) as conn:
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert fence.commit(conn, CREATED) == Committed()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert Fence(k, token(), b"fp", 60).claim(pool) == Replay(CREATED)


def test_commit_inside_a_transaction_block_is_refused(
    pool: ConnectionPool, fence_database_url: str
) -> None:
    # commit ends the transaction itself; in a conn.transaction() block it
    # is refused before anything is sent (the block goes on: here it rolls
    # the payment back).
    k = new_key()
    fence = Fence(k, token(), b"fp", 60)
    assert fence.claim(pool) == Proceed()
    before = _row_of(fence_database_url, k)
    for autocommit in (True, False):
        with psycopg.connect(fence_database_url, autocommit=autocommit) as conn:
            refused: list[idem.PostgresError] = []
            with conn.transaction():
                pay(conn, k)
                try:
                    fence.commit(conn, CREATED)
                except idem.PostgresError as err:
                    refused.append(err)
                    raise psycopg.Rollback() from err
            assert refused and "outside conn.transaction()" in str(refused[0])
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert payments(fence_database_url, k) == 0
    assert _row_of(fence_database_url, k) == before


def test_commit_inside_a_pipeline_block_is_refused(
    pool: ConnectionPool, fence_database_url: str
) -> None:
    # commit sends its completion and COMMIT in a pipeline of its own; in the
    # caller's conn.pipeline() block it is refused, before anything is sent,
    # saying so.
    k = new_key()
    fence = Fence(k, token(), b"fp", 60)
    assert fence.claim(pool) == Proceed()
    before = _row_of(fence_database_url, k)
    for effect in (True, False):
        with psycopg.connect(fence_database_url) as conn:
            with conn.pipeline():
                if effect:
                    pay(conn, k)
                with pytest.raises(idem.PostgresError) as refused:
                    fence.commit(conn, CREATED)
            assert "outside conn.pipeline()" in str(refused.value)
            conn.rollback()
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert payments(fence_database_url, k) == 0
    assert _row_of(fence_database_url, k) == before


def test_the_not_held_failure_is_the_specs() -> None:
    # commit tells "not held" from other failures by these; the spec states them.
    spec = idem._spec.load("fence.json")
    complete = spec["statements"]["complete"]
    assert idem.fence.NOT_HELD_SQLSTATE == spec["not_held"]["sqlstate"] == "22P02"
    assert spec["not_held"]["message_contains"] == idem.fence.NOT_HELD_MESSAGE
    assert idem.fence.NOT_HELD_MESSAGE in complete["sql"]
    assert complete["params"][-1] == "fail_when_not_held"
    message = f'invalid input syntax for type boolean: "{idem.fence.NOT_HELD_MESSAGE}: f"'
    not_held = psycopg.errors.InvalidTextRepresentation(message)
    assert idem.fence._not_held(not_held)
    assert not idem.fence._not_held(psycopg.errors.InvalidTextRepresentation("another cast"))
    assert not idem.fence._not_held(psycopg.errors.LockNotAvailable(message))

    # psycopg's pipeline may raise the skipped COMMIT's PipelineAborted, the
    # completion's failure as its context.
    def aborted_after(err: psycopg.Error) -> None:
        try:
            raise err
        except psycopg.Error:
            raise psycopg.errors.PipelineAborted("pipeline aborted")  # noqa: B904

    with pytest.raises(psycopg.errors.PipelineAborted) as raised:
        aborted_after(not_held)
    assert idem.fence._not_held(raised.value)


def test_hold_takes_the_gate_until_the_transaction_ends(
    pool: ConnectionPool, fence_database_url: str
) -> None:
    # The renewal takes the key's gate: while its transaction is open every
    # claim answers InFlight, even past the renewed lease; once it ends the
    # lease alone decides, and a holder taken over gets Lost.
    k = new_key()
    fence = Fence(k, token(), b"fp", 60, lease=0.3, idle_timeout=None)
    assert fence.claim(pool) == Proceed()
    with psycopg.connect(fence_database_url) as conn:
        assert fence.hold(conn) == Held()
        time.sleep(0.5)  # past the renewed lease
        assert Fence(k, token(), b"fp", 60).claim(pool) == InFlight(1000)
        conn.rollback()  # the renewal rolls back with the phase
        retry = Fence(k, token(), b"fp", 60, lease=30)
        assert retry.claim(pool) == Proceed()
        assert fence.hold(conn) == Lost(InFlight(1000))
        conn.rollback()
        pay(conn, k)
        assert retry.commit(conn, CREATED) == Committed()
        assert fence.hold(conn) == Lost(Replay(CREATED))
        conn.rollback()


def test_a_holder_that_vanishes_after_hold_keeps_the_gate_no_longer_than_its_idle_timeout(
    pool: ConnectionPool, fence_database_url: str
) -> None:
    # hold sets the transaction's idle timeout (the lease by default): a
    # holder that stops after it has its session ended by Postgres, which
    # frees the gate; a retry then proceeds once the renewed lease is over.
    k = new_key()
    fence = Fence(k, token(), b"fp", 60, lease=0.4)
    assert fence.claim(pool) == Proceed()
    conn = psycopg.connect(fence_database_url)
    try:
        assert fence.hold(conn) == Held()
        time.sleep(1.2)  # frozen, well past the idle timeout and the lease
        assert Fence(k, token(), b"fp", 60).claim(pool) == Proceed(), "the gate was still held"
        assert _session_state(fence_database_url, conn.info.backend_pid) is None
    finally:
        conn.close()


async def test_async_hold(fence_database_url: str) -> None:
    k = new_key()
    async with await psycopg.AsyncConnection.connect(fence_database_url) as conn:
        fence = AsyncFence(k, token(), b"fp", 60, lease=0.3)
        assert await fence.claim(conn) == Proceed()
        assert await fence.hold(conn) == Held()
        await conn.commit()  # the renewed lease stands: a retry waits for it
        assert await AsyncFence(k, token(), b"fp", 60).claim(conn) == InFlight(1000)
        await asyncio.sleep(0.4)
        retry = AsyncFence(k, token(), b"fp", 60, lease=30)
        assert await retry.claim(conn) == Proceed()
        assert await fence.hold(conn) == Lost(InFlight(1000))
        await conn.rollback()
