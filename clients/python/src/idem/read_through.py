"""Read-through from the Postgres mirror (spec/read_through.json): when Redis
answers ``new`` for a key the mirror still holds as completed, Redis lost
it; Redis is refilled from the mirror (``IDEM.COMPLETE ... MIRRORED``) and
the stored response answered, so a request never runs twice because Redis
lost data. ``ReadThrough`` (sync, over a ``psycopg_pool.ConnectionPool``)
and ``AsyncReadThrough`` (over an ``AsyncConnectionPool``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import psycopg_pool

from idem import _spec
from idem.errors import IdemError, PostgresError
from idem.fingerprint import stored_hex
from idem.types import Mismatch, New, Origin, Outcome, Replay, StoredResponse
from idem.wire import STATUS_MAX, STATUS_MIN, Duration

if TYPE_CHECKING:
    from idem.asyncio import IdemClient as AsyncIdemClient
    from idem.client import IdemClient

log = logging.getLogger("idem")


def _lookup_sql() -> str:
    # The spec writes Postgres' $1; psycopg takes %s.
    sql: str = _spec.load("read_through.json")["lookup_sql"]
    return sql.replace("$1", "%s")


LOOKUP_SQL = _lookup_sql()
DEFAULT_TIMEOUT = _spec.load("read_through.json")["timeout_ms"] / 1000
_SET_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"


@dataclass(frozen=True, slots=True)
class MirroredRecord:
    """A completed, unexpired row of the mirror."""

    fingerprint_hex: str
    """Lowercase hex SHA-256 of the fingerprint bytes sent to BEGIN."""
    response: StoredResponse


def decode_row(key: str, row: tuple[Any, ...]) -> MirroredRecord:
    """A row of ``LOOKUP_SQL``: fingerprint, status, body, flat headers."""
    fingerprint, status, body, flat = row
    if not isinstance(status, int) or not STATUS_MIN <= status <= STATUS_MAX:
        raise PostgresError(f"row for {key!r} has status {status!r}")
    items = [bytes(item) for item in (flat or [])]
    if len(items) % 2:
        raise PostgresError(f"row for {key!r} has an odd number of header items")
    headers = tuple(
        (items[i].decode("utf-8", "replace"), items[i + 1]) for i in range(0, len(items), 2)
    )
    return MirroredRecord(
        str(fingerprint).lower(), StoredResponse(status, bytes(body or b""), headers)
    )


def _millis(timeout: float) -> str:
    return f"{max(1, round(timeout * 1000))}ms"


class ReadThrough:
    """Looks keys up in the writer's ``idempotency_keys`` through ``pool``.
    A lookup is bounded by ``timeout`` (checkout and statement), 2 s by
    default. A blocking call cannot be abandoned: against a Postgres that
    stops answering (a partition) it waits until TCP gives up, unless the
    pool's connections are opened with ``connect_timeout`` and libpq's
    ``tcp_user_timeout`` (and keepalives), e.g. ``...?connect_timeout=2&
    tcp_user_timeout=2000&keepalives_idle=2&keepalives_interval=1&
    keepalives_count=2``. ``AsyncReadThrough`` gives up after ``timeout``."""

    def __init__(
        self, pool: psycopg_pool.ConnectionPool[Any], *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.pool = pool
        self.timeout = timeout

    def lookup(self, key: str) -> MirroredRecord | None:
        """The completed, unexpired mirror row for ``key``, if any."""
        try:
            with self.pool.connection(timeout=self.timeout) as conn, conn.transaction():
                conn.execute(_SET_TIMEOUT, (_millis(self.timeout),))
                row = conn.execute(LOOKUP_SQL, (key,)).fetchone()
        except (psycopg.Error, psycopg_pool.PoolTimeout, OSError) as err:
            raise PostgresError(str(err) or type(err).__name__) from err
        return None if row is None else decode_row(key, tuple(row))

    def begin(
        self,
        client: IdemClient,
        key: str,
        fingerprint: bytes,
        *,
        ttl: Duration,
        lease: Duration | None = None,
        wait: Duration | None = None,
    ) -> Outcome:
        """``IDEM.BEGIN``, then on ``new`` the mirror lookup: no row, New; the
        same fingerprint, Redis refilled and Replay; another, the key released
        and Mismatch. A lookup that fails releases the key and raises
        ``PostgresError`` (unavailable): the mirror may hold the answer."""
        outcome = client.begin(key, fingerprint, ttl=ttl, lease=lease, wait=wait)
        if not isinstance(outcome, New):
            return outcome
        token = outcome.token
        try:
            record = self.lookup(key)
        except PostgresError:
            _release(client, key, token)
            raise
        if record is None:
            return outcome
        if record.fingerprint_hex != stored_hex(fingerprint):
            _release(client, key, token)
            return Mismatch()
        try:
            client.complete(key, token, record.response, origin=Origin.MIRROR)
        except IdemError as err:
            log.warning("read-through could not refill redis for %r: %s", key, err)
            _release(client, key, token)
        return Replay(record.response)


class AsyncReadThrough:
    """The asyncio twin of ``ReadThrough``."""

    def __init__(
        self, pool: psycopg_pool.AsyncConnectionPool[Any], *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.pool = pool
        self.timeout = timeout

    async def lookup(self, key: str) -> MirroredRecord | None:
        """The completed, unexpired mirror row for ``key``, if any. Gives up
        after ``timeout`` whatever the network does: the query is left to
        end in the background (``asyncio.wait_for`` would wait for psycopg's
        cancel, which a dead path holds ~10 s)."""
        query = asyncio.ensure_future(self._query(key))
        if not await settled_within(query, self.timeout):
            raise PostgresError(f"no answer within {self.timeout} s")
        try:
            row = query.result()
        except (psycopg.Error, psycopg_pool.PoolTimeout, OSError) as err:
            raise PostgresError(str(err) or type(err).__name__) from err
        return None if row is None else decode_row(key, tuple(row))

    async def _query(self, key: str) -> Any:
        async with self.pool.connection(timeout=self.timeout) as conn, conn.transaction():
            await conn.execute(_SET_TIMEOUT, (_millis(self.timeout),))
            cursor = await conn.execute(LOOKUP_SQL, (key,))
            return await cursor.fetchone()

    async def begin(
        self,
        client: AsyncIdemClient,
        key: str,
        fingerprint: bytes,
        *,
        ttl: Duration,
        lease: Duration | None = None,
        wait: Duration | None = None,
    ) -> Outcome:
        """See ``ReadThrough.begin``."""
        outcome = await client.begin(key, fingerprint, ttl=ttl, lease=lease, wait=wait)
        if not isinstance(outcome, New):
            return outcome
        token = outcome.token
        try:
            record = await self.lookup(key)
        except PostgresError:
            await _arelease(client, key, token)
            raise
        if record is None:
            return outcome
        if record.fingerprint_hex != stored_hex(fingerprint):
            await _arelease(client, key, token)
            return Mismatch()
        try:
            await client.complete(key, token, record.response, origin=Origin.MIRROR)
        except IdemError as err:
            log.warning("read-through could not refill redis for %r: %s", key, err)
            await _arelease(client, key, token)
        return Replay(record.response)


_BACKGROUND: set[asyncio.Task[Any]] = set()


async def settled_within(task: asyncio.Task[Any], timeout: float) -> bool:
    """Waits up to ``timeout`` for ``task``; a task still running then (or
    when the caller is cancelled) goes on in the background, kept until it
    ends and its error retrieved. Whether it ended in time."""
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        in_background(task)
        raise
    if not done:
        in_background(task)
    return bool(done)


def in_background(task: asyncio.Task[Any]) -> None:
    """Keeps ``task`` referenced until it ends; its failure is logged."""
    _BACKGROUND.add(task)
    task.add_done_callback(_ended)


def _ended(task: asyncio.Task[Any]) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.info("a Postgres call given up on ended with: %r", task.exception())


def _release(client: IdemClient, key: str, token: int) -> None:
    try:
        client.abort(key, token)
    except IdemError as err:
        log.warning("could not release idempotency key %r: %s", key, err)


async def _arelease(client: AsyncIdemClient, key: str, token: int) -> None:
    try:
        await client.abort(key, token)
    except IdemError as err:
        log.warning("could not release idempotency key %r: %s", key, err)
