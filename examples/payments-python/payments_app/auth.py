"""Authentication: ``Authorization: Bearer <token>`` mapped to an account
by the configured table (``API_TOKENS``), as the Rust service does. The
account is left in ``scope["state"]["account"]`` for the idempotency
middleware's ``tenant``: the client never names its scope. A missing or
unknown token is answered 401 before the idempotency middleware runs."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNAUTHORIZED = json.dumps(
    {"error": "unauthorized", "message": "send Authorization: Bearer <token> with a known token"}
).encode()


def account_of(tokens: Mapping[str, str], authorization: bytes | None) -> str | None:
    """The account of an ``Authorization`` header's value."""
    if authorization is None or not authorization.startswith(b"Bearer "):
        return None
    try:
        token = authorization[7:].decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return tokens.get(token)


def tenant(scope: Scope) -> str | None:
    """The idempotency middleware's tenant: the authenticated account."""
    account = scope.get("state", {}).get("account")
    return account if isinstance(account, str) else None


class Authenticate:
    """ASGI middleware: 401 without a known bearer token, else the request
    goes on with ``scope["state"]["account"]``. Add it after (outside) the
    idempotency middleware."""

    def __init__(self, app: ASGIApp, *, tokens: Mapping[str, str]) -> None:
        self.app = app
        self.tokens = dict(tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorization = next(
            (v for k, v in scope.get("headers", []) if k.lower() == b"authorization"), None
        )
        account = account_of(self.tokens, authorization)
        if account is None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"www-authenticate", b"Bearer"),
                        (b"content-length", str(len(UNAUTHORIZED)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": UNAUTHORIZED})
            return
        scope["state"] = {**scope.get("state", {}), "account": account}
        await self.app(scope, receive, send)
