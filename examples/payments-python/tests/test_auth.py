"""Bearer-token authentication in front of the idempotency middleware: a
known token's account is the request's tenant; none, an unknown one, or a
client-sent ``X-Account-Id`` is not."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from payments_app import auth
from payments_app.settings import parse_tokens

TOKENS = parse_tokens("tok_a=acct_1,tok_b=acct_2")


async def seen(scope: Any, receive: Any, send: Any) -> None:
    """The inner app: answers the tenant the middleware would use."""
    body = (auth.tenant(scope) or "-").encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def post(headers: dict[str, str]) -> httpx.Response:
    async def go() -> httpx.Response:
        app = auth.Authenticate(seen, tokens=TOKENS)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/payments", headers=headers, content=b"{}")

    return asyncio.run(go())


def test_a_known_token_is_its_account() -> None:
    assert post({"authorization": "Bearer tok_a"}).text == "acct_1"
    assert post({"authorization": "Bearer tok_b"}).text == "acct_2"


def test_no_token_or_an_unknown_one_is_401() -> None:
    for headers in (
        {},
        {"authorization": "Bearer tok_c"},
        {"authorization": "tok_a"},
        {"authorization": "Basic tok_a"},
        {"x-account-id": "acct_1"},
    ):
        r = post(headers)
        assert r.status_code == 401, headers
        assert r.json()["error"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"


def test_x_account_id_is_not_trusted() -> None:
    r = post({"authorization": "Bearer tok_b", "x-account-id": "acct_1"})
    assert r.text == "acct_2"
