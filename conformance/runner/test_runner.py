"""The runner's own checks fail where they should: each expectation against
a reply that breaks it, typos in scenario files, every scenario file well
formed. No servers: the replies are made up."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import httpx
import pytest

from runner.harness import CONFORMANCE, Stack
from runner.scenario import ACTIONS, Failed, Reply, Run, load_scenarios

PROBLEM = {
    "type": "urn:idem:problem:idempotency-key-in-use",
    "title": "A request with this Idempotency-Key is being processed",
    "status": 409,
    "detail": "The original request has not finished yet; retry after the indicated time.",
}


def reply(status: int, body: Any, **headers: str) -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Reply(status, httpx.Headers(headers), raw)


def run() -> Run:
    return Run(cast(Stack, None), {"steps": []})


CREATED = reply(
    201, {"id": 7, "amount": 5}, **{"content-type": "application/json", "location": "/payments/7"}
)
IN_FLIGHT = reply(409, PROBLEM, **{"content-type": "application/problem+json", "retry-after": "1"})


@pytest.mark.parametrize(
    ("got", "expect"),
    [
        (CREATED, {"status": 200}),
        (CREATED, {"replayed": True}),
        (CREATED, {"headers": {"location": "/payments/8"}}),
        (CREATED, {"headers": {"idempotent-replayed": "true"}}),
        (CREATED, {"json": {"amount": 6}}),
        (CREATED, {"json_members": ["id"]}),
        (CREATED, {"error": "invalid_payment"}),
        (CREATED, {"problem": "in_flight"}),
        (IN_FLIGHT, {"problem": "mismatch"}),
        (IN_FLIGHT, {"retry_after": [2, 3]}),
        (reply(409, {**PROBLEM, "detail": "other"}, **{"content-type": "application/problem+json"}),
         {"problem": "in_flight"}),
        (CREATED, {"same_body_as": "other"}),
        (CREATED, {"other_body_than": "same"}),
        (CREATED, {"location": "/payments/7"}),
    ],
)  # fmt: skip
def test_a_broken_expectation_fails(got: Reply, expect: dict[str, Any]) -> None:
    r = run()
    r.saved["other"] = reply(201, {"id": 8})
    r.saved["same"] = CREATED
    with pytest.raises(Failed):
        r.check(got, expect, "probe")


def test_kept_expectations_pass() -> None:
    r = run()
    r.saved["first"] = CREATED
    r.check(
        CREATED,
        {
            "status": [201, 409],
            "replayed": False,
            "headers": {"location": "/payments/{first.id}", "idempotent-replayed": None},
            "json": {"amount": 5},
            "json_members": ["amount", "id"],
            "same_body_as": "first",
        },
        "probe",
    )
    r.check(IN_FLIGHT, {"problem": "in_flight", "retry_after": [1, 2]}, "probe")


@pytest.mark.parametrize(
    "step",
    [
        {"sned": {}},
        {"send": {"kye": "k"}},
        {"sleep_ms": 1, "redis": "flushall"},
        {"storm": {"count": 1, "request": {}}, "expect": {"original": 1}},
    ],
)
def test_a_typo_in_a_step_fails(step: dict[str, Any]) -> None:
    with pytest.raises(Failed):
        asyncio.run(run().step(step, "probe"))


def test_every_scenario_file_is_well_formed() -> None:
    for scenario in load_scenarios(CONFORMANCE / "scenarios"):
        assert scenario.get("description"), scenario["name"]
        if scenario.get("kind") == "settings":
            assert scenario["cases"], scenario["name"]
            continue
        for step in scenario["steps"]:
            assert len(set(step) & ACTIONS) == 1, (scenario["name"], step)
        for variant in scenario.get("variants", []):
            assert set(variant) <= {"name", "env", "tally"}, (scenario["name"], variant)
