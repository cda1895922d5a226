"""The asyncio twin of ``idem.IdemClient`` over ``redis.asyncio.Redis``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from idem import _core, errors, wire
from idem.types import BeginOptions, InFlight, Origin, Outcome, Record, StoredResponse
from idem.wire import Duration

log = logging.getLogger("idem")


class IdemClient:
    """Client for the idem module over a redis-py ``redis.asyncio.Redis``;
    the same calls and answers as the sync ``idem.IdemClient``."""

    def __init__(
        self,
        client: aredis.Redis,
        *,
        packed_replies: bool = True,
        call_timeout: float | None = None,
    ) -> None:
        self._redis = client
        self._packed = _core.PackedSwitch(packed_replies)
        configured = client.connection_pool.connection_kwargs.get("socket_timeout")
        self.call_timeout: float = (
            call_timeout
            if call_timeout is not None
            else float(configured)
            if configured
            else _core.default_call_timeout()
        )

    @classmethod
    def from_url(cls, url: str, *, call_timeout: float | None = None, **kwargs: Any) -> IdemClient:
        """A client for the server at ``url`` (``redis://host:port/db``)."""
        timeout = _core.default_call_timeout() if call_timeout is None else call_timeout
        client = aredis.Redis.from_url(
            url, **_core.connection_kwargs(timeout, kwargs, Retry(NoBackoff(), 0))
        )
        return cls(client, call_timeout=timeout)

    @property
    def redis(self) -> aredis.Redis:
        """The redis-py client underneath."""
        return self._redis

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def __aenter__(self) -> IdemClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------ commands

    async def begin(
        self,
        key: str,
        fingerprint: bytes,
        *,
        ttl: Duration,
        lease: Duration | None = None,
        wait: Duration | None = None,
    ) -> Outcome:
        """``IDEM.BEGIN`` (see ``idem.IdemClient.begin``)."""
        first = await self._begin(key, fingerprint, ttl, lease, None, None)
        if not isinstance(first, InFlight) or wire.is_zero(wait):
            return first
        assert wait is not None
        bound = _core.seconds(wait) + self.call_timeout
        try:
            return await self._begin(key, fingerprint, ttl, lease, wait, bound)
        except errors.IdemError as err:
            log.warning("waiting for the key's holder failed; answering in_flight: %s", err)
            return first

    async def begin_with(self, key: str, fingerprint: bytes, options: BeginOptions) -> Outcome:
        """``begin`` with its options in one value."""
        return await self.begin(
            key, fingerprint, ttl=options.ttl, lease=options.lease, wait=options.wait
        )

    async def _begin(
        self,
        key: str,
        fingerprint: bytes,
        ttl: Duration,
        lease: Duration | None,
        wait: Duration | None,
        bound: float | None,
    ) -> Outcome:
        packed = self._packed.enabled
        args = _core.begin_args(key, fingerprint, ttl, lease, wait, packed)
        try:
            reply = await self._send(args, bound)
        except errors.BadArgError as err:
            if not (packed and wire.refuses_packed(err)):
                raise
            self._packed.turn_off()
            args = _core.begin_args(key, fingerprint, ttl, lease, wait, False)
            reply = await self._send(args, bound)
        return wire.parse_begin(reply)

    async def _send(self, args: list[bytes], bound: float | None) -> Any:
        if bound is None:
            return await self._query(args)
        return await self._query_blocking(args, bound)

    async def complete(
        self,
        key: str,
        token: int,
        response: StoredResponse,
        *,
        origin: Origin = Origin.HANDLER,
    ) -> None:
        """``IDEM.COMPLETE`` (see ``idem.IdemClient.complete``)."""
        args = _core.complete_args(key, token, response, origin is Origin.MIRROR)
        wire.parse_ok(await self._query(args))

    async def abort(self, key: str, token: int) -> bool:
        """``IDEM.ABORT`` (see ``idem.IdemClient.abort``)."""
        return wire.parse_abort(await self._query(wire.abort_args(key, token)))

    async def touch(self, key: str, token: int, lease: Duration) -> float:
        """``IDEM.TOUCH``: answers the remaining lease in seconds."""
        return wire.parse_touch(await self._query(wire.touch_args(key, token, lease))) / 1000

    async def get(self, key: str) -> Record | None:
        """``IDEM.GET``: the record, or ``None``."""
        return wire.parse_record(await self._query(wire.get_args(key)))

    # ------------------------------------------------------------ transport

    async def _query(self, args: list[bytes]) -> Any:
        try:
            return await cast(Any, self._redis).execute_command(*args, **_core.NEVER_DECODE)
        except (rexc.RedisError, OSError, asyncio.TimeoutError) as err:
            raise errors.from_redis(err) from err

    async def _query_blocking(self, args: list[bytes], bound: float) -> Any:
        pool = self._redis.connection_pool
        try:
            conn: Any = await cast(Any, pool).get_connection()
        except (rexc.RedisError, OSError) as err:
            raise errors.from_redis(err) from err
        healthy = False
        try:
            await conn.send_command(*args)
            reply = await conn.read_response(disable_decoding=True, timeout=bound)
            healthy = True
            return reply
        except rexc.ResponseError as err:
            healthy = True
            raise errors.from_redis(err) from err
        except (rexc.RedisError, OSError, asyncio.TimeoutError) as err:
            raise errors.from_redis(err) from err
        finally:
            if not healthy:
                await conn.disconnect()
            await pool.release(conn)
