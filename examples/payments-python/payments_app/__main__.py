"""``python -m payments_app``: the example service on 127.0.0.1:$PORT (see
``Settings``); ``serve`` runs it. Bad settings print the reason and exit 1
before anything starts."""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

from payments_app.app import create_app
from payments_app.settings import Settings, SettingsError


def main() -> int:
    try:
        settings = Settings.from_env(os.environ)
    except SettingsError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("payments").info(
        "payments API listening on http://127.0.0.1:%d (read_through=%s, fence=%s)",
        settings.port,
        settings.read_through,
        settings.fence,
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
