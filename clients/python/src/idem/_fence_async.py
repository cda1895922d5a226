"""``AsyncFence`` (psycopg ``AsyncConnection`` and ``AsyncConnectionPool``):
the source of ``_fence_sync.py`` (``Fence``, psycopg ``Connection`` and
``ConnectionPool``), which scripts/gen-python-sync.py generates from it. What
the twins share is in ``idem._fence_core``; the public names in
``idem.fence``."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import psycopg
import psycopg_pool
from psycopg import pq

from idem import _fence_core
from idem._fence_core import (
    _EFFECT_UNFAILED,
    _PARTITIONED_ISOLATION,
    _SQL,
    _UNFAILED,
    Claim,
    Committed,
    Held,
    Lost,
    Proceed,
    _Base,
    _claim_error,
    _effect_statement,
    _held,
    _in_flight,
    _moved,
    _ms,
    _not_held,
    _row,
    decide,
)
from idem.errors import PostgresError
from idem.types import StoredResponse


class AsyncFence(_Base):
    """The fence of one request over psycopg (``AsyncFence``: asyncio,
    ``Fence``: sync). The middleware hands an ``AsyncFence`` to every request
    it runs (``scope["idem"].fence``)."""

    async def _raw(self, conn: psycopg.AsyncConnection[Any], name: str, params: list[Any]) -> Any:
        cursor = psycopg.AsyncRawCursor(conn)
        await cursor.execute(_SQL[name], params)
        return cursor

    async def _one(self, conn: psycopg.AsyncConnection[Any], name: str, params: list[Any]) -> Any:
        """The statement's one row (``None`` when it answered none)."""
        cursor = await self._raw(conn, name, params)
        return await cursor.fetchone()

    async def _settle(self, conn: psycopg.AsyncConnection[Any], free: bool, claimed: bool) -> Claim:
        if claimed:
            return Proceed()
        if not free:
            return _in_flight()
        row = await self._one(conn, "row", [self.key])
        return decide(_row(self.key, row), self.fingerprint_hex, self.token)

    async def _claim_on(
        self, conn: psycopg.AsyncConnection[Any], sync: str | None, idle: str | None
    ) -> Claim:
        if self.layout == "unpartitioned":
            free, claimed = await self._one(conn, "claim", self._claim_params(sync, idle))
            return await self._settle(conn, free, claimed)
        free, isolation, *_ = await self._one(conn, "partitioned_gate", [self.key, sync, idle])
        if isolation != _PARTITIONED_ISOLATION:
            raise PostgresError(
                f"the partitioned fence needs a READ COMMITTED transaction, not {isolation}"
            )
        if not free:
            return _in_flight()
        params = self._claim_params(sync, idle)[:5]
        (claimed,) = await self._one(conn, "partitioned_claim", params)
        return await self._settle(conn, True, claimed)

    async def claim(
        self, source: psycopg_pool.AsyncConnectionPool[Any] | psycopg.AsyncConnection[Any]
    ) -> Claim:
        """Claims the key durably: the ``in_progress`` row, with this token
        and a lease, commits on its own before this returns. Call anything
        outside Postgres now (with ``downstream_key``), then ``commit`` the
        effect in a short transaction. With the middleware's
        ``claim_up_front`` the first call answers ``Proceed()`` at once (the
        middleware claimed)."""
        if self._taken_up_front():
            return Proceed()
        pool = source if isinstance(source, psycopg_pool.AsyncConnectionPool) else None
        try:
            if pool is not None:
                async with pool.connection() as conn:
                    claim = await self._durably(conn)
            else:
                assert isinstance(source, psycopg.AsyncConnection)
                claim = await self._durably(source)
        except psycopg.Error as err:
            raise _claim_error(err) from err
        return self._after_claim(claim, pool)

    async def _durably(self, conn: psycopg.AsyncConnection[Any]) -> Claim:
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            raise PostgresError("a durable claim needs a connection outside any transaction")
        if self.layout == "unpartitioned":
            if conn.autocommit:
                # One statement, committed on its own.
                return await self._claim_on(conn, "off", None)
            async with conn.transaction():
                return await self._claim_on(conn, "off", None)
        # The partitioned layout's two statements: a short transaction of
        # their own at READ COMMITTED whatever the default, holding the gate
        # no longer than the idle timeout should the claimer vanish.
        async with conn.transaction():
            await self._raw(conn, "read_committed", [])
            return await self._claim_on(conn, "off", _ms(self.idle_timeout))

    async def claim_in(self, conn: psycopg.AsyncConnection[Any]) -> Claim:
        """Claims the key inside the caller's open transaction on ``conn``
        (effects only in Postgres: claim, effect and completion commit
        together; its rollback undoes the claim)."""
        if self._taken_up_front():
            return Proceed()
        self._in_transaction(conn)
        try:
            claim = await self._claim_on(conn, None, _ms(self.idle_timeout))
        except psycopg.Error as err:
            raise _claim_error(err) from err
        return self._after_claim(claim)

    async def _write(
        self, conn: psycopg.AsyncConnection[Any], name: str, params: list[Any]
    ) -> Held | Lost:
        """A fenced write (the completion with ``fail_when_not_held`` false,
        the renewal) in the caller's transaction; not held: the row read in
        it, ``Lost``."""
        if _held(await self._one(conn, name, params)):
            return Held()
        return self._decided(await self._one(conn, "row", [self.key]))

    async def complete(
        self, conn: psycopg.AsyncConnection[Any], response: StoredResponse
    ) -> Committed | Lost:
        """Writes the response into the key's row in the caller's open
        transaction, if this holder still holds it; on ``Lost`` roll back.
        ``conn`` must be in a transaction (see ``_in_transaction``)."""
        self._in_transaction(conn)
        try:
            written = await self._write(conn, "complete", self._complete_params(response, False))
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return Committed() if isinstance(written, Held) else written

    async def commit(
        self, conn: psycopg.AsyncConnection[Any], response: StoredResponse
    ) -> Committed | Lost:
        """Completes the key's row and commits the connection's transaction
        (write the effect in it first) in one round trip, and tells the
        middleware; on ``Lost`` nothing is committed. ``conn`` must not be
        inside a ``with conn.transaction()`` or ``with conn.pipeline()``
        block. Whatever happens, the connection is left outside any
        transaction."""
        self._committable(conn)
        self._in_transaction(conn)
        try:
            if _fence_core._pipelined():
                result = await self._commit_pipelined(conn, response)
            else:
                result = await self._commit_sequential(conn, response)
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return self._reported(result, response)

    async def _commit_pipelined(
        self, conn: psycopg.AsyncConnection[Any], response: StoredResponse
    ) -> Committed | Lost:
        try:
            async with conn.pipeline():
                # Sent as queued, then one Sync at the block's end: one round
                # trip (``conn.commit()`` would sync, and the block's end sync
                # again). A failed completion makes the server skip the COMMIT.
                params = self._complete_params(response, True)
                completion = await self._raw(conn, "complete", params)
                await psycopg.AsyncRawCursor(conn).execute("COMMIT", prepare=False)
        except BaseException as err:
            # The transaction is aborted (the COMMIT skipped) or already
            # ended (the COMMIT failed): nothing of it committed.
            with contextlib.suppress(psycopg.Error):
                await conn.rollback()
            if not (_not_held(err) or _moved(err)):
                raise
            row = await self._one(conn, "row", [self.key])
            await conn.rollback()  # ends the read's transaction (non-autocommit)
            lost = self._failed(err, row)
            if lost is None:
                raise
            return lost
        # The completion answered: held (a row not held fails it), committed.
        if not _held(await completion.fetchone()):
            raise PostgresError(_UNFAILED)
        return Committed()

    async def _commit_sequential(
        self, conn: psycopg.AsyncConnection[Any], response: StoredResponse
    ) -> Committed | Lost:
        try:
            result = await self._write(conn, "complete", self._complete_params(response, False))
            if isinstance(result, Lost):
                await conn.rollback()
                return result
            await conn.commit()
        except BaseException as err:
            with contextlib.suppress(psycopg.Error):
                await conn.rollback()
            if not _moved(err):
                raise
            # Moved by a takeover (see ``_moved``): the row read once the
            # transaction is rolled back, as in ``_commit_pipelined``.
            row = await self._one(conn, "row", [self.key])
            await conn.rollback()
            lost = self._failed(err, row)
            if lost is None:
                raise
            return lost
        return Committed()

    async def commit_effect(
        self,
        source: psycopg_pool.AsyncConnectionPool[Any] | psycopg.AsyncConnection[Any],
        response: StoredResponse,
        effect: str,
        params: Sequence[Any] = (),
    ) -> Committed | Lost:
        """``commit`` without a transaction, for an effect that is one
        INSERT, UPDATE or DELETE and a response known before it runs (ids
        reserved ahead, the application's clock): the completion and
        ``effect`` commit together in one autocommitted statement, one round
        trip, and the middleware is told; number the effect's parameters from
        ``$7`` (``EFFECT_FIRST_PARAM``; ``$1`` is the key). On ``Lost``
        nothing is committed, the effect neither. An effect that fails (a
        constraint) fails the completion with it: the error is raised, the
        key still held. Another effect is refused with ``ValueError``, and a
        connection inside a transaction with ``PostgresError``, before
        anything is sent. A connection that is not autocommit runs the
        statement in autocommit all the same (switched back after, no
        transaction left open); through a pool, a connection is taken for
        the call only. The completion commits whatever rows the effect
        wrote, none included: an effect that may write none (a conditional
        UPDATE, ON CONFLICT DO NOTHING) belongs in ``commit``'s transaction,
        where the handler sees the row count first."""
        sql = _effect_statement(effect)
        try:
            if isinstance(source, psycopg_pool.AsyncConnectionPool):
                async with source.connection() as conn:
                    result = await self._commit_effect_on(conn, sql, response, params)
            else:
                result = await self._commit_effect_on(source, sql, response, params)
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        return self._reported(result, response)

    async def _commit_effect_on(
        self,
        conn: psycopg.AsyncConnection[Any],
        sql: str,
        response: StoredResponse,
        params: Sequence[Any],
    ) -> Committed | Lost:
        self._autocommittable(conn)
        switched = not conn.autocommit
        if switched:
            # No statement: psycopg's own setting.
            if True:  # ASYNC
                await conn.set_autocommit(True)
            else:
                conn.autocommit = True
        try:
            cursor = psycopg.AsyncRawCursor(conn)
            await cursor.execute(sql, self._effect_params(response, params))
            held = _held(await cursor.fetchone())
        except psycopg.Error as err:
            if not (_not_held(err) or _moved(err)):
                raise
            # Nothing committed; the row read on its own, autocommitted too.
            lost = self._failed(err, await self._one(conn, "row", [self.key]))
            if lost is None:
                raise
            return lost
        finally:
            if switched:
                # A broken connection stays as it is.
                with contextlib.suppress(psycopg.Error):
                    if True:  # ASYNC
                        await conn.set_autocommit(False)
                    else:
                        conn.autocommit = False
        if not held:
            raise PostgresError(_EFFECT_UNFAILED)
        return Committed()

    async def hold(self, conn: psycopg.AsyncConnection[Any]) -> Held | Lost:
        """Confirms in the caller's transaction that the key is still this
        holder's and renews its lease; it stays held until the transaction ends.
        ``conn`` must be in a transaction (see ``_in_transaction``)."""
        self._in_transaction(conn)
        try:
            held = await self._write(conn, "renew", self._renew_params())
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        if isinstance(held, Held):
            # A phase may commit effects: from here the middleware no longer
            # releases the claim (a retry waits for its lease).
            self._set("claimed")
        return held

    async def release(
        self, source: psycopg_pool.AsyncConnectionPool[Any] | psycopg.AsyncConnection[Any]
    ) -> None:
        """Gives up a durable claim that will not be committed."""
        try:
            if isinstance(source, psycopg_pool.AsyncConnectionPool):
                async with source.connection() as conn, conn.transaction():
                    await self._raw(conn, "release", [self.key, self.token])
            else:
                async with source.transaction():
                    await self._raw(source, "release", [self.key, self.token])
        except psycopg.Error as err:
            raise PostgresError(str(err)) from err
        self._set("claimed")
