"""The peer benchmark's service: one FastAPI process with the same trivial
payment handler twice, under ``/idem`` behind idem's ASGI middleware and
under ``/pt`` behind AWS Lambda Powertools' idempotency utility with its
Redis persistence layer, both on the same Redis (``REDIS_URL``). The body
``{"amount", "delay_ms"?, "fail"?}``: the handler sleeps ``delay_ms`` and
answers 500 (returned, not raised) when ``fail`` is set; every run gets a
number of its own (``run``), so a client sees whether a handler ran.
``LEASE_MS`` sets idem's lease. Powertools keys on the Idempotency-Key
header; ``/pt`` with its defaults, ``/ptv`` with payload validation of the
body (``payload_validation_jmespath``). ``GET /runs``: handler runs so far
in this process."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import idem.asyncio
import redis
from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
from aws_lambda_powertools.utilities.idempotency.exceptions import (
    IdempotencyAlreadyInProgressError,
    IdempotencyValidationError,
)
from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
    RedisCachePersistenceLayer,
)
from fastapi import FastAPI
from idem.middleware import IdempotencyMiddleware
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

REDIS_URL = os.environ["REDIS_URL"]
LEASE = float(os.environ.get("LEASE_MS", "30000")) / 1000
_runs = 0
_runs_lock = threading.Lock()


def _answer(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    global _runs
    with _runs_lock:
        _runs += 1
        run = _runs
    if body.get("fail"):
        return 500, {"error": "processor_failed", "run": run, "pid": os.getpid()}
    return 201, {"amount": body.get("amount"), "run": run, "pid": os.getpid()}


def _json(status: int, value: dict[str, Any]) -> Response:
    return Response(json.dumps(value), status_code=status, media_type="application/json")


# ---------------------------------------------------------------- idem

idem_app = FastAPI(openapi_url=None)


@idem_app.post("/payments")
async def idem_payments(request: Request) -> Response:
    body = json.loads(await request.body())
    if delay := body.get("delay_ms"):
        await asyncio.sleep(delay / 1000)
    status, value = _answer(body)
    return _json(status, value)


idem_app.add_middleware(
    IdempotencyMiddleware, client=idem.asyncio.IdemClient.from_url(REDIS_URL), lease=LEASE
)

# ---------------------------------------------------------------- Powertools


def powertools_app(validate: bool) -> FastAPI:
    """The handler behind ``idempotent_function``, keyed on the header. Each
    gets a persistence layer of its own: ``idempotent_function`` configures
    the layer it is given with its config on every call."""
    # redis-py's client is the one its protocol describes (its stubs are wider).
    client: Any = redis.Redis.from_url(REDIS_URL)
    persistence = RedisCachePersistenceLayer(client=client)
    config = IdempotencyConfig(
        event_key_jmespath="key",
        payload_validation_jmespath="body" if validate else "",
        raise_on_no_idempotency_key=True,
        expires_after_seconds=86400,
    )

    @idempotent_function(  # type: ignore[untyped-decorator]  # Powertools' is untyped
        data_keyword_argument="request", persistence_store=persistence, config=config
    )
    def pay(request: dict[str, Any]) -> dict[str, Any]:
        body = request["body"]
        if delay := body.get("delay_ms"):
            time.sleep(delay / 1000)
        status, value = _answer(body)
        return {"status": status, "body": value}

    sub = FastAPI(openapi_url=None)

    @sub.post("/payments")
    async def payments(request: Request) -> Response:
        body = json.loads(await request.body())
        key = request.headers.get("idempotency-key")
        try:
            result = await run_in_threadpool(pay, request={"key": key, "body": body})
        except IdempotencyAlreadyInProgressError:
            return _json(409, {"error": "in_progress"})
        except IdempotencyValidationError:
            return _json(422, {"error": "payload_mismatch"})
        return _json(int(result["status"]), result["body"])

    return sub


app = FastAPI(openapi_url=None)
app.mount("/idem", idem_app)
app.mount("/pt", powertools_app(validate=False))
app.mount("/ptv", powertools_app(validate=True))


@app.get("/runs")
async def runs() -> dict[str, int]:
    return {"runs": _runs}
