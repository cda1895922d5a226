"""``IdempotencyMiddleware``: the ``Idempotency-Key`` header for any ASGI
application (Starlette, FastAPI, ...), with the HTTP semantics of the Rust
layer (docs/client.md, "Middleware"; the facts in spec/http.json):

- methods not covered pass through; no key passes through (or 400 when
  ``required``); a bad key is a 400 problem; a body over
  ``max_request_body`` is 413;
- ``new``: the application runs with the body replayed to it, its lease
  renewed (TOUCH every third of ``lease``) while it runs; its response is
  buffered (``max_response_body``) and, when ``store_policy`` says so (all
  but 5xx and 429), stored with COMPLETE before it is sent, else the key is
  released (ABORT) so a retry runs again; it is sent when the application
  returns, so a Starlette ``BackgroundTask`` delays it, and one that fails
  after the whole response has it settled and sent before the error goes on;
- ``in_flight``: 409 problem with ``Retry-After`` (or, with
  ``wait_for_result``, the original's answer once it completes);
- ``replay``: the stored status, body and headers plus
  ``Idempotent-Replayed: true``; ``mismatch``: 422 problem;
- Redis (or the mirror) unreachable: 503 problem with ``Retry-After: 1``
  (fail closed), or the application runs unprotected with ``fail_open``
  (never when the ``claim_up_front`` claim failed: 503); a Redis with
  neither the module nor a loadable library: 500, logged once (call the
  client's ``prepare()`` at start-up to stop there instead);
- ``claim_up_front``: the fence's durable claim stands in for read-through's
  lookup, before the application runs (docs/fence.md).

Once the request has arrived whole, the rest of the flow runs in a task of
its own, so a client hanging up (or the server cancelling the request) does
not leave the key held or the response unstored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from idem import _spec
from idem.asyncio import IdemClient
from idem.canonical_json import canonicalize
from idem.errors import (
    BackendMissingError,
    CompletedError,
    IdemError,
    NotFoundError,
    PostgresError,
    StaleError,
)
from idem.fence import AsyncFence, Layout, Proceed, _Report
from idem.fingerprint import Fingerprint, Fingerprinter
from idem.keys import (
    InvalidKeyError,
    InvalidTenantError,
    check_tenant,
    parse_key,
    redis_key,
    tenant_of_lines,
)
from idem.read_through import AsyncReadThrough, settled_within
from idem.types import InFlight, Mismatch, New, Origin, Outcome, Replay, StoredResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("idem")

_HTTP = _spec.http()
_DEFAULTS = _HTTP["defaults"]
_HEADERS = _HTTP["headers"]
REPLAYED = _HEADERS["replayed"].encode()
_TOKEN_NAME = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9a-z]+$")

_BYPASSING_EXTENSIONS = frozenset(
    {"http.response.pathsend", "http.response.zerocopysend", "http.response.trailers"}
)

SCOPE_KEY = "idem"
"""Where a running request finds its ``IdempotencyContext`` in the scope
(Starlette: ``request.scope["idem"]``)."""


def default_store_policy(status: int) -> bool:
    """Everything but 5xx and 429 is stored; those release the key so the
    client can retry."""
    return not (500 <= status <= 599 or status == 429)


@dataclass(frozen=True, slots=True)
class IdempotencyContext:
    """What the middleware holds for the request the application runs."""

    key: str
    """The Redis key (prefix, tenant and key)."""
    token: int
    """The fencing token of this holder."""
    fingerprint: Fingerprint
    ttl: float
    fence: AsyncFence
    """The request's Postgres fence (docs/fence.md): claim through a pool
    (``await fence.claim(pool)``), then ``commit`` the effect; the middleware
    settles Redis by what the fence did."""


def _seconds(ms_key: str) -> float:
    return float(_DEFAULTS[ms_key]) / 1000


class IdempotencyMiddleware:
    """ASGI middleware; options default to spec/http.json's ``defaults``.
    Times are seconds.

    ``tenant`` scopes keys by the **authenticated caller**: a callable of the
    ASGI scope reading what the app's authentication (an outer middleware)
    left there, e.g. ``lambda scope: scope["state"].get("account")``, never
    a value the client picks. With ``tenant`` (or ``tenant_header``, only for
    a header a gateway sets after authenticating), no tenant or an empty one
    is a 400 ``missing_tenant`` and one over ``keys.MAX_TENANT_BYTES`` a 400
    ``invalid_tenant``; without either, every caller shares one scope.

    ``app.add_middleware(IdempotencyMiddleware, client=idem.asyncio.IdemClient.from_url(url))``
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        client: IdemClient,
        read_through: AsyncReadThrough | None = None,
        methods: Iterable[str] | None = None,
        header: str | None = None,
        required: bool | None = None,
        tenant: Callable[[Scope], str | None] | None = None,
        tenant_header: str | None = None,
        key_prefix: str | None = None,
        ttl: float | None = None,
        lease: float | None = None,
        wait_for_result: float | None = None,
        max_request_body: int | None = None,
        max_response_body: int | None = None,
        stored_headers: Iterable[str] | None = None,
        store_policy: Callable[[int], bool] = default_store_policy,
        fail_open: bool | None = None,
        store_retry: float | None = None,
        fingerprinter: Fingerprinter | None = None,
        max_retry_after: float | None = None,
        table_layout: Layout = "unpartitioned",
        claim_up_front: bool = False,
    ) -> None:
        if tenant is not None and tenant_header is not None:
            raise ValueError("give tenant or tenant_header, not both")
        if claim_up_front and read_through is None:
            raise ValueError("claim_up_front needs read_through (its pool and timeout)")
        self.app = app
        self.client = client
        self.read_through = read_through
        self.methods = frozenset(m.upper() for m in (methods or _DEFAULTS["methods"]))
        self.header = (header or _DEFAULTS["header"]).lower().encode("ascii")
        self.required = _DEFAULTS["required"] if required is None else required
        if tenant_header is not None:
            name = tenant_header.lower().encode("ascii")
            tenant = lambda scope: tenant_of_lines(_lines(scope, name))  # noqa: E731
        self.tenant = tenant
        self.key_prefix = _DEFAULTS["key_prefix"] if key_prefix is None else key_prefix
        self.ttl = _seconds("ttl_ms") if ttl is None else ttl
        self.lease = _seconds("lease_ms") if lease is None else lease
        self.wait = wait_for_result
        self.max_request_body = (
            _DEFAULTS["max_request_body"] if max_request_body is None else max_request_body
        )
        self.max_response_body = (
            _DEFAULTS["max_response_body"] if max_response_body is None else max_response_body
        )
        self.stored_headers = tuple(
            n.lower().encode("ascii") for n in (stored_headers or _DEFAULTS["stored_headers"])
        )
        self.store_policy = store_policy
        self.fail_open = _DEFAULTS["fail_open"] if fail_open is None else fail_open
        self.store_retry = _seconds("store_retry_ms") if store_retry is None else store_retry
        self.fingerprinter = fingerprinter or Fingerprinter(
            canonical_json=_DEFAULTS["canonical_json"]
        )
        self.max_retry_after = (
            _seconds("max_retry_after_ms") if max_retry_after is None else max_retry_after
        )
        self.table_layout: Layout = table_layout
        self.claim_up_front = claim_up_front
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reported_missing = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() not in self.methods:
            await self.app(scope, receive, send)
            return
        try:
            key = parse_key(_lines(scope, self.header))
        except InvalidKeyError as err:
            await _problem(send, "invalid_key", detail=err.detail)
            return
        if key is None:
            if self.required:
                await _problem(send, "missing_key")
            else:
                await self.app(scope, receive, send)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return
        tenant = ""  # no tenant source: the one anonymous scope
        if self.tenant is not None:
            try:
                tenant = check_tenant(self.tenant(scope))
            except InvalidTenantError as err:
                await _problem(send, err.problem)
                return
        redis_key_ = redis_key(self.key_prefix, tenant, key)
        fingerprint = self.fingerprinter.fingerprint(
            scope["method"], _target(scope), scope.get("headers", []), body
        )
        # From here on the flow is the key's: a cancelled request (the client
        # hung up) does not cut it short.
        flow = asyncio.ensure_future(
            self._flow(scope, receive, send, redis_key_, fingerprint, body)
        )
        self._keep(flow)
        await asyncio.shield(flow)

    def _fails_open_on(self, err: IdemError) -> bool:
        """Whether the application runs unprotected after BEGIN failed with
        ``err``: with ``fail_open``, when the store was unreachable. Not when
        the fence's claim made up front failed (the Rust layer's
        ``Config::fails_open_on``): that claim keeps a payment single when
        Redis forgets, and a Postgres that answers but refuses it (no table,
        no permission, read-only) would otherwise run every retry unfenced.
        That is a 503."""
        if self.claim_up_front and isinstance(err, PostgresError):
            return False
        return self.fail_open and err.is_unreachable

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                await _problem(send, "unreadable_request")
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_body:
                await _problem(send, "request_too_large")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _begin(self, key: str, fingerprint: Fingerprint) -> Outcome:
        if self.read_through is not None:
            return await self.read_through.begin(
                self.client, key, fingerprint, ttl=self.ttl, lease=self.lease, wait=self.wait
            )
        return await self.client.begin(
            key, fingerprint, ttl=self.ttl, lease=self.lease, wait=self.wait
        )

    def _fence(self, key: str, token: int, fingerprint: Fingerprint) -> AsyncFence:
        """The fence of a request about to run, with its report attached."""
        fence = AsyncFence(
            key, token, fingerprint, self.ttl, lease=self.lease, layout=self.table_layout
        )
        fence._report = _Report()
        return fence

    async def _begin_request(
        self, key: str, fingerprint: Fingerprint
    ) -> tuple[Outcome, AsyncFence | None]:
        """A request's first BEGIN: ``_begin``, or with ``claim_up_front``
        BEGIN and then the fence's durable claim in place of read-through's
        lookup (the Rust layer's ``claim_up_front``). What the claim finds is
        answered as read-through answers a mirror row (a completed row
        refills Redis and is replayed, another request's row is a mismatch)
        and a live claim is in flight; in each the key is given back to Redis
        but for the refill. On ``New`` the fence holds the claim."""
        read_through = self.read_through
        if not self.claim_up_front or read_through is None:
            return await self._begin(key, fingerprint), None
        outcome = await self.client.begin(
            key, fingerprint, ttl=self.ttl, lease=self.lease, wait=self.wait
        )
        if not isinstance(outcome, New):
            return outcome, None
        token = outcome.token
        fence = self._fence(key, token, fingerprint)
        pool = read_through.pool
        # Bounded by the timeout whatever the network does (``wait_for``
        # would wait for psycopg's cancel of the claim): a claim still
        # running goes on in the background and is given up once it ends.
        claiming = asyncio.ensure_future(fence.claim(pool))
        if not await settled_within(claiming, read_through.timeout):
            self._keep(asyncio.ensure_future(_release_claim(fence, pool, after=claiming)))
            await _Held(self, key, token, fingerprint).release()
            raise PostgresError(f"the fence's claim had no answer within {read_through.timeout} s")
        try:
            claim = claiming.result()
        except IdemError:
            # It may have committed before the error reached us.
            self._keep(asyncio.ensure_future(_release_claim(fence, pool)))
            await _Held(self, key, token, fingerprint).release()
            raise
        if isinstance(claim, Proceed):
            assert fence._report is not None
            fence._report.set("claimed_up_front", pool=pool)
            return outcome, fence
        if isinstance(claim, Replay):
            await _Held(self, key, token, fingerprint)._refill(claim.response)
            return claim, None
        await _Held(self, key, token, fingerprint).release()
        return claim, None

    async def _flow(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        key: str,
        fingerprint: Fingerprint,
        body: bytes,
    ) -> None:
        try:
            outcome, claimed = await self._begin_request(key, fingerprint)
        except IdemError as err:
            if self._fails_open_on(err):
                log.warning("idempotency store unavailable; running unprotected: %s", err)
                await self.app(scope, _replayed(body, receive), send)
            elif err.is_transient:
                log.warning("idempotency store unavailable; answering 503: %s", err)
                await _problem(send, "unavailable")
            elif isinstance(err, BackendMissingError):
                # A server without idem is said once, not per request (it
                # stays 500 until the module or the library is there).
                if not self._reported_missing:
                    self._reported_missing = True
                    log.error("%s", err)
                await _problem(send, "internal")
            else:
                log.error("IDEM.BEGIN failed: %s", err)
                await _problem(send, "internal")
            return
        if isinstance(outcome, New):
            fence = claimed or self._fence(key, outcome.token, fingerprint)
            await self._run_new(scope, receive, send, key, outcome.token, fingerprint, fence, body)
        else:
            await self._answer(send, outcome)

    async def _answer(self, send: Send, outcome: InFlight | Replay | Mismatch) -> None:
        if isinstance(outcome, InFlight):
            await _in_flight(send, min(outcome.retry_after, self.max_retry_after))
        elif isinstance(outcome, Replay):
            await _replay(send, outcome.response)
        else:
            await _problem(send, "mismatch")

    async def _run_new(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        key: str,
        token: int,
        fingerprint: Fingerprint,
        fence: AsyncFence,
        body: bytes,
    ) -> None:
        held = _Held(self, key, token, fingerprint)
        report = fence._report
        assert report is not None
        inner_scope = dict(scope)
        inner_scope[SCOPE_KEY] = IdempotencyContext(key, token, fingerprint, self.ttl, fence)
        if "extensions" in scope:
            # Responses sent by these would pass the buffer (and go out
            # before its start message): the application is not offered them.
            inner_scope["extensions"] = {
                name: value
                for name, value in (scope["extensions"] or {}).items()
                if name not in _BYPASSING_EXTENSIONS
            }

        async def unused_up_front() -> bool:
            """A claim made up front the handler did not use: given up, and
            the response then settled as any other."""
            if report.kind != "claimed_up_front":
                return report.kind == "unused"
            await _release_claim(fence, report.pool)
            report.set("unused")
            return True

        async def on_overflow() -> bool:
            """Whether the response past the limit streams out: not when the
            fence has decided (Lost, Replay, InFlight, Mismatch), whose answer
            replaces it (a decision after streaming began cannot)."""
            if report.kind == "decided":
                return False
            if await unused_up_front():
                await held.release()
            return True

        response = _Buffered(send, self.max_response_body, on_overflow=on_overflow)
        renewal = asyncio.ensure_future(held.keep_lease())
        failure: Exception | None = None
        try:
            await self.app(inner_scope, _replayed(body, receive), response.send)
        except Exception as err:
            if not response.complete or response.overflowed:
                renewal.cancel()
                await self._settle_failed(held, fence, report, response)
                raise
            # The application failed after its whole response (a Starlette
            # BackgroundTask, run after the response is sent): the response
            # is settled and sent as if it had returned, then the error goes on.
            log.warning("%s: the application failed after its complete response: %r", key, err)
            failure = err
        except BaseException:
            renewal.cancel()
            await self._settle_failed(held, fence, report, response)
            raise
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
        await self._settle_response(send, key, held, fence, report, response, unused_up_front)
        if failure is not None:
            raise failure

    @staticmethod
    async def _settle_failed(
        held: _Held, fence: AsyncFence, report: _Report, response: _Buffered
    ) -> None:
        """The application raised before its response was complete."""
        if report.kind != "unused":
            await held.settle_fence(fence, report)
        elif not response.overflowed:
            await held.release()

    async def _settle_response(
        self,
        send: Send,
        key: str,
        held: _Held,
        fence: AsyncFence,
        report: _Report,
        response: _Buffered,
        unused_up_front: Callable[[], Awaitable[bool]],
    ) -> None:
        """Settles the key by the application's response and what it did
        with the fence, and sends the client its answer."""
        if not await unused_up_front():
            answer = await held.settle_fence(fence, report)
            if response.overflowed and not response.dropped:
                return
            if answer is not None:
                await answer(send)
            elif response.complete and response.status is not None:
                await response.flush()
            else:
                await _problem(send, "internal")
            return
        if response.overflowed:
            log.warning("%s: response larger than max_response_body: sent, not stored", key)
            return
        if not response.complete or response.status is None:
            log.error("%s: the application sent no complete response; key released", key)
            await held.release()
            await _problem(send, "internal")
            return
        if self.store_policy(response.status):
            stored = StoredResponse(response.status, response.body, response.stored(self))
            override = await held.store(stored)
            if override is not None:
                await override(send)
                return
        else:
            await held.release()
        await response.flush()


class _Buffered:
    """The application's response, buffered up to a limit; past it, the
    buffered part goes out and the rest streams through."""

    def __init__(self, send: Send, limit: int, on_overflow: Callable[[], Awaitable[bool]]) -> None:
        self._send = send
        self._limit = limit
        self._on_overflow = on_overflow
        self.start: Message | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        self.overflowed = False
        # Past the limit and not sent (``on_overflow`` said so); the rest too.
        self.dropped = False

    @property
    def status(self) -> int | None:
        return None if self.start is None else int(self.start["status"])

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def stored(self, mw: IdempotencyMiddleware) -> tuple[tuple[str, bytes], ...]:
        headers: Sequence[tuple[bytes, bytes]] = (self.start or {}).get("headers", [])
        pairs = [(bytes(n).lower(), bytes(v)) for n, v in headers]
        return tuple(
            (name.decode("latin-1"), value)
            for name in mw.stored_headers
            for n, value in pairs
            if n == name
        )

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if self.overflowed:
            if not self.dropped:
                await self._send(message)
            return
        if kind == "http.response.start":
            self.start = message
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        chunk = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        self.size += len(chunk)
        self.chunks.append(chunk)
        if self.size > self._limit:
            self.overflowed = True
            if not await self._on_overflow():
                self.dropped = True
                self.chunks, self.size = [], 0
                return
            assert self.start is not None
            await self._send(self.start)
            await self._send({"type": "http.response.body", "body": self.body, "more_body": more})
            return
        if not more:
            self.complete = True

    async def flush(self) -> None:
        assert self.start is not None
        await self._send(self.start)
        await self._send({"type": "http.response.body", "body": self.body, "more_body": False})


Override = Callable[[Send], Awaitable[None]]


class _Held:
    """The key a request holds: its lease, and how it is settled."""

    def __init__(
        self, mw: IdempotencyMiddleware, key: str, token: int, fingerprint: Fingerprint
    ) -> None:
        self.mw = mw
        self.key = key
        self.token = token
        self.fingerprint = fingerprint

    async def keep_lease(self) -> None:
        """TOUCH every third of the lease (at least 10 ms) until cancelled or
        the key is no longer ours."""
        every = max(self.mw.lease / 3, 0.01)
        next_at = time.monotonic() + every
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            try:
                await self.mw.client.touch(self.key, self.token, self.mw.lease)
            except (StaleError, NotFoundError, CompletedError) as err:
                log.warning("%s: lease lost while the handler runs: %s", self.key, err)
                return
            except IdemError as err:
                log.warning("%s: lease renewal failed; retrying: %s", self.key, err)
            now = time.monotonic()
            next_at = next_at + every if next_at + every > now else now + every

    async def settle_fence(self, fence: AsyncFence, report: _Report) -> Override | None:
        """Settles a key whose handler used the fence; an answer when the
        client gets the fence's instead of the handler's response."""
        if report.kind == "committed":
            assert report.committed is not None
            await self._store_committed(report.committed)
            return None
        claim = report.claim
        if report.kind == "decided" and claim is not None and not isinstance(claim, Proceed):
            if isinstance(claim, Replay):
                await self._refill(claim.response)
                return lambda send: _replay(send, claim.response)
            await self.release()
            if isinstance(claim, InFlight):
                capped = min(claim.retry_after, self.mw.max_retry_after)
                return lambda send: _in_flight(send, capped)
            return lambda send: _problem(send, "mismatch")
        # Claimed but not committed through the fence: nothing happened, or a
        # retry's claim finds out. A durable claim is given up first, so the
        # retry Redis lets in next proceeds at once.
        if report.kind in ("claimed", "claimed_up_front"):
            await _release_claim(fence, report.pool)
        await self.release()
        return None

    async def _store_committed(self, stored: StoredResponse) -> None:
        """The fence committed ``stored``: put it into Redis (``MIRRORED``)."""
        give_up = time.monotonic() + _seconds("store_at_once_ms")
        try:
            await self._complete(self.token, stored, give_up, origin=Origin.MIRROR)
        except (StaleError, NotFoundError) as err:
            log.warning(
                "%s: the fenced response is committed in Postgres; Redis lost or passed "
                "on the key: %s",
                self.key,
                err,
            )
        except IdemError as err:
            log.error(
                "%s: the fenced response is committed in Postgres but could not be put "
                "into Redis: %s",
                self.key,
                err,
            )

    async def _refill(self, stored: StoredResponse) -> None:
        try:
            await self.mw.client.complete(self.key, self.token, stored, origin=Origin.MIRROR)
        except IdemError as err:
            log.warning("%s: could not refill redis from the fence's row: %s", self.key, err)
            await self.release()

    async def release(self) -> None:
        """ABORT; a failure leaves the key to lapse with its lease."""
        try:
            await self.mw.client.abort(self.key, self.token)
        except IdemError as err:
            log.warning(
                "%s: ABORT failed; the key frees itself when its lease lapses: %s", self.key, err
            )

    async def store(self, stored: StoredResponse) -> Override | None:
        """Stores the handler's response; ``Some`` answer when the key's
        answer is not the handler's own (taken over or lost meanwhile)."""
        try:
            await self._complete(
                self.token, stored, time.monotonic() + _seconds("store_at_once_ms")
            )
        except IdemError as err:
            if err.is_transient:
                log.warning(
                    "%s: COMPLETE failed: the response is sent, storing it goes on in "
                    "the background: %s",
                    self.key,
                    err,
                )
                self._store_in_background(self.token, stored)
                return None
            return await self._settle(err, stored)
        return None

    async def _settle(self, err: IdemError, stored: StoredResponse) -> Override | None:
        if isinstance(err, StaleError | NotFoundError):
            log.warning("%s: the key was taken over or lost before COMPLETE: %s", self.key, err)
            return await self._answer_again(stored)
        if err.is_transient:
            log.error("%s: gave up storing the response: %s", self.key, err)
            return None
        log.error(
            "%s: COMPLETE refused; response sent, not stored, key released: %s", self.key, err
        )
        await self.release()
        return None

    async def _complete(
        self,
        token: int,
        stored: StoredResponse,
        give_up: float,
        uncertain: bool = False,
        origin: Origin = Origin.HANDLER,
    ) -> None:
        """COMPLETE, retried while Redis is unavailable until ``give_up``;
        after an attempt whose fate is unknown, ``COMPLETED`` is its own write."""
        pause = _seconds("store_pause_first_ms")
        while True:
            try:
                await self.mw.client.complete(self.key, token, stored, origin=origin)
                return
            except CompletedError:
                if uncertain:
                    return
                raise
            except IdemError as err:
                now = time.monotonic()
                if not err.is_transient or now >= give_up:
                    raise
                uncertain = True
                await asyncio.sleep(min(pause, give_up - now))
                pause = min(pause * 2, _seconds("store_pause_max_ms"))

    def _store_in_background(self, token: int, stored: StoredResponse) -> None:
        async def retry() -> None:
            try:
                await self._complete(
                    token, stored, time.monotonic() + self.mw.store_retry, uncertain=True
                )
                log.info("%s: the response is stored after Redis came back", self.key)
            except IdemError as err:
                held = _Held(self.mw, self.key, token, self.fingerprint)
                await held._settle(err, stored)

        self.mw._keep(asyncio.ensure_future(retry()))

    async def _answer_again(self, stored: StoredResponse) -> Override | None:
        try:
            outcome = await self.mw._begin(self.key, self.fingerprint)
        except IdemError as err:
            log.warning("%s: BEGIN after a failed COMPLETE failed: %s", self.key, err)
            return None
        if not isinstance(outcome, New):
            answer: InFlight | Replay | Mismatch = outcome
            return lambda send: self.mw._answer(send, answer)
        again = _Held(self.mw, self.key, outcome.token, self.fingerprint)
        try:
            await again._complete(
                outcome.token, stored, time.monotonic() + _seconds("store_at_once_ms")
            )
        except IdemError as err:
            if err.is_transient:
                again._store_in_background(outcome.token, stored)
            else:
                log.warning("%s: could not store the response under a new token: %s", self.key, err)
                await again.release()
        return None


async def _release_claim(
    fence: AsyncFence, pool: Any, after: asyncio.Task[Any] | None = None
) -> None:
    """Gives up the fence's durable claim made through ``pool`` (if any),
    once the claim ``after`` (still running) has ended; a failure leaves it
    to end with its lease."""
    if pool is None:
        return
    if after is not None:
        await asyncio.wait({after})
    try:
        await fence.release(pool)
    except IdemError as err:
        log.warning(
            "%s: could not release the fence's claim; it ends with its lease: %s", fence.key, err
        )


def _lines(scope: Scope, name: bytes) -> list[bytes]:
    return [bytes(v) for n, v in scope.get("headers", []) if bytes(n).lower() == name]


def _target(scope: Scope) -> bytes:
    """The request target as sent: the raw path and the query string."""
    raw = scope.get("raw_path")
    path = bytes(raw).split(b"?", 1)[0] if raw else _quote_path(scope.get("path", "/"))
    query = bytes(scope.get("query_string", b""))
    return path + b"?" + query if query else path


def _quote_path(path: str) -> bytes:
    """A decoded path (a server without ``raw_path``) as it was most likely sent."""
    return urllib.parse.quote(path, safe="/:@!$&'()*+,;=-._~%").encode("ascii")


def _replayed(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def problem_body(name: str, detail: str | None = None) -> bytes:
    """The problem's ``application/problem+json`` body (spec/http.json)."""
    spec = _HTTP["problems"][name]
    obj = {
        "type": spec["type"],
        "title": spec["title"],
        "status": spec["status"],
        "detail": spec["detail"] if detail is None else detail,
    }
    body = canonicalize(json.dumps(obj).encode())
    assert body is not None
    return body


async def _respond(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _problem(
    send: Send, name: str, *, detail: str | None = None, retry_after: str | None = None
) -> None:
    spec = _HTTP["problems"][name]
    headers = [(b"content-type", _HEADERS["problem_content_type"].encode())]
    retry_after = retry_after or spec.get("retry_after")
    if retry_after is not None:
        headers.append((b"retry-after", retry_after.encode()))
    await _respond(send, spec["status"], headers, problem_body(name, detail))


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up, at least 1."""
    ms = round(seconds * 1000)
    return str(max(1, -(-ms // 1000)))


async def _in_flight(send: Send, retry_after: float) -> None:
    await _problem(send, "in_flight", retry_after=retry_after_header(retry_after))


async def _replay(send: Send, stored: StoredResponse) -> None:
    headers: list[tuple[bytes, bytes]] = []
    for name, value in stored.headers:
        raw = name.lower().encode("latin-1", "replace")
        if name.lower() == "content-length":
            continue
        if not _TOKEN_NAME.match(raw) or any(c in value for c in b"\r\n\x00"):
            log.warning("stored header %r is not valid HTTP; left out of the replay", name)
            continue
        headers.append((raw, value))
    headers.append((REPLAYED, _HEADERS["replayed_value"].encode()))
    await _respond(send, stored.status, headers, stored.body)
