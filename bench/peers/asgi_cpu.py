"""CPU per request of the Python peer app's layers without HTTP: the ASGI
apps of bench/python-peers/app.py (``/idem`` behind idem's middleware,
``/pt`` behind Powertools) called in-process with a canned request, 32 at a
time, on a redis-server with the module (REDIS_URL). CPU is the process'
(``time.process_time``: every thread, so Powertools' thread pool counts),
which a loaded machine inflates less than wall time. Prints one JSON line:
µs of CPU per request per layer and phase. Run it in alternating processes
to compare two versions of the package (PYTHONPATH), as
``bench/peers/asgi_ab.sh`` does.
Usage: REDIS_URL=redis://127.0.0.1:PORT/ python asgi_cpu.py [--requests 3000]"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python-peers"))
import app as peers  # noqa: E402  # bench/python-peers/app.py

BODY = b'{"amount":100}'


async def call(asgi: Any, path: str, key: str) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
            (b"idempotency-key", key.encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])

    await asyncio.wait_for(asgi(scope, receive, send), 30)
    return status


async def phase(path: str, keys: list[str]) -> float:
    """CPU µs per request, 32 in flight."""
    sem = asyncio.Semaphore(32)

    async def one(key: str) -> None:
        async with sem:
            status = await call(peers.app, path, key)
            if not 200 <= status < 300:
                raise RuntimeError(f"{path}: {status}")

    cpu = time.process_time()
    await asyncio.gather(*(one(k) for k in keys))
    return (time.process_time() - cpu) * 1e6 / len(keys)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    opts = ap.parse_args()
    out: dict[str, float] = {}
    for name, path in (("idem", "/idem/payments"), ("powertools", "/pt/payments")):
        await phase(path, [f"warm-{uuid.uuid4().hex}" for _ in range(200)])
        keys = [f"{name}-{uuid.uuid4().hex}" for _ in range(opts.requests)]
        out[f"{name} new"] = await phase(path, keys)
        out[f"{name} replay"] = await phase(path, keys)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
