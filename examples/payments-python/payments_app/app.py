"""The FastAPI application: ``POST /payments`` and ``GET /payments/{id}``
behind ``IdempotencyMiddleware`` (keys scoped by the account a bearer token
authenticates, ``auth``; JSON
bodies canonicalized, read-through from the mirror when ``READ_THROUGH`` is
on), as ``examples/payments-api/src/lib.rs`` configures the Rust layer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import idem.asyncio
from fastapi import FastAPI
from idem.middleware import IdempotencyMiddleware
from idem.read_through import AsyncReadThrough

from payments_app import auth, db, payments
from payments_app.processor import Processor
from payments_app.settings import Settings


async def settle(client: idem.asyncio.IdemClient) -> None:
    """Settles the client's backend before the first request (loading the
    library when it is the one): a Redis without idem stops the start-up;
    an unreachable one is settled by the first request."""
    try:
        await client.prepare()
    except idem.IdemError as err:
        if not err.is_unavailable:
            raise


def create_app(settings: Settings) -> FastAPI:
    pool = db.pool(settings.database_url, settings.pool_size)
    client = idem.asyncio.IdemClient.from_url(settings.redis_url, backend=settings.backend)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.open(wait=True, timeout=db.POOL_TIMEOUT)
        try:
            await db.migrate(pool)
            await settle(client)
            yield
        finally:
            await pool.close()
            await client.aclose()

    app = FastAPI(title="payments (idem example)", lifespan=lifespan, openapi_url=None)
    app.state.payments = payments.State(
        db=pool, processor=Processor(pool, settings.processor_delay), fence=settings.fence
    )
    app.add_api_route("/payments", payments.create_payment, methods=["POST"])
    app.add_api_route("/payments/{id}", payments.get_payment, methods=["GET"])
    app.add_middleware(
        IdempotencyMiddleware,
        client=client,
        read_through=AsyncReadThrough(pool) if settings.read_through else None,
        tenant=auth.tenant,
        lease=settings.lease,
        wait_for_result=settings.wait,
        # Every keyed route's handler uses the fence: its claim stands in for
        # read-through's lookup (one statement fewer per payment), as in Rust.
        claim_up_front=settings.fence and settings.read_through,
    )
    # Added last, so outermost: a request without a known token is 401
    # before the idempotency middleware runs.
    app.add_middleware(auth.Authenticate, tokens=settings.tokens)
    return app
