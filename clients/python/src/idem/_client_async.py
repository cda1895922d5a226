"""``IdemClient`` over ``redis.asyncio.Redis`` (``idem.asyncio.IdemClient``):
the source of ``_client_sync.py`` (``idem.IdemClient``, over ``redis.Redis``),
which scripts/gen-python-sync.py generates from it. Code under ``if True:  #
ASYNC`` is this twin's alone; the sync twin runs its ``else:`` part."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, cast

import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from idem import _core, errors, wire
from idem.backend import (
    Backend,
    Probe,
    is_missing,
    load_command,
    module_missing,
    reload_failed,
    resolve,
)
from idem.backend import command as backend_command
from idem.types import BeginOptions, InFlight, Origin, Outcome, Record, StoredResponse
from idem.wire import Duration

if True:  # ASYNC
    import asyncio

log = logging.getLogger("idem")


_FAILURES: tuple[type[BaseException], ...] = (rexc.RedisError, OSError)
"""What a call turns into ``errors.from_redis``."""
if True:  # ASYNC
    _FAILURES += (asyncio.TimeoutError,)


class _Watch:
    """One watch of a record, shared by the waiters of one key and request:
    a task (asyncio), or a thread and what it saw (sync)."""

    if True:  # ASYNC

        def __init__(self, task: asyncio.Future[Outcome | None]) -> None:
            self.task = task
            self.waiters = 0

    else:

        def __init__(self) -> None:
            self.waiters = 0
            self.done = threading.Event()
            self.answer: Outcome | None = None
            self.error: errors.IdemError | None = None


class IdemClient:
    """Client for the idem module over a redis-py client (``redis.Redis``;
    ``redis.asyncio.Redis`` for ``idem.asyncio.IdemClient``, the same calls
    and answers).

    Every call is bounded by the Redis client's ``socket_timeout``
    (``from_url`` sets it to ``call_timeout``, 2 s by default, and turns
    redis-py's own retries off). Errors are ``idem.errors.IdemError``: one
    class per module code, ``UnavailableError`` for an unreachable or
    down-for-now server, ``WritesRefusedError``, ``OtherRedisError``.

    ``begin(..., wait=s)`` sends a normal BEGIN first and only when it
    answers ``in_flight`` a blocking one (``WAIT``) on a connection of its
    own from the pool, so a waiting call never holds up another; on the
    library (which does not block) it polls instead (``_poll``).

    ``backend``: ``"auto"`` (the module where ``IDEM.BEGIN`` exists, else
    the Functions library, loaded when missing or older, else the scripts
    form), or ``"module"``, ``"functions"``, ``"scripts"``. ``prepare()``
    settles it at start-up; otherwise the first call does.
    """

    def __init__(
        self,
        client: aredis.Redis,
        *,
        packed_replies: bool = True,
        call_timeout: float | None = None,
        backend: Backend | str = Backend.AUTO,
    ) -> None:
        self._redis = client
        self._packed = _core.PackedSwitch(packed_replies)
        self._requested = Backend.of(backend)
        self._backend = Backend.MODULE if self._requested is Backend.MODULE else None
        self._resolving = asyncio.Lock()
        self._watches: dict[tuple[str, bytes], _Watch] = {}
        self._watching = threading.Lock()  # the sync twin's watches
        configured = client.connection_pool.connection_kwargs.get("socket_timeout")
        self.call_timeout: float = (
            call_timeout
            if call_timeout is not None
            else float(configured)
            if configured
            else _core.default_call_timeout()
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        call_timeout: float | None = None,
        backend: Backend | str = Backend.AUTO,
        **kwargs: Any,
    ) -> IdemClient:
        """A client for the server at ``url`` (``redis://host:port/db``)."""
        timeout = _core.default_call_timeout() if call_timeout is None else call_timeout
        client = aredis.Redis.from_url(
            url, **_core.connection_kwargs(timeout, kwargs, Retry(NoBackoff(), 0))
        )
        return cls(client, call_timeout=timeout, backend=backend)

    @property
    def redis(self) -> aredis.Redis:
        """The redis-py client underneath."""
        return self._redis

    @property
    def backend(self) -> Backend | None:
        """The backend the calls run on; ``None`` until ``prepare`` or the
        first call settled it."""
        return self._backend

    async def prepare(self) -> Backend:
        """Settles the backend now (at start-up) and answers it: loads the
        library when it is the one and is missing or older. Raises
        ``BackendMissingError`` when the server offers none,
        ``UnavailableError`` when it cannot be reached."""
        if self._backend is not None:
            return self._backend
        async with self._resolving:
            if self._backend is None:
                found = await self._probe(resolve(self._requested))
                log.info("idem backend: %s", found.value)
                self._backend = found
        return self._backend

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
        """``IDEM.BEGIN``: New(token), InFlight(retry_after_ms),
        Replay(response) or Mismatch. ``ttl`` and ``lease`` in seconds (or
        ``timedelta``); with ``wait``, a duplicate of a running request waits
        up to that long for the holder's answer."""
        first = await self._begin(key, fingerprint, ttl, lease, None, None)
        if not isinstance(first, InFlight) or wire.is_zero(wait):
            return first
        assert wait is not None
        if await self.prepare() is not Backend.MODULE:
            return await self._poll(key, fingerprint, ttl, lease, first, _core.seconds(wait))
        bound = _core.seconds(wait) + self.call_timeout
        try:
            return await self._begin(key, fingerprint, ttl, lease, wait, bound)
        except errors.IdemError as err:
            # The key is known to be in flight; that stays the answer.
            log.warning("waiting for the key's holder failed; answering in_flight: %s", err)
            return first

    async def _poll(
        self,
        key: str,
        fingerprint: bytes,
        ttl: Duration,
        lease: Duration | None,
        first: InFlight,
        wait: float,
    ) -> Outcome:
        """The library's WAIT: the waiters of one key and request share one
        watch of the record (a task, or a thread in the sync twin, polling
        GET: ``_watch``), so many duplicates cost one GET per interval, not
        one BEGIN each, and all get the stored answer from the GET that sees
        it. When the record changes otherwise (released, expired, taken over,
        the lease ran out) each sends its own BEGIN, which may make it the new
        holder."""
        deadline = time.monotonic() + wait
        ident = (key, bytes(fingerprint))
        last = first
        while (left := deadline - time.monotonic()) > 0:
            if True:  # ASYNC
                watch = self._watch_of(ident, last.retry_after_ms / 1000)
                watch.waiters += 1
                try:
                    seen = await asyncio.wait_for(asyncio.shield(watch.task), left)
                except asyncio.TimeoutError:
                    return last
                except errors.IdemError as err:
                    log.warning("waiting for the key's holder failed; answering in_flight: %s", err)
                    return first
                finally:
                    watch.waiters -= 1
                    if watch.waiters == 0 and not watch.task.done():
                        # Nobody waits any more: the watch stops.
                        watch.task.cancel()
                        self._watches.pop(ident, None)
            else:
                with self._watching:
                    watch = self._watches.get(ident)
                    if watch is None or watch.done.is_set():
                        watch = _Watch()
                        self._watches[ident] = watch
                        threading.Thread(
                            target=self._watch,
                            args=(ident, watch, last.retry_after_ms / 1000),
                            name="idem-watch",
                            daemon=True,
                        ).start()
                    watch.waiters += 1
                try:
                    settled = watch.done.wait(left)
                finally:
                    with self._watching:
                        watch.waiters -= 1  # at none, the watch stops
                if not settled:
                    return last
                if watch.error is not None:
                    log.warning(
                        "waiting for the key's holder failed; answering in_flight: %s",
                        watch.error,
                    )
                    return first
                seen = watch.answer
            if seen is not None:
                return seen
            try:
                outcome = await self._begin(key, fingerprint, ttl, lease, None, None)
            except errors.IdemError as err:
                log.warning("waiting for the key's holder failed; answering in_flight: %s", err)
                return first
            if not isinstance(outcome, InFlight):
                return outcome
            last = outcome
        return last

    if True:  # ASYNC

        def _watch_of(self, ident: tuple[str, bytes], lease_left: float) -> _Watch:
            watch = self._watches.get(ident)
            if watch is None or watch.task.done():
                task = asyncio.ensure_future(self._watch(ident, lease_left))
                watch = _Watch(task)
                self._watches[ident] = watch

                def settled(done: asyncio.Future[Outcome | None], watch: _Watch = watch) -> None:
                    if self._watches.get(ident) is watch:
                        del self._watches[ident]
                    if not done.cancelled():
                        done.exception()  # retrieved: a watch nobody awaits any more

                task.add_done_callback(settled)
            return watch

        async def _watch(self, ident: tuple[str, bytes], lease_left: float) -> Outcome | None:
            """Polls GET (pauses doubling up to a bound, the last ending with
            the holder's lease): the answer BEGIN would give once the record
            is completed (its response for this request, else a mismatch), or
            ``None`` when it changed otherwise or the lease ran out."""
            key, fingerprint = ident
            watched = _core.Watched(fingerprint)
            deadline = time.monotonic() + lease_left
            for pause in _core.poll_pauses(deadline, time.monotonic):
                await asyncio.sleep(pause)
                ended, answer = watched.judge(await self.get(key))
                if ended:
                    return answer
            return None

    else:

        def _watch(self, ident: tuple[str, bytes], watch: _Watch, lease_left: float) -> None:
            """Polls GET (pauses doubling up to a bound, the last ending with
            the holder's lease) until ``_core.Watched`` ends it, the lease
            runs out or nobody waits any more."""
            key, fingerprint = ident
            watched = _core.Watched(fingerprint)
            try:
                for pause in _core.poll_pauses(time.monotonic() + lease_left, time.monotonic):
                    time.sleep(pause)
                    if watch.waiters == 0:
                        break
                    ended, watch.answer = watched.judge(self.get(key))
                    if ended:
                        break
            except errors.IdemError as err:
                watch.error = err
            finally:
                with self._watching:
                    if self._watches.get(ident) is watch:
                        del self._watches[ident]
                watch.done.set()

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
        """``IDEM.COMPLETE``: stores the response for the holder of ``token``
        (``Origin.MIRROR``: it came from Postgres, stored ``MIRRORED``)."""
        args = _core.complete_args(key, token, response, origin is Origin.MIRROR)
        wire.parse_ok(await self._query(args))

    async def abort(self, key: str, token: int) -> bool:
        """``IDEM.ABORT``: releases the key; ``False`` when ``token`` no longer
        holds an in-progress record."""
        return wire.parse_abort(await self._query(wire.abort_args(key, token)))

    async def touch(self, key: str, token: int, lease: Duration) -> float:
        """``IDEM.TOUCH``: the holder's lease becomes now + ``lease``; answers
        the remaining lease in seconds."""
        return wire.parse_touch(await self._query(wire.touch_args(key, token, lease))) / 1000

    async def get(self, key: str) -> Record | None:
        """``IDEM.GET``: the record, or ``None``."""
        return wire.parse_record(await self._query(wire.get_args(key)))

    # ------------------------------------------------------------ transport

    async def _raw(self, args: list[bytes]) -> Any:
        return await cast(Any, self._redis).execute_command(*args, **_core.NEVER_DECODE)

    async def _query(self, args: list[bytes]) -> Any:
        backend = await self.prepare()
        sent = backend_command(backend, args)
        try:
            try:
                return await self._raw(sent)
            except rexc.ResponseError as err:
                if not is_missing(backend, err):
                    missing = module_missing(backend, err)
                    if missing is not None:
                        raise missing from err
                    raise
                # Flushed, or a failover to a node that never had it: load
                # it and send the call once more.
                log.warning("the idem library is missing on the server; loading it: %s", err)
                try:
                    await self._raw(load_command(backend))
                except rexc.ResponseError as refused:
                    raise reload_failed(backend, err, refused) from refused
                return await self._raw(sent)
        except _FAILURES as err:
            raise errors.from_redis(err) from err

    async def _probe(self, probe: Probe) -> Backend:
        """Runs ``probe`` (``idem.backend.resolve``), sending each command it
        yields: its reply is sent back in, a Redis error reply thrown in."""
        try:
            try:
                step = next(probe)
                while True:
                    try:
                        reply = await self._raw(step)
                    except rexc.ResponseError as err:
                        step = probe.throw(err)
                    else:
                        step = probe.send(reply)
            except StopIteration as done:
                return cast(Backend, done.value)
        except _FAILURES as err:
            raise errors.from_redis(err) from err

    async def _query_blocking(self, args: list[bytes], bound: float) -> Any:
        """One blocking command on a connection of its own, for at most
        ``bound`` seconds; the connection is dropped if no answer came."""
        pool = self._redis.connection_pool
        try:
            conn: Any = await cast(Any, pool).get_connection()
        except (rexc.RedisError, OSError) as err:
            raise errors.from_redis(err) from err
        healthy = False
        try:
            await conn.send_command(*args)
            if True:  # ASYNC
                reply = await conn.read_response(disable_decoding=True, timeout=bound)
            else:
                if not conn.can_read(timeout=bound):
                    raise errors.UnavailableError(f"no answer within {bound:.3f} s")
                reply = conn.read_response(disable_decoding=True)
            healthy = True
            return reply
        except rexc.ResponseError as err:
            healthy = True
            raise errors.from_redis(err) from err
        except _FAILURES as err:
            raise errors.from_redis(err) from err
        finally:
            if not healthy:
                await conn.disconnect()
            await pool.release(conn)
