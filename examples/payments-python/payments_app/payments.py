"""The HTTP handlers, as ``examples/payments-api/src/payments.rs``:
``POST /payments`` (validate, charge at the processor, insert one row, 201)
and ``GET /payments/{id}``. With the fence (the default) in two phases: a
durable claim of the key, the processor's charge under the fence's
downstream key with no Postgres connection held, then one autocommitted
statement that inserts the payment and completes the key's row, only while
this request still holds it (``AsyncFence.commit_effect``: the response,
its id reserved ahead, is known before the row is written)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import psycopg
from idem.fence import AsyncFence, Claim, Committed, Proceed
from idem.middleware import REPLAYED, SCOPE_KEY, IdempotencyContext
from idem.types import InFlight, Mismatch, Replay, StoredResponse
from psycopg_pool import AsyncConnectionPool
from starlette.requests import Request
from starlette.responses import Response

from payments_app import db
from payments_app.db import PaymentIds
from payments_app.processor import Processor

log = logging.getLogger("payments")

MAX_RECIPIENT_CHARS = 200
"""Longest recipient accepted, in characters."""
I64_MAX = 2**63 - 1
FIELDS = ("amount", "currency", "recipient")


@dataclass(frozen=True, slots=True)
class State:
    db: AsyncConnectionPool[psycopg.AsyncConnection[Any]]
    processor: Processor
    fence: bool
    ids: PaymentIds = field(default_factory=PaymentIds)
    """Payment ids reserved ahead: a fenced payment's response is known
    before its row is written."""


@dataclass(frozen=True, slots=True)
class NewPayment:
    amount: int
    currency: str
    recipient: str


class _Invalid(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse(body: bytes) -> NewPayment | Response:
    """The request, or the answer refusing it: 400 ``invalid_json`` when the
    body is not JSON; 422 ``invalid_payment`` when it is not a payment."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as err:
        return error(400, "invalid_json", str(err))
    try:
        request = _payment(value)
    except _Invalid as err:
        return error(422, "invalid_payment", str(err))
    if (violation := _violation(request)) is not None:
        return error(422, "invalid_payment", violation)
    return request


def _payment(value: Any) -> NewPayment:
    """The fields with their types; unknown fields refused (serde's
    ``deny_unknown_fields``)."""
    if not isinstance(value, dict):
        raise _Invalid("expected an object with amount, currency and recipient")
    unknown = [name for name in value if name not in FIELDS]
    if unknown:
        raise _Invalid(f"unknown field `{unknown[0]}`, expected one of {', '.join(FIELDS)}")
    for name in FIELDS:
        if name not in value:
            raise _Invalid(f"missing field `{name}`")
    amount, currency, recipient = (value[name] for name in FIELDS)
    is_int = isinstance(amount, int) and not isinstance(amount, bool)
    if not is_int or not -I64_MAX - 1 <= amount <= I64_MAX:
        raise _Invalid("amount: expected a 64-bit integer")
    if not isinstance(currency, str):
        raise _Invalid("currency: expected a string")
    if not isinstance(recipient, str):
        raise _Invalid("recipient: expected a string")
    return NewPayment(amount, currency, recipient)


def _violation(request: NewPayment) -> str | None:
    """The first rule the request breaks, if any."""
    if request.amount <= 0:
        return "amount must be a positive integer (minor units)"
    currency = request.currency
    if len(currency.encode()) != 3 or not all("A" <= c <= "Z" for c in currency):
        return "currency must be a three-letter ISO 4217 code such as EUR"
    recipient = request.recipient.strip()
    if not recipient or len(recipient) > MAX_RECIPIENT_CHARS:
        return "recipient must be 1 to 200 characters"
    return None


async def create_payment(request: Request) -> Response:
    state: State = request.app.state.payments
    parsed = parse(await request.body())
    if isinstance(parsed, Response):
        return parsed
    recipient = parsed.recipient.strip()
    context: IdempotencyContext | None = request.scope.get(SCOPE_KEY)
    if context is not None and state.fence:
        return await _create_fenced(state, context.fence, parsed, recipient)
    return await _create_unfenced(state, parsed, recipient)


async def _create_fenced(
    state: State, fence: AsyncFence, request: NewPayment, recipient: str
) -> Response:
    """Claim, charge, then the payment and its idempotency row in one
    autocommitted statement (the response, its id reserved ahead, is known
    before the row is written). A failure after the claim leaves it to the
    middleware to release (the claim was made through the pool); the retry's
    charge under the same downstream key finds the first one."""
    try:
        claim = await fence.claim(state.db)
        if not isinstance(claim, Proceed):
            return claim_answer(claim)
        await state.processor.charge(fence.downstream_key(), request.amount, request.currency)
        id_ = await state.ids.next(state.db)
        payment, at = db.new_payment(id_, request.amount, request.currency, recipient)
        stored = created(payment)
        row = [payment.id, payment.amount, payment.currency, payment.recipient, at]
        result = await fence.commit_effect(state.db, stored, db.INSERT_FENCED, row)
    except Exception:
        log.exception("fenced payment")
        return internal("the payment could not be stored")
    if isinstance(result, Committed):
        return http(stored)
    # Another holder took the key over meanwhile: nothing was committed; the
    # middleware answers what the key holds.
    return claim_answer(result.claim)


async def _create_unfenced(state: State, request: NewPayment, recipient: str) -> Response:
    # Without the fence there is no downstream key: every run charges.
    try:
        await state.processor.charge(None, request.amount, request.currency)
    except Exception:
        log.exception("processor")
        return internal("the payment could not be charged")
    try:
        payment = await db.insert_payment(state.db, request.amount, request.currency, recipient)
    except Exception:
        log.exception("insert payment")
        return internal("the payment could not be stored")
    return http(created(payment))


def _json(value: Any) -> bytes:
    """Compact JSON, as serde_json writes it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def created(payment: db.Payment) -> StoredResponse:
    """The 201 for a new payment, as stored and as sent."""
    return StoredResponse.of(
        201,
        _json(payment.as_dict()),
        [("content-type", "application/json"), ("location", f"/payments/{payment.id}")],
    )


def http(stored: StoredResponse) -> Response:
    response = Response(stored.body, status_code=stored.status)
    for name, value in stored.headers:
        response.headers[name] = value.decode("latin-1")
    return response


def claim_answer(claim: Claim) -> Response:
    """What the handler answers when the claim did not proceed (the
    middleware gives the same answers; without it these stand)."""
    if isinstance(claim, Replay):
        response = http(claim.response)
        response.headers[REPLAYED.decode()] = "true"
        return response
    if isinstance(claim, Mismatch):
        return error(422, "idempotency_key_reused", "the key was used for another request")
    assert isinstance(claim, InFlight | Proceed)
    return error(409, "idempotency_key_in_use", "a request with this key is being processed")


def internal(message: str) -> Response:
    return error(500, "internal", message)


def error(status: int, code: str, message: str) -> Response:
    return Response(
        _json({"error": code, "message": message}),
        status_code=status,
        media_type="application/json",
    )


async def get_payment(request: Request) -> Response:
    state: State = request.app.state.payments
    raw = request.path_params["id"]
    try:
        id_ = int(raw) if raw.lstrip("+-").isascii() and raw.lstrip("+-").isdigit() else None
    except ValueError:
        id_ = None
    if id_ is None or not -I64_MAX - 1 <= id_ <= I64_MAX:
        return Response(
            f"Invalid URL: Cannot parse `{raw}` to a `i64`",
            status_code=400,
            media_type="text/plain; charset=utf-8",
        )
    try:
        payment = await db.find_payment(state.db, id_)
    except Exception:
        log.exception("read payment")
        return internal("the payment could not be read")
    if payment is None:
        return error(404, "not_found", "no payment with this id")
    return Response(_json(payment.as_dict()), status_code=200, media_type="application/json")
