"""``python -m payments_app``: the example service on 127.0.0.1:$PORT (see
``Settings``); ``serve`` runs it. Bad settings, or a Redis without idem
(neither the module nor a library it can load), print the reason and exit 1
before anything starts."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import idem
import idem.asyncio
import uvicorn

from payments_app.app import create_app
from payments_app.settings import Settings, SettingsError

log = logging.getLogger("payments")


async def settle_backend(settings: Settings) -> str:
    """The idem backend the service runs on (the library loaded when it is
    the one); raises ``IdemError`` when Redis answers but offers none. A
    Redis unreachable now is not a reason not to start: the first request
    settles it."""
    client = idem.asyncio.IdemClient.from_url(settings.redis_url, backend=settings.backend)
    try:
        return (await client.prepare()).value
    except idem.IdemError as err:
        if not err.is_unavailable:
            raise
        log.warning("Redis unavailable at start-up; the first request settles the backend: %s", err)
        return f"{settings.backend}, not settled yet"
    finally:
        await client.aclose()


def main() -> int:
    try:
        settings = Settings.from_env(os.environ)
    except SettingsError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        backend = asyncio.run(settle_backend(settings))
    except idem.IdemError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    log.info(
        "payments API listening on http://127.0.0.1:%d (read_through=%s, fence=%s, backend=%s)",
        settings.port,
        settings.read_through,
        settings.fence,
        backend,
    )
    config = uvicorn.Config(
        create_app(settings),
        host="127.0.0.1",
        port=settings.port,
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    server.run()
    # A lifespan that failed (Postgres unreachable, the writer's table
    # missing) leaves the server not started.
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
