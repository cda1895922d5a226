"""Request validation as examples/payments-api/src/payments.rs does it: 400
for a body that is not JSON, 422 for one that is not a payment or breaks a
rule, the recipient trimmed."""

from __future__ import annotations

import json

import pytest
from starlette.responses import Response

from payments_app.payments import NewPayment, parse


def body(**fields: object) -> bytes:
    return json.dumps({"amount": 100, "currency": "EUR", "recipient": "bob", **fields}).encode()


def refusal(raw: bytes) -> tuple[int, str]:
    answer = parse(raw)
    assert isinstance(answer, Response)
    return answer.status_code, json.loads(bytes(answer.body))["error"]


def test_a_valid_payment() -> None:
    assert parse(body()) == NewPayment(100, "EUR", "bob")
    assert parse(body(recipient="  bob  ")) == NewPayment(100, "EUR", "  bob  ")


@pytest.mark.parametrize(
    "raw", [b"", b"not json", b'{"amount": NaN}', b"\xff", b'{"amount": 1,', b"\xef\xbb\xbf{}"]
)
def test_not_json_is_400(raw: bytes) -> None:
    assert refusal(raw) == (400, "invalid_json")


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        b"null",
        b'"text"',
        body(amount=0),
        body(amount=-1),
        body(amount=1.5),
        body(amount="100"),
        body(amount=True),
        body(amount=2**63),
        body(currency="eur"),
        body(currency="EURO"),
        body(currency="EÜR"),
        body(currency=7),
        body(recipient="   "),
        body(recipient="r" * 201),
        body(recipient=None),
        body(memo="unknown field"),
    ],
)
def test_not_a_payment_is_422(raw: bytes) -> None:
    assert refusal(raw) == (422, "invalid_payment")


def test_two_hundred_characters_are_a_recipient() -> None:
    assert isinstance(parse(body(recipient="é" * 200)), NewPayment)
