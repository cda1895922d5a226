"""The ASGI middleware's HTTP semantics (spec/http.json) on a Starlette app
through httpx's ASGI transport, against redis-server with the module."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

import idem
import idem.asyncio
from idem.canonical_json import canonicalize
from idem.middleware import IdempotencyContext, IdempotencyMiddleware
from idem.testing import RedisServer, free_port, stop_redis

from conftest import start_redis

HTTP = json.loads((Path(__file__).resolve().parents[3] / "spec/http.json").read_text())
PROBLEMS = HTTP["problems"]


class Handler:
    """The application behind the middleware: counts its runs."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()
        self.release.set()
        self.started = asyncio.Event()
        self.contexts: list[IdempotencyContext] = []
        self.status = 201
        self.delay = 0.0
        self.body_size = 0
        self.on_run: Callable[[], Any] | None = None

    async def endpoint(self, request: Request) -> Response:
        self.runs += 1
        if "idem" in request.scope:
            self.contexts.append(request.scope["idem"])
        self.started.set()
        await self.release.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.on_run is not None:
            await self.on_run()
        if request.url.path == "/boom":
            raise RuntimeError("handler failed")
        body = await request.body()
        payload = {"run": self.runs, "echo": body.decode()}
        if self.body_size:
            payload["pad"] = "x" * self.body_size
        return JSONResponse(
            payload,
            status_code=self.status,
            headers={"location": f"/payments/{self.runs}", "x-other": "not stored"},
        )


async def passthrough(request: Request) -> Response:
    return JSONResponse({"passthrough": True, "has_idem": "idem" in request.scope})


def make_app(handler: Handler, **options: Any) -> Starlette:
    return Starlette(
        routes=[
            Route("/pay", handler.endpoint, methods=["POST", "PATCH"]),
            Route("/boom", handler.endpoint, methods=["POST"]),
            Route("/pay", passthrough, methods=["GET", "PUT"]),
        ],
        middleware=[Middleware(IdempotencyMiddleware, **options)],
    )


@pytest.fixture
async def http(
    aclient: idem.asyncio.IdemClient,
) -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    made: list[httpx.AsyncClient] = []

    def build(handler: Handler, **options: Any) -> httpx.AsyncClient:
        options.setdefault("client", aclient)
        app = make_app(handler, **options)
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        made.append(c)
        return c

    yield build
    for c in made:
        await c.aclose()


def unique() -> str:
    import uuid

    return uuid.uuid4().hex


def post(c: httpx.AsyncClient, key: str | None, body: str = '{"amount":10}', **kw: Any) -> Any:
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    if key is not None:
        headers["idempotency-key"] = key
    return c.post(kw.pop("path", "/pay"), content=body, headers=headers, **kw)


def assert_problem(r: httpx.Response, name: str, detail: str | None = None) -> None:
    spec = PROBLEMS[name]
    assert r.status_code == spec["status"]
    assert r.headers["content-type"] == HTTP["headers"]["problem_content_type"]
    expected = {k: spec[k] for k in ("type", "title", "status", "detail")}
    if detail is not None:
        expected["detail"] = detail
    assert r.content == canonicalize(json.dumps(expected).encode())


async def test_new_then_replay_with_stored_headers(http: Any) -> None:
    h = Handler()
    c = http(h)
    k = unique()
    first = await post(c, k)
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert first.headers["x-other"] == "not stored"
    again = await post(c, k, body='{ "amount" : 10 }')  # canonical JSON: the same request
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == "/payments/1"
    assert again.headers["content-type"] == "application/json"
    assert "x-other" not in again.headers
    assert h.runs == 1
    ctx = h.contexts[0]
    assert ctx.key == f"idem:{{:{k}}}" and ctx.token > 0 and ctx.ttl == 86400


async def test_mismatch_is_422(http: Any) -> None:
    h = Handler()
    c = http(h)
    k = unique()
    assert (await post(c, k)).status_code == 201
    assert_problem(await post(c, k, body='{"amount":11}'), "mismatch")
    assert_problem(await post(c, k, path="/boom"), "mismatch")
    assert h.runs == 1


async def test_in_flight_is_409_with_retry_after(http: Any) -> None:
    h = Handler()
    h.release.clear()
    c = http(h)
    k = unique()
    original = asyncio.ensure_future(post(c, k))
    await h.started.wait()
    duplicate = await post(c, k)
    assert_problem(duplicate, "in_flight")
    assert duplicate.headers["retry-after"] == "2"  # the 30 s lease, capped by max_retry_after
    h.release.set()
    assert (await original).status_code == 201
    assert h.runs == 1


async def test_server_errors_and_429_are_not_stored(http: Any) -> None:
    for status in (500, 503, 429):
        h = Handler()
        h.status = status
        c = http(h)
        k = unique()
        assert (await post(c, k)).status_code == status
        assert (await post(c, k)).status_code == status
        assert h.runs == 2, status
    h = Handler()
    h.status = 500
    c = http(h, store_policy=lambda status: True)
    k = unique()
    await post(c, k)
    replay = await post(c, k)
    assert replay.status_code == 500 and replay.headers["idempotent-replayed"] == "true"
    assert h.runs == 1


async def test_bad_missing_and_repeated_keys(http: Any) -> None:
    h = Handler()
    c = http(h)
    errors = HTTP["key_errors"]
    assert_problem(await post(c, ""), "invalid_key", errors["empty"])
    assert_problem(await post(c, "k" * 256), "invalid_key", errors["too_long"])
    assert_problem(await post(c, "two words"), "invalid_key", errors["malformed"])
    repeated = await c.post(
        "/pay", content="{}", headers=[("idempotency-key", "a"), ("idempotency-key", "b")]
    )
    assert_problem(repeated, "invalid_key", errors["repeated"])
    assert h.runs == 0
    # No key passes through, and so do methods not covered.
    assert (await post(c, None)).status_code == 201
    assert (await post(c, None)).status_code == 201
    assert h.runs == 2
    got = await c.get("/pay", headers={"idempotency-key": "k"})
    assert got.json() == {"passthrough": True, "has_idem": False}
    required = http(Handler(), required=True)
    assert_problem(await post(required, None), "missing_key")
    # An sf-string and a token name the same key.
    k = unique()
    assert (await post(c, f'"{k}"')).status_code == 201
    assert (await post(c, k)).headers["idempotent-replayed"] == "true"


async def test_large_request_is_413_and_large_response_is_sent_not_stored(http: Any) -> None:
    h = Handler()
    c = http(h, max_request_body=100, max_response_body=1000)
    assert_problem(await post(c, unique(), body="x" * 101), "request_too_large")
    assert h.runs == 0
    h.body_size = 5000
    k = unique()
    big = await post(c, k)
    assert big.status_code == 201 and len(big.content) > 5000
    assert json.loads(big.content)["run"] == 1
    again = await post(c, k)
    assert "idempotent-replayed" not in again.headers
    assert h.runs == 2


async def test_tenants_scope_keys(http: Any, aclient: idem.asyncio.IdemClient) -> None:
    h = Handler()
    c = http(h, tenant_header="x-account-id")
    k = unique()
    a = await post(c, k, headers={"x-account-id": "acct_a"})
    b = await post(c, k, headers={"x-account-id": "acct_b"})
    assert a.status_code == b.status_code == 201
    assert h.runs == 2
    assert (await post(c, k, headers={"x-account-id": "acct_a"})).headers[
        "idempotent-replayed"
    ] == "true"
    assert await aclient.get(idem.redis_key("idem:", "acct_a", k)) is not None
    assert await aclient.get(idem.redis_key("idem:", "acct_b", k)) is not None


TOKENS = {
    "tok_a": "acct_1",
    "tok_b": "acct_2",
    "tok_empty": "",
    "tok_128": "a" * 128,
    "tok_129": "a" * 129,
    "tok_utf8_129": "\u00e9" * 64 + "a",
}


def authenticating(app: Any) -> Any:
    """A stand-in for the app's authentication, outside the middleware: a
    known bearer token leaves its account in ``scope["state"]``."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode()
            scope.setdefault("state", {})
            if auth.startswith("Bearer ") and auth[7:] in TOKENS:
                scope["state"]["account"] = TOKENS[auth[7:]]
        await app(scope, receive, send)

    return asgi


def authed_client(handler: Handler, aclient: idem.asyncio.IdemClient, **options: Any) -> Any:
    app = authenticating(make_app(handler, client=aclient, **options))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_the_tenant_comes_from_the_authenticated_caller(
    aclient: idem.asyncio.IdemClient,
) -> None:
    h = Handler()
    tenant = lambda scope: scope["state"].get("account")  # noqa: E731
    async with authed_client(h, aclient, tenant=tenant) as c:
        k = unique()

        def as_(token: str | None) -> Any:
            headers = {} if token is None else {"authorization": f"Bearer {token}"}
            return post(c, k, headers=headers)

        a, b = await as_("tok_a"), await as_("tok_b")
        assert a.status_code == b.status_code == 201
        assert "idempotent-replayed" not in b.headers, "acct_1's response went to acct_2"
        assert (await as_("tok_a")).headers["idempotent-replayed"] == "true"
        assert h.runs == 2
        for token in (None, "tok_unknown", "tok_empty"):
            assert_problem(await as_(token), "missing_tenant")
        for token in ("tok_129", "tok_utf8_129"):
            assert_problem(await as_(token), "invalid_tenant")
        assert h.runs == 2, "no refused request ran"
        assert await aclient.get(idem.redis_key("idem:", "", k)) is None, "no anonymous scope"
        assert await aclient.get(idem.redis_key("idem:", "a" * 129, k)) is None
        assert (await as_("tok_128")).status_code == 201, "at the bound"
        assert await aclient.get(idem.redis_key("idem:", "a" * 128, k)) is not None


async def test_a_tenant_header_that_is_missing_or_empty_is_refused(http: Any) -> None:
    h = Handler()
    c = http(h, tenant_header="x-account-id")
    k = unique()
    assert_problem(await post(c, k), "missing_tenant")
    assert_problem(await post(c, k, headers={"x-account-id": ""}), "missing_tenant")
    assert_problem(await post(c, k, headers={"x-account-id": "a" * 8192}), "invalid_tenant")
    assert h.runs == 0
    assert (await post(c, k, headers={"x-account-id": "a" * 128})).status_code == 201


async def test_without_a_tenant_source_every_caller_shares_one_scope(
    aclient: idem.asyncio.IdemClient,
) -> None:
    h = Handler()
    async with authed_client(h, aclient) as c:
        k = unique()
        first = await post(c, k, headers={"authorization": "Bearer tok_a"})
        other = await post(c, k, headers={"x-account-id": "a" * 8192})
        assert first.status_code == other.status_code == 201
        assert other.headers["idempotent-replayed"] == "true"
        assert h.runs == 1
        assert await aclient.get(idem.redis_key("idem:", "", k)) is not None


async def test_wait_for_result_gives_duplicates_the_original_answer(http: Any) -> None:
    h = Handler()
    h.release.clear()
    c = http(h, wait_for_result=5)
    k = unique()
    original = asyncio.ensure_future(post(c, k))
    await h.started.wait()
    duplicates = [asyncio.ensure_future(post(c, k)) for _ in range(5)]
    await asyncio.sleep(0.2)
    h.release.set()
    first = await original
    answers = await asyncio.gather(*duplicates)
    assert h.runs == 1
    for r in answers:
        assert r.status_code == 201 and r.content == first.content
        assert r.headers["idempotent-replayed"] == "true"


async def test_the_lease_is_renewed_while_the_handler_runs(http: Any) -> None:
    h = Handler()
    h.delay = 1.0
    c = http(h, lease=0.3)
    k = unique()
    original = asyncio.ensure_future(post(c, k))
    await h.started.wait()
    await asyncio.sleep(0.7)  # more than twice the lease
    assert_problem(await post(c, k), "in_flight")
    assert (await original).status_code == 201
    assert h.runs == 1


async def test_without_renewal_a_slow_handler_would_be_taken_over(
    redis_server: RedisServer,
) -> None:
    # The teeth of the test above: a holder that stops renewing loses its key.
    c = idem.asyncio.IdemClient.from_url(redis_server.url)
    k = f"idem:{{:{unique()}}}"
    assert isinstance(await c.begin(k, b"fp", ttl=60, lease=0.3), idem.New)
    await asyncio.sleep(0.7)
    assert isinstance(await c.begin(k, b"fp", ttl=60, lease=0.3), idem.New)
    await c.aclose()


async def test_redis_down_is_503_or_fail_open(http: Any) -> None:
    dead = idem.asyncio.IdemClient.from_url(f"redis://127.0.0.1:{free_port()}/", call_timeout=0.5)
    h = Handler()
    closed = http(h, client=dead)
    r = await post(closed, unique())
    assert_problem(r, "unavailable")
    assert r.headers["retry-after"] == "1"
    assert h.runs == 0
    opened = http(h, client=dead, fail_open=True)
    assert (await post(opened, unique())).status_code == 201
    assert h.runs == 1
    await dead.aclose()


async def test_a_failing_handler_releases_its_key(http: Any) -> None:
    h = Handler()
    c = http(h)
    k = unique()
    with pytest.raises(RuntimeError, match="handler failed"):
        await post(c, k, path="/boom")
    with pytest.raises(RuntimeError, match="handler failed"):
        await post(c, k, path="/boom")
    assert h.runs == 2


async def test_a_key_lost_while_running_is_stored_under_a_new_token(
    http: Any, target: RedisServer
) -> None:
    h = Handler()
    k = unique()
    raw = redis.asyncio.Redis(port=target.port)

    async def lose_key() -> None:
        await raw.delete(f"idem:{{:{k}}}")

    h.on_run = lose_key
    c = http(h)
    first = await post(c, k)
    assert first.status_code == 201
    again = await post(c, k)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert h.runs == 1
    await raw.aclose()


async def test_read_through_after_redis_forgets(
    http: Any, database_url: str, target: RedisServer, aclient: idem.asyncio.IdemClient
) -> None:
    h = Handler()
    async with AsyncConnectionPool(database_url, min_size=1, max_size=2, open=False) as pool:
        c = http(h, read_through=idem.AsyncReadThrough(pool))
        k = unique()
        first = await post(c, k)
        assert first.status_code == 201
        # The writer mirrored it; then Redis lost it.
        redis_key = f"idem:{{:{k}}}"
        record = await aclient.get(redis_key)
        assert record is not None and record.response is not None
        flat = [part for n, v in record.response.headers for part in (n.encode(), v)]
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO idempotency_keys (key, fingerprint, status, token, created_at,"
                " expires_at, response_status, response_body, response_headers, completed_at)"
                " VALUES (%s, %s, 'completed', %s, now(), now() + interval '1 hour', %s, %s,"
                " %s, now())",
                (redis_key, record.fingerprint_hex, record.token, record.response.status,
                 record.response.body, flat),
            )  # fmt: skip
        redis.Redis(port=target.port).delete(redis_key)
        again = await post(c, k)
        assert again.status_code == 201 and again.content == first.content
        assert again.headers["idempotent-replayed"] == "true"
        assert h.runs == 1
        assert_problem(await post(c, k, body='{"amount":99}'), "mismatch")


def fingerprint_vector(name: str) -> dict[str, Any]:
    doc = json.loads(
        (Path(__file__).resolve().parents[3] / "spec/vectors/fingerprint.json").read_text()
    )
    (case,) = [c for c in doc["cases"] if c["name"] == name]
    return case  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "name", ["canonical_with_header_and_query", "query_kept_as_sent", "percent_encoding_kept"]
)
async def test_the_middleware_fingerprints_as_the_rust_layer(
    name: str, aclient: idem.asyncio.IdemClient
) -> None:
    case = fingerprint_vector(name)
    request, config = case["request"], case["fingerprinter"]

    async def created(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = IdempotencyMiddleware(
        created,
        client=aclient,
        fingerprinter=idem.Fingerprinter(
            headers=config["headers"], canonical_json=config["canonical_json"]
        ),
    )
    k = unique()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.request(
            request["method"],
            request["target"],
            content=request["body"].encode(),
            headers=[*request["headers"], ("idempotency-key", k)],
        )
    assert r.status_code == 201
    record = await aclient.get(f"idem:{{:{k}}}")
    assert record is not None
    assert record.fingerprint_hex == case["expected"]["stored_hex"]


async def test_a_client_hanging_up_does_not_cut_the_flow_short(
    aclient: idem.asyncio.IdemClient,
) -> None:
    h = Handler()
    h.release.clear()
    app = make_app(h, client=aclient)
    k = unique()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/pay", "raw_path": b"/pay", "query_string": b"",
        "root_path": "", "server": ("t", 80), "client": ("c", 1),
        "headers": [(b"idempotency-key", k.encode()), (b"content-type", b"application/json")],
    }  # fmt: skip
    messages = [{"type": "http.request", "body": b'{"amount":10}', "more_body": False}]
    hung_up = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await hung_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        pass

    request = asyncio.ensure_future(app(scope, receive, send))
    await h.started.wait()
    request.cancel()  # the server gives up on the request
    hung_up.set()
    with pytest.raises(asyncio.CancelledError):
        await request
    h.release.set()
    for _ in range(100):
        record = await aclient.get(f"idem:{{:{k}}}")
        if record is not None and record.state == "completed":
            break
        await asyncio.sleep(0.02)
    assert record is not None and record.state == "completed"
    assert record.response is not None and record.response.status == 201
    assert h.runs == 1


async def test_a_full_redis_answers_a_new_key_503_and_keeps_a_finished_one(
    http: Any, fresh_redis: RedisServer
) -> None:
    c = idem.asyncio.IdemClient.from_url(fresh_redis.url)
    raw = redis.asyncio.Redis(port=fresh_redis.port)
    h = Handler()
    app = http(h, client=c, store_retry=10)
    await raw.config_set("maxmemory", 1)
    r = await post(app, unique())
    assert_problem(r, "unavailable")
    assert h.runs == 0
    await raw.config_set("maxmemory", 0)

    # Redis fills up while the handler runs: COMPLETE is refused (OOM); the
    # key stays held (a retry is 409, not a second run) and the response is
    # stored in the background once memory is freed.
    async def fill_up() -> None:
        await raw.config_set("maxmemory", 1)

    h.on_run = fill_up
    k = unique()
    first = await post(app, k)
    assert first.status_code == 201
    h.on_run = None
    assert_problem(await post(app, k), "in_flight")
    await raw.config_set("maxmemory", 0)
    for _ in range(100):
        record = await c.get(f"idem:{{:{k}}}")
        if record is not None and record.state == "completed":
            break
        await asyncio.sleep(0.05)
    replay = await post(app, k)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content
    assert h.runs == 1
    await raw.aclose()
    await c.aclose()


async def test_a_failing_background_task_after_a_complete_response_stores_it(
    aclient: idem.asyncio.IdemClient,
) -> None:
    # Starlette runs a response's BackgroundTask after it sent the response:
    # its failure reaches the middleware with the response complete. The
    # response is stored and sent (the app's error re-raised); a retry
    # replays it instead of charging again.
    charges = 0

    async def failing_follow_up() -> None:
        raise RuntimeError("the background task failed")

    async def charge(request: Request) -> Response:
        nonlocal charges
        charges += 1
        return JSONResponse(
            {"charge": charges}, status_code=201, background=BackgroundTask(failing_follow_up)
        )

    app = Starlette(
        routes=[Route("/pay", charge, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, client=aclient)],
    )
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        k = unique()
        first = await post(c, k)
        assert first.status_code == 201 and first.json() == {"charge": 1}
        again = await post(c, k)
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert again.json() == {"charge": 1}
    assert charges == 1, "the retry ran the handler again"
    record = await aclient.get(f"idem:{{:{k}}}")
    assert record is not None and record.state == "completed"


async def test_pass_through_response_extensions_are_not_offered_to_the_app(
    aclient: idem.asyncio.IdemClient, tmp_path: Path
) -> None:
    # A server offering http.response.pathsend (or zerocopysend, trailers):
    # Starlette's FileResponse would then send the path instead of a body,
    # and that message would reach the server before the buffered start.
    # The middleware hides those extensions, so the file is buffered, stored
    # and replayed as any body.
    receipt = tmp_path / "receipt.txt"
    receipt.write_bytes(b"paid 10")
    runs = 0

    async def download(request: Request) -> Response:
        nonlocal runs
        runs += 1
        return FileResponse(receipt, status_code=201)

    inner = Starlette(
        routes=[Route("/pay", download, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, client=aclient)],
    )
    offered = {"http.response.pathsend": {}, "http.response.trailers": {}, "other": {}}
    seen: list[dict[str, Any]] = []

    async def server(scope: Any, receive: Any, send: Any) -> None:
        """A server with the extensions: pathsend after start only, as ASGI says."""
        started = False

        async def send_checked(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.pathsend":
                assert started, "pathsend before http.response.start"
                assert message["path"] == str(receipt)
                message = {"type": "http.response.body", "body": b"paid 10"}
            started = started or message["type"] == "http.response.start"
            await send(message)

        await inner({**scope, "extensions": offered}, receive, send_checked)

    def recording(scope: Any, receive: Any, send: Any) -> Any:
        """What the application behind the middleware is offered."""
        seen.append(dict(scope.get("extensions", {})))
        return router(scope, receive, send)

    router = inner.router
    inner.router = recording  # type: ignore[assignment,method-assign]
    transport = httpx.ASGITransport(app=server)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        k = unique()
        first = await post(c, k)
        assert first.status_code == 201 and first.content == b"paid 10"
        again = await post(c, k)
        assert again.content == b"paid 10" and again.headers["idempotent-replayed"] == "true"
    assert runs == 1
    assert seen and seen[0] == {"other": {}}, "only extensions that do not bypass the buffer"


async def test_a_redis_without_idem_is_reported_once(
    http: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_redis(module=False, renamed=("FUNCTION", "EVAL", "EVALSHA", "SCRIPT"))
    c = idem.asyncio.IdemClient.from_url(server.url)
    try:
        h = Handler()
        client = http(h, client=c, fail_open=True)
        with caplog.at_level(logging.ERROR, logger="idem"):
            for _ in range(3):
                assert_problem(await post(client, unique()), "internal")
        assert h.runs == 0, "a configuration error never fails open"
        reported = [r for r in caplog.records if "no idem on this Redis" in r.getMessage()]
        assert len(reported) == 1
        assert not [r for r in caplog.records if "IDEM.BEGIN failed" in r.getMessage()]
    finally:
        await c.aclose()
        stop_redis(server)
