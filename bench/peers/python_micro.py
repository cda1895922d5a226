"""The Python middleware's own per-request steps, timed alone (no Redis, no
HTTP): the Idempotency-Key header parsed, the Redis key built, the
fingerprint with canonical JSON (a 14-byte body and a 600-byte one), and
the lease renewal set up and torn down for a request that ends before its
first TOUCH. Prints one JSON line of µs per step (best of 5 runs). Run with
PYTHONPATH pointing at another checkout's clients/python/src to compare
(bench/peers/python_micro_ab.sh)."""

from __future__ import annotations

import asyncio
import json
import time
import timeit
from typing import Any

from idem import middleware as m
from idem.fingerprint import Fingerprinter
from idem.keys import parse_key, redis_key

HEADERS = [
    (b"host", b"127.0.0.1:8000"),
    (b"content-type", b"application/json"),
    (b"idempotency-key", b"n1234-0-5678"),
    (b"content-length", b"14"),
]
SCOPE: dict[str, Any] = {
    "type": "http",
    "method": "POST",
    "headers": HEADERS,
    "raw_path": b"/idem/payments",
    "path": "/idem/payments",
    "query_string": b"",
}
SMALL = b'{"amount":100}'
LARGE = json.dumps(
    {
        "amount": 100,
        "currency": "EUR",
        "customer": {"id": "cus_123456", "email": "a@example.com", "name": "Zo\u00eb Doe"},
        "items": [{"sku": f"sku-{i}", "qty": i, "price": 12.5 * i} for i in range(10)],
        "metadata": {"order": "ord_98765", "note": "hello\nworld"},
    }
).encode()


def best(f: Any, n: int) -> float:
    return min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6


def lease_cost(n: int) -> float:
    """A request's renewal started and stopped before its first TOUCH."""

    class Mw:
        lease = 30.0

    held = m._Held(Mw(), "k", 1, m.Fingerprint(b"x" * 32))  # type: ignore[arg-type]

    async def new_style() -> None:
        renewal = m._Renewal(held)  # type: ignore[attr-defined]
        await asyncio.sleep(0)
        await renewal.stop()

    async def old_style() -> None:
        renewal = asyncio.ensure_future(held.keep_lease())
        await asyncio.sleep(0)
        renewal.cancel()
        try:
            await renewal
        except asyncio.CancelledError:
            pass

    one = new_style if hasattr(m, "_Renewal") else old_style

    async def run() -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                await one()
            times.append((time.perf_counter() - start) / n * 1e6)
        return min(times)

    return asyncio.run(run())


def main() -> None:
    fp = Fingerprinter(canonical_json=True)
    n = 5000
    out = {
        "parse_key": best(lambda: parse_key(m._lines(SCOPE, b"idempotency-key")), n),
        "redis_key": best(lambda: redis_key("idem:", "", "n1234-0-5678"), n),
        "fingerprint 14 B": best(lambda: fp.fingerprint("POST", m._target(SCOPE), HEADERS, SMALL), n),
        "fingerprint 600 B": best(
            lambda: fp.fingerprint("POST", m._target(SCOPE), HEADERS, LARGE), n // 5
        ),
        "lease renewal (no TOUCH)": lease_cost(n),
    }
    print(json.dumps({k: round(v, 2) for k, v in out.items()}))


if __name__ == "__main__":
    main()
