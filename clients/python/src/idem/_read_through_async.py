"""``AsyncReadThrough`` (over a ``psycopg_pool.AsyncConnectionPool``): the
source of ``_read_through_sync.py`` (``ReadThrough``, over a
``ConnectionPool``), which scripts/gen-python-sync.py generates from it.
The public names are in ``idem.read_through``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import psycopg
import psycopg_pool

from idem._read_through_core import (
    DEFAULT_TIMEOUT,
    LOOKUP_SQL,
    SET_TIMEOUT,
    MirroredRecord,
    decode_row,
    millis,
    settled_within,
)
from idem.errors import IdemError, PostgresError
from idem.fingerprint import stored_hex
from idem.types import Mismatch, New, Origin, Outcome, Replay
from idem.wire import Duration

if TYPE_CHECKING:
    from idem._client_async import IdemClient

if True:  # ASYNC
    import asyncio

log = logging.getLogger("idem")


class AsyncReadThrough:
    """Looks keys up in the writer's ``idempotency_keys`` through ``pool``.
    A lookup is bounded by ``timeout`` (checkout and statement), 2 s by
    default. ``AsyncReadThrough`` gives up after ``timeout`` whatever the
    network does. ``ReadThrough``'s blocking call cannot be abandoned:
    against a Postgres that stops answering (a partition) it waits until TCP
    gives up, unless the pool's connections are opened with
    ``connect_timeout`` and libpq's ``tcp_user_timeout`` (and keepalives),
    e.g. ``...?connect_timeout=2&tcp_user_timeout=2000&keepalives_idle=2&
    keepalives_interval=1&keepalives_count=2``."""

    def __init__(
        self, pool: psycopg_pool.AsyncConnectionPool[Any], *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.pool = pool
        self.timeout = timeout

    async def lookup(self, key: str) -> MirroredRecord | None:
        """The completed, unexpired mirror row for ``key``, if any."""
        try:
            if True:  # ASYNC
                # Given up after ``timeout``: the query is left to end in the
                # background (``asyncio.wait_for`` would wait for psycopg's
                # cancel, which a dead path holds ~10 s).
                query = asyncio.ensure_future(self._query(key))
                if not await settled_within(query, self.timeout):
                    raise PostgresError(f"no answer within {self.timeout} s")
                row = query.result()
            else:
                row = self._query(key)
        except (psycopg.Error, psycopg_pool.PoolTimeout, OSError) as err:
            raise PostgresError(str(err) or type(err).__name__) from err
        return None if row is None else decode_row(key, tuple(row))

    async def _query(self, key: str) -> Any:
        async with self.pool.connection(timeout=self.timeout) as conn, conn.transaction():
            await conn.execute(SET_TIMEOUT, (millis(self.timeout),))
            cursor = await conn.execute(LOOKUP_SQL, (key,))
            return await cursor.fetchone()

    async def begin(
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
        outcome = await client.begin(key, fingerprint, ttl=ttl, lease=lease, wait=wait)
        if not isinstance(outcome, New):
            return outcome
        token = outcome.token
        try:
            record = await self.lookup(key)
        except PostgresError:
            await _release(client, key, token)
            raise
        if record is None:
            return outcome
        if record.fingerprint_hex != stored_hex(fingerprint):
            await _release(client, key, token)
            return Mismatch()
        try:
            await client.complete(key, token, record.response, origin=Origin.MIRROR)
        except IdemError as err:
            log.warning("read-through could not refill redis for %r: %s", key, err)
            await _release(client, key, token)
        return Replay(record.response)


async def _release(client: IdemClient, key: str, token: int) -> None:
    try:
        await client.abort(key, token)
    except IdemError as err:
        log.warning("could not release idempotency key %r: %s", key, err)
