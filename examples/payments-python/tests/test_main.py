"""Start-up: the backend is settled before the service listens; a Redis that
cannot be reached now does not keep it from starting."""

from __future__ import annotations

import asyncio
import socket

from payments_app.__main__ import settle_backend
from payments_app.settings import Settings


def test_an_unreachable_redis_leaves_the_backend_to_the_first_request() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    settings = Settings.from_env(
        {"DATABASE_URL": "x", "REDIS_URL": f"redis://127.0.0.1:{port}/", "BACKEND": "functions"}
    )
    assert asyncio.run(settle_backend(settings)) == "functions, not settled yet"
