"""The middleware with fenced handlers (docs/fence.md, "What the middleware
does with it"): a committed response is stored MIRRORED whatever its status,
a claim not committed releases the key and the durable claim, the fence's
replay refills Redis, an open holder is 409 and another request 422, a
holder that lost its key answers what the key holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest
import redis
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import idem
import idem.asyncio
from idem import read_through
from idem.fence import AsyncFence, Committed, Held, Lost, Proceed
from idem.middleware import IdempotencyMiddleware
from idem.types import StoredResponse

from conftest import ADMIN_URL, Blackhole, RedisServer


class Payments:
    """A fenced handler: claim durably, pay, commit the response."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self.runs = 0
        self.status = 201
        self.commit = True
        self.before_commit: Callable[[AsyncFence], Any] | None = None
        self.lost_body = b"lost"

    async def endpoint(self, request: Request) -> Response:
        self.runs += 1
        fence: AsyncFence = request.scope["idem"].fence
        claim = await fence.claim(self.pool)
        if claim != Proceed():
            return Response("claim refused", status_code=409)
        body = await request.body()
        response = StoredResponse.of(self.status, b"paid " + body, [("content-type", "text/plain")])
        if not self.commit:
            return Response(response.body, status_code=self.status)
        if self.before_commit is not None:
            await self.before_commit(fence)
        async with self.pool.connection() as conn:
            await conn.execute("INSERT INTO payments (key, amount) VALUES (%s, 1)", (fence.key,))
            result = await fence.commit(conn, response)
        if isinstance(result, Lost):
            return Response(self.lost_body, status_code=500)
        assert result == Committed()
        return Response(response.body, status_code=self.status, media_type="text/plain")


@pytest.fixture
async def setup(
    aclient: idem.asyncio.IdemClient, fence_database_url: str
) -> AsyncIterator[tuple[Payments, httpx.AsyncClient, AsyncConnectionPool]]:
    async with AsyncConnectionPool(fence_database_url, min_size=1, max_size=4, open=False) as pool:
        handler = Payments(pool)
        app = Starlette(
            routes=[Route("/pay", handler.endpoint, methods=["POST"])],
            middleware=[Middleware(IdempotencyMiddleware, client=aclient)],
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            yield handler, c, pool


def unique() -> str:
    import uuid

    return uuid.uuid4().hex


async def payments(pool: AsyncConnectionPool, key: str) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM payments WHERE key = %s", (key,))
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def test_a_committed_500_is_stored_mirrored(
    setup: Any, aclient: idem.asyncio.IdemClient
) -> None:
    handler, c, pool = setup
    handler.status = 500
    k = unique()
    first = await c.post("/pay", content="x", headers={"idempotency-key": k})
    assert first.status_code == 500
    record = await aclient.get(f"idem:{{:{k}}}")
    assert record is not None and record.state == "completed" and record.mirror == "mirrored"
    again = await c.post("/pay", content="x", headers={"idempotency-key": k})
    assert again.status_code == 500 and again.headers["idempotent-replayed"] == "true"
    assert handler.runs == 1
    assert await payments(pool, f"idem:{{:{k}}}") == 1


async def test_a_claim_not_committed_releases_redis_and_the_claim(
    setup: Any, aclient: idem.asyncio.IdemClient
) -> None:
    handler, c, pool = setup
    handler.commit = False
    k = unique()
    assert (await c.post("/pay", content="x", headers={"idempotency-key": k})).status_code == 201
    assert await aclient.get(f"idem:{{:{k}}}") is None
    # The durable claim is gone too: the retry proceeds at once.
    handler.commit = True
    assert (await c.post("/pay", content="x", headers={"idempotency-key": k})).status_code == 201
    assert handler.runs == 2
    assert await payments(pool, f"idem:{{:{k}}}") == 1


async def test_the_fences_replay_refills_redis_after_it_forgot(
    setup: Any, aclient: idem.asyncio.IdemClient, target: RedisServer
) -> None:
    _, c, pool = setup
    k = unique()
    first = await c.post("/pay", content="x", headers={"idempotency-key": k})
    assert first.status_code == 201
    redis.Redis(port=target.port).delete(f"idem:{{:{k}}}")
    again = await c.post("/pay", content="x", headers={"idempotency-key": k})
    assert again.status_code == 201 and again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    record = await aclient.get(f"idem:{{:{k}}}")
    assert record is not None and record.mirror == "mirrored"
    assert await payments(pool, f"idem:{{:{k}}}") == 1


async def test_an_open_holder_is_409_and_another_request_422(
    setup: Any, aclient: idem.asyncio.IdemClient, target: RedisServer
) -> None:
    handler, c, pool = setup
    k = unique()
    redis_key = f"idem:{{:{k}}}"
    same_request = idem.Fingerprinter(canonical_json=True).fingerprint("POST", "/pay", [], b"x")
    holder = AsyncFence(redis_key, 1, same_request, 60, lease=30)
    assert await holder.claim(pool) == Proceed()
    # Redis forgot nothing here: a request Redis lets in finds the claim.
    busy = await c.post("/pay", content="x", headers={"idempotency-key": k})
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"
    assert await aclient.get(redis_key) is None, "released"
    await holder.release(pool)
    other_key = unique()
    other = AsyncFence(f"idem:{{:{other_key}}}", 1, b"another request", 60)
    assert await other.claim(pool) == Proceed()
    async with pool.connection() as conn:
        assert await other.commit(conn, StoredResponse(200, b"other")) == Committed()
    mismatch = await c.post("/pay", content="x", headers={"idempotency-key": other_key})
    assert mismatch.status_code == 422
    assert handler.runs == 2


async def test_a_holder_that_lost_its_key_answers_what_the_key_holds(
    setup: Any, aclient: idem.asyncio.IdemClient, target: RedisServer
) -> None:
    handler, c, pool = setup
    k = unique()
    redis_key = f"idem:{{:{k}}}"

    async def taken_over(fence: AsyncFence) -> None:
        # A retry took the key over (its lease lapsed) and committed first.
        raw = redis.Redis(port=target.port)
        async with pool.connection() as conn:
            await conn.execute(
                "UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 second'"
                " WHERE key = %s",
                (redis_key,),
            )
        newer = AsyncFence(redis_key, fence.token + 1, b"", 60)
        newer.fingerprint_hex = fence.fingerprint_hex
        assert await newer.claim(pool) == Proceed()
        async with pool.connection() as conn:
            assert await newer.commit(conn, StoredResponse(201, b"the retry's")) == Committed()
        raw.close()

    handler.before_commit = taken_over
    r = await c.post("/pay", content="x", headers={"idempotency-key": k})
    assert r.status_code == 201 and r.content == b"the retry's"
    assert r.headers["idempotent-replayed"] == "true"
    assert await payments(pool, redis_key) == 0, "the stale holder paid nothing"


async def test_a_lost_holders_response_over_the_limit_is_replaced_by_the_fences_answer(
    aclient: idem.asyncio.IdemClient, fence_database_url: str
) -> None:
    # The holder's commit found the key taken over and committed by a retry;
    # its own (rolled-back) response is larger than max_response_body. The
    # client gets what the key holds, not the streamed rolled-back response.
    async with AsyncConnectionPool(fence_database_url, min_size=1, max_size=4, open=False) as pool:
        handler = Payments(pool)
        handler.lost_body = b"rolled back " * 200
        app = Starlette(
            routes=[Route("/pay", handler.endpoint, methods=["POST"])],
            middleware=[Middleware(IdempotencyMiddleware, client=aclient, max_response_body=1024)],
        )
        k = unique()
        redis_key = f"idem:{{:{k}}}"

        async def taken_over(fence: AsyncFence) -> None:
            async with pool.connection() as conn:
                await conn.execute(
                    "UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 second'"
                    " WHERE key = %s",
                    (redis_key,),
                )
            newer = AsyncFence(redis_key, fence.token + 1, b"", 60)
            newer.fingerprint_hex = fence.fingerprint_hex
            assert await newer.claim(pool) == Proceed()
            async with pool.connection() as conn:
                assert await newer.commit(conn, StoredResponse(201, b"the retry's")) == Committed()

        handler.before_commit = taken_over
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/pay", content="x", headers={"idempotency-key": k})
        assert r.status_code == 201 and r.content == b"the retry's"
        assert r.headers["idempotent-replayed"] == "true"
        assert await payments(pool, redis_key) == 0, "the stale holder paid nothing"


async def test_a_committed_hold_keeps_the_claim_when_the_handler_fails_later(
    aclient: idem.asyncio.IdemClient, fence_database_url: str
) -> None:
    # A phase committed under hold may have effects: the middleware must not
    # release the durable claim when the handler then fails, or a retry would
    # redo the committed phase at once. It waits for the claim's lease.
    async with AsyncConnectionPool(fence_database_url, min_size=1, max_size=4, open=False) as pool:
        runs = 0

        async def endpoint(request: Request) -> Response:
            nonlocal runs
            runs += 1
            fence: AsyncFence = request.scope["idem"].fence
            if await fence.claim(pool) != Proceed():
                return Response("claim refused", status_code=409)
            async with pool.connection() as conn:
                assert await fence.hold(conn) == Held()
                await conn.execute(
                    "INSERT INTO payments (key, amount) VALUES (%s, 1)", (fence.key,)
                )
                await conn.commit()
            return Response("the processor failed", status_code=502)

        app = Starlette(
            routes=[Route("/pay", endpoint, methods=["POST"])],
            middleware=[Middleware(IdempotencyMiddleware, client=aclient)],
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            k = unique()
            first = await c.post("/pay", content="x", headers={"idempotency-key": k})
            assert first.status_code == 502
            retry = await c.post("/pay", content="x", headers={"idempotency-key": k})
            assert retry.status_code == 409, "the committed phase's claim was released"
        assert runs == 2
        assert await payments(pool, f"idem:{{:{k}}}") == 1


# ---------------------------------------------------------------- claim_up_front


@pytest.fixture
async def up_front(
    aclient: idem.asyncio.IdemClient, fence_database_url: str
) -> AsyncIterator[tuple[Payments, httpx.AsyncClient, AsyncConnectionPool]]:
    """The middleware with ``claim_up_front``: the fence's claim is made
    before the handler runs, in place of read-through's lookup."""
    async with AsyncConnectionPool(fence_database_url, min_size=1, max_size=4, open=False) as pool:
        handler = Payments(pool)
        app = Starlette(
            routes=[
                Route("/pay", handler.endpoint, methods=["POST"]),
                Route("/plain", plain, methods=["POST"]),
                Route("/boom", boom, methods=["POST"]),
                Route("/crash", crash, methods=["POST"]),
            ],
            middleware=[
                Middleware(
                    IdempotencyMiddleware,
                    client=aclient,
                    read_through=idem.AsyncReadThrough(pool),
                    claim_up_front=True,
                )
            ],
        )
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            yield handler, c, pool


async def plain(request: Request) -> Response:
    return Response(b"not fenced", status_code=201)


async def boom(request: Request) -> Response:
    fence: AsyncFence = request.scope["idem"].fence
    assert await fence.claim(object()) == Proceed(), "the claim made up front, no statement"  # type: ignore[arg-type]
    raise RuntimeError("the handler failed after its claim")


async def crash(request: Request) -> Response:
    raise RuntimeError("the handler failed before it used its fence")


async def row(pool: AsyncConnectionPool, key: str) -> tuple[Any, ...] | None:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT status, token FROM idempotency_keys WHERE key = %s", (key,)
        )
        return await cur.fetchone()


async def test_claim_up_front_answers_what_the_fence_finds_before_the_handler_runs(
    up_front: Any, aclient: idem.asyncio.IdemClient
) -> None:
    handler, c, pool = up_front
    k = unique()
    redis_key = f"idem:{{:{k}}}"
    first = await c.post("/pay", content="x", headers={"idempotency-key": k})
    assert first.status_code == 201 and handler.runs == 1
    record = await aclient.get(redis_key)
    assert record is not None
    stored = await row(pool, redis_key)
    assert stored == ("completed", record.token), "the handler committed the up-front claim"
    # Redis forgets: the claim replays the row without running the handler.
    await aclient.redis.delete(redis_key)
    again = await c.post("/pay", content="x", headers={"idempotency-key": k})
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content and handler.runs == 1
    refilled = await aclient.get(redis_key)
    assert refilled is not None and refilled.mirror == "mirrored"
    # Another request under the key: 422 from the row, the handler not run.
    await aclient.redis.delete(redis_key)
    other = await c.post("/pay", content="y", headers={"idempotency-key": k})
    assert other.status_code == 422 and handler.runs == 1
    assert await aclient.get(redis_key) is None, "released"
    # A live claim of this request (Redis forgot while its holder runs): 409.
    live = unique()
    same_request = idem.Fingerprinter(canonical_json=True).fingerprint("POST", "/pay", [], b"x")
    holder = AsyncFence(f"idem:{{:{live}}}", 1, same_request, 60, lease=30)
    assert await holder.claim(pool) == Proceed()
    busy = await c.post("/pay", content="x", headers={"idempotency-key": live})
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"
    assert handler.runs == 1
    assert await aclient.get(f"idem:{{:{live}}}") is None, "released"
    await holder.release(pool)


async def test_an_up_front_claim_the_handler_does_not_use_is_released(
    up_front: Any, aclient: idem.asyncio.IdemClient
) -> None:
    _, c, pool = up_front
    k = unique()
    reply = await c.post("/plain", content="x", headers={"idempotency-key": k})
    assert reply.status_code == 201
    assert await row(pool, f"idem:{{:{k}}}") is None, "the unused claim was given up"
    record = await aclient.get(f"idem:{{:{k}}}")
    assert record is not None and record.state == "completed" and record.mirror == "pending"
    again = await c.post("/plain", content="x", headers={"idempotency-key": k})
    assert again.headers["idempotent-replayed"] == "true"


async def test_a_handler_failing_after_the_up_front_claim_leaves_no_claim_behind(
    up_front: Any, aclient: idem.asyncio.IdemClient
) -> None:
    _, c, pool = up_front
    k = unique()
    assert (await c.post("/boom", content="x", headers={"idempotency-key": k})).status_code == 500
    assert await row(pool, f"idem:{{:{k}}}") is None, "the claim was released"
    assert await aclient.get(f"idem:{{:{k}}}") is None
    # The retry runs at once (not 409 until the lease lapses).
    assert (await c.post("/boom", content="x", headers={"idempotency-key": k})).status_code == 500
    # Also when the handler fails before it used the fence.
    k = unique()
    assert (await c.post("/crash", content="x", headers={"idempotency-key": k})).status_code == 500
    assert await row(pool, f"idem:{{:{k}}}") is None, "the claim was released"


def test_claim_up_front_needs_read_through(aclient: idem.asyncio.IdemClient) -> None:
    with pytest.raises(ValueError, match="read_through"):
        IdempotencyMiddleware(Starlette(), client=aclient, claim_up_front=True)


@pytest.fixture
def database_without_the_table() -> Iterator[str]:
    """A database of its own with no ``idempotency_keys``, dropped at the end."""
    name = f"idem_py_{unique()[:12]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield ADMIN_URL.rpartition("/")[0] + "/" + name
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_fail_open_never_runs_a_handler_whose_up_front_claim_failed(
    aclient: idem.asyncio.IdemClient, database_without_the_table: str
) -> None:
    # Postgres answers but the claim fails (here: no idempotency_keys). With
    # fail_open the handler would run with no fence at all, once per retry:
    # the up-front claim's failure is a 503 whatever fail_open says (as the
    # Rust layer's Config::fails_open_on).
    runs = 0

    async def charge(request: Request) -> Response:
        nonlocal runs
        runs += 1
        return Response(b"charged", status_code=201)

    url = database_without_the_table
    async with AsyncConnectionPool(url, min_size=1, max_size=2, open=False) as pool:
        app = Starlette(
            routes=[Route("/pay", charge, methods=["POST"])],
            middleware=[
                Middleware(
                    IdempotencyMiddleware,
                    client=aclient,
                    read_through=idem.AsyncReadThrough(pool),
                    claim_up_front=True,
                    fail_open=True,
                )
            ],
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            k = unique()
            for _ in range(3):
                reply = await c.post("/pay", content="x", headers={"idempotency-key": k})
                assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert runs == 0, "the handler ran unprotected"
    assert await aclient.get(f"idem:{{:{k}}}") is None, "the key was released"


async def test_a_blackholed_up_front_claim_is_503_at_once_and_released_after(
    aclient: idem.asyncio.IdemClient, fence_database_url: str, blackhole: Blackhole
) -> None:
    # Postgres stops answering while the up-front claim runs: 503 after the
    # read-through timeout (not after psycopg's cancel, which waits on the
    # same dead path: 10.5 s for 0.5 s), the handler never runs, and the claim
    # that lands once Postgres answers again is released.
    runs = 0

    async def charge(request: Request) -> Response:
        nonlocal runs
        runs += 1
        return Response(b"charged", status_code=201)

    url = blackhole.url(fence_database_url)
    async with AsyncConnectionPool(url, min_size=2, max_size=2, open=False) as pool:
        await pool.wait()
        app = Starlette(
            routes=[Route("/pay", charge, methods=["POST"])],
            middleware=[
                Middleware(
                    IdempotencyMiddleware,
                    client=aclient,
                    read_through=idem.AsyncReadThrough(pool, timeout=0.5),
                    claim_up_front=True,
                )
            ],
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            k = unique()
            blackhole.freeze()
            started = time.monotonic()
            reply = await c.post("/pay", content="x", headers={"idempotency-key": k})
            took = time.monotonic() - started
            assert reply.status_code == 503 and took < 1.5, f"{reply.status_code} in {took:.1f} s"
            assert runs == 0
            assert await aclient.get(f"idem:{{:{k}}}") is None, "the Redis key was released"
            blackhole.thaw()
            for _ in range(500):  # the late claim lands (up to 10 s)
                if not read_through._BACKGROUND:
                    break
                await asyncio.sleep(0.02)
            assert not read_through._BACKGROUND, "the late claim ended"
            for _ in range(500):  # then it is released
                if await row(pool, f"idem:{{:{k}}}") is None:
                    break
                await asyncio.sleep(0.02)
            assert await row(pool, f"idem:{{:{k}}}") is None, "the late claim was released"
            retry = await c.post("/pay", content="x", headers={"idempotency-key": k})
            assert retry.status_code == 201 and runs == 1
