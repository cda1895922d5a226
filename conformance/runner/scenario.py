"""The interpreter of the scenario files (``conformance/scenarios/*.json``;
the format is in ``conformance/README.md``): requests with expected
statuses, headers and bodies, storms of duplicates, well-behaved retrying
clients, faults (Redis flushed, killed, restarted; the writer or an app
instance frozen), checks on Postgres and the chaos tally."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from runner.harness import REPO, Stack

HTTP_SPEC: dict[str, Any] = json.loads((REPO / "spec/http.json").read_text())
PROBLEM_CONTENT_TYPE = HTTP_SPEC["headers"]["problem_content_type"]
REPLAYED = HTTP_SPEC["headers"]["replayed"]

_PLACEHOLDER = re.compile(r"\{(uid|i|[a-z_0-9]+\.[a-z_0-9]+)\}")
_OFFSET = re.compile(r"\{(\d+)\+i\}")


EXPECTATIONS = {
    "status", "replayed", "headers", "problem", "key_error", "retry_after", "json",
    "json_members", "error", "same_body_as", "other_body_than", "transport_error",
}  # fmt: skip
ACTIONS = {
    "send", "await", "storm", "clients", "sleep_ms", "redis", "writer", "app",
    "wait_mirrored", "db", "tally_wait", "tally",
}  # fmt: skip
STEP_OPTIONS = {
    "note", "as", "background", "expect", "retry_on", "within_ms", "instance",
    "known_differences",
}  # fmt: skip
REQUEST_FIELDS = {
    "method", "path", "instance", "key", "key_lines", "token", "json", "body",
    "body_repeat", "content_type", "headers",
}  # fmt: skip
STORM_EXPECTATIONS = {"each", "originals", "all_status", "successes_same_body"}


class Failed(AssertionError):
    """A scenario's expectation did not hold."""


@dataclass
class Reply:
    status: int
    headers: httpx.Headers
    body: bytes

    @property
    def replayed(self) -> bool:
        return bool(self.headers.get(REPLAYED) == HTTP_SPEC["headers"]["replayed_value"])

    def json(self) -> Any:
        return json.loads(self.body)

    def describe(self) -> str:
        return f"{self.status} {dict(self.headers)} {self.body[:300]!r}"


Answer = tuple[int, int | None, str | None]
"""A well-behaved client's end: its index, the payment id of its 2xx, or what went wrong."""


@dataclass
class Run:
    """One scenario against one stack."""

    stack: Stack
    scenario: dict[str, Any]
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    saved: dict[str, Reply] = field(default_factory=dict)
    background: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    finished: dict[str, list[Answer]] = field(default_factory=dict)
    http: httpx.AsyncClient | None = None
    differences: list[str] = field(default_factory=list)
    """Failures of steps marked as a known difference of this app."""
    keys: int = 0

    # ------------------------------------------------------------ templates

    def fill(self, value: Any, i: int | None = None) -> Any:
        """``{uid}``, ``{i}`` and ``{saved.field}`` replaced in every string of ``value``."""
        if isinstance(value, str):
            offset = _OFFSET.fullmatch(value)
            if offset is not None:  # "{1000+i}": an integer
                if i is None:
                    raise Failed(f"{value} outside a storm or clients step")
                return int(offset.group(1)) + i
            whole = _PLACEHOLDER.fullmatch(value)
            if whole is not None and "." in whole.group(1):
                return self._saved_field(whole.group(1))  # keeps the field's type
            return _PLACEHOLDER.sub(lambda m: str(self._placeholder(m.group(1), i)), value)
        if isinstance(value, list):
            return [self.fill(v, i) for v in value]
        if isinstance(value, dict):
            return {k: self.fill(v, i) for k, v in value.items()}
        return value

    def _placeholder(self, name: str, i: int | None) -> Any:
        if name == "uid":
            return self.uid
        if name == "i":
            if i is None:
                raise Failed("{i} outside a storm or clients step")
            return i
        return self._saved_field(name)

    def _saved_field(self, name: str) -> Any:
        reply, _, member = name.partition(".")
        if reply not in self.saved:
            raise Failed(f"no saved reply {reply!r}")
        return self.saved[reply].json()[member]

    # ------------------------------------------------------------ requests

    def build(self, spec: dict[str, Any], i: int | None = None) -> httpx.Request:
        spec = self.fill(spec, i)
        headers: list[tuple[str, str]] = []
        if "key" in spec and spec["key"] is not None:
            headers.append(("idempotency-key", spec["key"]))
        for line in spec.get("key_lines", []):
            headers.append(("idempotency-key", line))
        token = spec.get("token", "tok_demo")  # the apps' demo API_TOKENS; null: none
        if token is not None:
            headers.append(("authorization", f"Bearer {token}"))
        content: bytes
        if "json" in spec:
            content = json.dumps(spec["json"]).encode()
            headers.append(("content-type", "application/json"))
        elif "body" in spec:
            content = spec["body"].encode()
            headers.append(("content-type", spec.get("content_type", "application/json")))
        elif "body_repeat" in spec:
            content = spec["body_repeat"]["text"].encode() * int(spec["body_repeat"]["times"])
            headers.append(("content-type", "application/json"))
        else:
            content = b""
        headers.extend((k, v) for k, v in spec.get("headers", {}).items())
        instance = int(spec.get("instance", 0))
        url = self.stack.bases[instance] + spec.get("path", "/payments")
        assert self.http is not None
        return self.http.build_request(
            spec.get("method", "POST"), url, headers=headers, content=content
        )

    async def send(self, spec: dict[str, Any], i: int | None = None) -> Reply:
        assert self.http is not None
        response = await self.http.send(self.build(spec, i))
        return Reply(response.status_code, response.headers, response.content)

    # ------------------------------------------------------------ expectations

    def check(self, reply: Reply, expect: dict[str, Any], what: str) -> None:
        unknown = set(expect) - EXPECTATIONS
        if unknown:
            raise Failed(f"{what}: unknown expectation(s) {sorted(unknown)}")
        expect = self.fill(expect)

        def fail(message: str) -> Failed:
            return Failed(f"{what}: {message}; reply: {reply.describe()}")

        status = expect.get("status")
        if status is not None:
            allowed = status if isinstance(status, list) else [status]
            if reply.status not in allowed:
                raise fail(f"status {reply.status}, expected {allowed}")
        if "replayed" in expect and reply.replayed != expect["replayed"]:
            raise fail(f"Idempotent-Replayed {reply.replayed}, expected {expect['replayed']}")
        for name, value in expect.get("headers", {}).items():
            got = reply.headers.get(name)
            if got != (None if value is None else str(value)):
                raise fail(f"header {name}: {got!r}, expected {value!r}")
        if "problem" in expect:
            self._check_problem(reply, expect["problem"], fail)
        if "key_error" in expect:
            detail = HTTP_SPEC["key_errors"][expect["key_error"]]
            if _json_or_fail(reply, fail).get("detail") != detail:
                raise fail(f"problem detail {detail!r} expected")
        if "retry_after" in expect:
            low, high = expect["retry_after"]
            value = reply.headers.get("retry-after", "")
            if not value.isdigit() or not low <= int(value) <= high:
                raise fail(f"Retry-After {value!r}, expected {low}..{high}")
        if "json" in expect:
            body = _json_or_fail(reply, fail)
            for name, value in expect["json"].items():
                if not isinstance(body, dict) or body.get(name) != value:
                    raise fail(f"body member {name}: expected {value!r}")
        if "json_members" in expect:
            body = _json_or_fail(reply, fail)
            if not isinstance(body, dict) or sorted(body) != sorted(expect["json_members"]):
                raise fail(f"body members, expected exactly {expect['json_members']}")
        if "error" in expect:
            body = _json_or_fail(reply, fail)
            if not isinstance(body, dict) or body.get("error") != expect["error"]:
                raise fail(f"error {expect['error']!r} expected")
            if not reply.headers.get("content-type", "").startswith("application/json"):
                raise fail("an error body is application/json")
        if "same_body_as" in expect:
            earlier = self.saved[expect["same_body_as"]]
            if reply.body != earlier.body:
                raise fail(f"body differs from {expect['same_body_as']}: {earlier.body!r}")
        if "other_body_than" in expect:
            earlier = self.saved[expect["other_body_than"]]
            if reply.body == earlier.body:
                raise fail(f"body equals {expect['other_body_than']}'s")

    @staticmethod
    def _check_problem(reply: Reply, name: str, fail: Any) -> None:
        spec = HTTP_SPEC["problems"][name]
        if reply.headers.get("content-type") != PROBLEM_CONTENT_TYPE:
            raise fail(f"problem {name}: content-type {PROBLEM_CONTENT_TYPE} expected")
        body = _json_or_fail(reply, fail)
        for member in ("type", "title", "status"):
            if body.get(member) != spec[member]:
                raise fail(f"problem {name}: {member} {spec[member]!r} expected")
        if spec.get("detail") is not None and body.get("detail") != spec["detail"]:
            raise fail(f"problem {name}: detail {spec['detail']!r} expected")
        if spec.get("retry_after") is not None and (
            reply.headers.get("retry-after") != spec["retry_after"]
        ):
            raise fail(f"problem {name}: Retry-After {spec['retry_after']} expected")

    # ------------------------------------------------------------ steps

    async def execute(self) -> dict[str, Any]:
        """Runs every step; answers the chaos tally when the scenario has one."""
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=100)
        timeout = httpx.Timeout(float(self.scenario.get("request_timeout_s", 30)))
        tally: dict[str, Any] = {}
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            self.http = http
            try:
                for n, step in enumerate(self.scenario["steps"]):
                    what = f"step {n} {step.get('note', '')}".strip()
                    known = step.get("known_differences", {}).get(self.stack.app.name)
                    try:
                        result = await self.step(step, what)
                    except Failed as err:
                        if known is None:
                            raise
                        self.differences.append(f"{known} ({err})")
                        continue
                    if known is not None:
                        raise Failed(f"{what}: no longer differs ({known}): drop the marker")
                    if result is not None:
                        tally = result
            finally:
                for task in self.background.values():
                    task.cancel()
        return tally

    async def step(self, step: dict[str, Any], what: str) -> dict[str, Any] | None:
        action = set(step) & ACTIONS
        if len(action) != 1 or not set(step) <= ACTIONS | STEP_OPTIONS:
            raise Failed(f"{what}: a step has one action of {sorted(ACTIONS)}: {sorted(step)}")
        if "send" in step and not set(step["send"]) <= REQUEST_FIELDS:
            raise Failed(f"{what}: unknown request field(s) {set(step['send']) - REQUEST_FIELDS}")
        if "send" in step:
            if step.get("background"):
                self.background[step["as"]] = asyncio.ensure_future(self.send(step["send"]))
                await asyncio.sleep(0)
                return None
            reply = await self.send(step["send"])
            deadline = time.monotonic() + float(step.get("within_ms", 0)) / 1000
            while reply.status in step.get("retry_on", []) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                reply = await self.send(step["send"])
            if "as" in step:
                self.saved[step["as"]] = reply  # its own expectations may name it
            self.check(reply, step.get("expect", {}), what)
        elif "await" in step:
            expect = step.get("expect", {})
            try:
                reply = await self.background.pop(step["await"])
            except httpx.TransportError:
                if expect.get("transport_error"):
                    return None
                raise
            if expect.get("transport_error"):
                raise Failed(f"{what}: a reply, expected none: {reply.describe()}")
            self.check(reply, expect, f"{what} (await {step['await']})")
            self.saved[step["await"]] = reply
        elif "storm" in step:
            await self.storm(step["storm"], step.get("expect", {}), what)
        elif "clients" in step:
            spec = step["clients"]
            self.keys = int(spec["count"])
            tasks = [asyncio.ensure_future(self.well_behaved(spec, i)) for i in range(self.keys)]
            self.background[step["as"]] = asyncio.ensure_future(asyncio.gather(*tasks))
            await asyncio.sleep(0)
        elif "sleep_ms" in step:
            await asyncio.sleep(float(self.fill(step["sleep_ms"])) / 1000)
        elif "redis" in step:
            await asyncio.to_thread(self.redis_action, step["redis"])
        elif "writer" in step:
            assert self.stack.writer is not None
            sig = {"freeze": signal.SIGSTOP, "thaw": signal.SIGCONT}[step["writer"]]
            self.stack.writer.signal(sig)
        elif "app" in step:
            await asyncio.to_thread(self.app_action, step["app"], int(step.get("instance", 0)))
        elif "wait_mirrored" in step:
            await asyncio.to_thread(self.wait_mirrored, float(step["wait_mirrored"]["within_ms"]))
        elif "db" in step:
            await asyncio.to_thread(self.check_db, step["db"], what)
        elif "tally_wait" in step:
            self.finished[step["tally_wait"]] = await self.background.pop(step["tally_wait"])
        elif "tally" in step:
            answers: list[Answer] = []
            for name in step["tally"]["clients"]:
                done = self.finished.pop(name, None)
                answers.extend(done if done is not None else await self.background.pop(name))
            return await asyncio.to_thread(self.tally, answers)
        else:
            raise Failed(f"{what}: unknown step {sorted(step)}")
        return None

    async def storm(self, spec: dict[str, Any], expect: dict[str, Any], what: str) -> None:
        if not set(expect) <= STORM_EXPECTATIONS:
            raise Failed(f"{what}: unknown storm expectation(s) {set(expect) - STORM_EXPECTATIONS}")
        count = int(spec["count"])
        replies = await asyncio.gather(*(self.send(spec["request"]) for _ in range(count)))
        for n, reply in enumerate(replies):
            self.check(reply, expect.get("each", {}), f"{what} reply {n}")
        originals = [r for r in replies if 200 <= r.status < 300 and not r.replayed]
        if "originals" in expect and len(originals) != expect["originals"]:
            raise Failed(f"{what}: {len(originals)} originals, expected {expect['originals']}")
        if expect.get("successes_same_body"):
            bodies = {r.body for r in replies if 200 <= r.status < 300}
            if len(bodies) > 1:
                raise Failed(f"{what}: 2xx bodies differ: {sorted(bodies)[:3]!r}")
        if "all_status" in expect:
            odd = [r.status for r in replies if r.status != expect["all_status"]]
            if odd:
                raise Failed(f"{what}: statuses {sorted(set(odd))}, all {expect['all_status']}")
        if "as" in spec and originals:
            self.saved[spec["as"]] = originals[0]

    async def well_behaved(self, spec: dict[str, Any], i: int) -> Answer:
        """POSTs until a 2xx, retrying on 409, 503 and connection errors;
        answers the payment id (the Rust chaos test's client)."""
        patience = float(spec.get("patience_ms", 30_000)) / 1000
        backoff = float(spec.get("backoff_ms", 200)) / 1000
        deadline = time.monotonic() + patience
        while True:
            try:
                reply = await self.send(spec["request"], i)
            except httpx.TransportError:
                reply = None
            if reply is not None and 200 <= reply.status < 300:
                payment = reply.json().get("id")
                if not isinstance(payment, int):
                    return (i, None, f"client {i}: 2xx without an id: {reply.describe()}")
                return (i, payment, None)
            if reply is not None and reply.status not in (409, 503):
                return (i, None, f"client {i}: {reply.describe()}")
            if time.monotonic() > deadline:
                return (i, None, f"client {i}: no 2xx within {patience} s")
            await asyncio.sleep(backoff)

    # ------------------------------------------------------------ faults

    def redis_action(self, action: str) -> None:
        if action == "flushall":
            self.stack.redis().flushall()
        elif action == "kill":
            self.stack.kill_redis()
        elif action == "start":
            self.stack.start_redis()
        else:
            raise Failed(f"unknown redis action {action!r}")

    def app_action(self, action: str, instance: int) -> None:
        proc = self.stack.apps[instance]
        if action == "freeze":
            proc.signal(signal.SIGSTOP)
        elif action == "thaw":
            proc.signal(signal.SIGCONT)
        elif action == "kill":
            proc.kill()
        else:
            raise Failed(f"unknown app action {action!r}")

    def wait_mirrored(self, within_ms: float) -> None:
        """Until nothing completed in Redis is waiting for the writer."""
        deadline = time.monotonic() + within_ms / 1000
        while time.monotonic() < deadline:
            if self.stack.mirror_pending() == 0:
                return
            time.sleep(0.05)
        raise Failed(f"the writer did not mirror within {within_ms} ms")

    def check_db(self, spec: dict[str, Any], what: str) -> None:
        spec = self.fill(spec)
        table = {"payments": "payments", "charges": "processor_charges"}[spec["table"]]
        where = spec.get("where", {})
        columns = {"recipient", "amount", "currency"}
        if not set(where) <= columns:
            raise Failed(f"{what}: filter on {sorted(where)}, only {sorted(columns)}")
        clause = " AND ".join(f"{c} = %s" for c in where) or "true"
        rows = self.stack.query(
            f"SELECT count(*) FROM {table} WHERE {clause}", tuple(where.values())
        )
        count = int(rows[0][0])
        if count != spec["count"]:
            raise Failed(f"{what}: {count} rows in {table} where {where}, expected {spec['count']}")

    def tally(self, answers: list[Answer]) -> dict[str, Any]:
        """What a chaos run left behind (the Rust chaos test's ``Tally``)."""
        base = int(self.scenario.get("amount_base", 1000))
        payments = {
            int(a) - base: int(n)
            for a, n in self.stack.query("SELECT amount, count(*) FROM payments GROUP BY amount")
        }
        double_charged = len(
            self.stack.query(
                "SELECT amount FROM processor_charges GROUP BY amount HAVING count(*) > 1"
            )
        )
        ids: dict[int, set[int]] = defaultdict(set)
        failures: list[str] = []
        for i, payment, error in answers:
            if payment is not None:
                ids[i].add(payment)
            if error is not None:
                failures.append(error)
        return {
            "doubled": sum(1 for n in payments.values() if n > 1),
            "double_charged": double_charged,
            "inconsistent": sum(1 for s in ids.values() if len(s) > 1),
            "unpaid": sum(1 for k in range(self.keys) if k not in payments),
            "failures": failures,
        }


def _json_or_fail(reply: Reply, fail: Any) -> Any:
    try:
        return reply.json()
    except ValueError:
        raise fail("the body is not JSON") from None


def load_scenarios(directory: Path) -> list[dict[str, Any]]:
    scenarios = []
    for path in sorted(directory.glob("*.json")):
        scenario = json.loads(path.read_text())
        scenario.setdefault("name", path.stem)
        scenarios.append(scenario)
    return scenarios
