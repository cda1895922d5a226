"""The conformance suite as pytest tests: every scenario file against every
example app (``CONFORMANCE_APPS=rust,python`` narrows them; an app whose
driver is missing is skipped), each variant of a scenario on a stack of its
own."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from runner.harness import CONFORMANCE, App, Stack, start_app_with_env
from runner.scenario import Failed, Run, load_scenarios

SCENARIOS = load_scenarios(CONFORMANCE / "scenarios")


def selected_apps() -> list[str]:
    chosen = os.environ.get("CONFORMANCE_APPS")
    return [a for a in chosen.split(",") if a] if chosen else App.names()


def cases() -> list[Any]:
    out = []
    for app in selected_apps():
        for scenario in SCENARIOS:
            for variant in scenario.get("variants", [{"name": "default"}]):
                case_id = f"{app}-{scenario['name']}-{variant['name']}"
                out.append(pytest.param(app, scenario, variant, id=case_id))
    return out


def app_or_skip(name: str) -> App:
    app = App.load(name)
    if (why := app.missing()) is not None:
        if os.environ.get("CONFORMANCE_REQUIRE", "").split(",").count(name):
            pytest.fail(f"{name}: {why}")
        pytest.skip(f"{name}: {why}")
    return app


@pytest.mark.parametrize(("app_name", "scenario", "variant"), cases())
def test_scenario(app_name: str, scenario: dict[str, Any], variant: dict[str, Any]) -> None:
    app = app_or_skip(app_name)
    if scenario.get("kind") == "settings":
        check_settings(app, scenario)
        return
    env = {**scenario.get("env", {}), **variant.get("env", {})}
    with Stack(app, env, instances=int(scenario.get("instances", 1))) as stack:
        run = Run(stack, scenario)
        try:
            tally = asyncio.run(run.execute())
        except Failed as err:
            raise Failed(f"{err}\n{stack.logs()}") from None
        if "tally" in variant:
            print(f"{app_name} {scenario['name']} {variant['name']}: {tally}")
            check_tally(tally, variant["tally"], stack)
    if run.differences:
        pytest.xfail("known differences: " + "; ".join(run.differences))


def check_tally(tally: dict[str, Any], expected: dict[str, Any], stack: Stack) -> None:
    """``0`` is exact, ``">0"`` at least one; ``failures`` counts the clients
    that ended without a 2xx."""
    got = {**tally, "failures": len(tally["failures"])}
    wrong = {}
    for name, want in expected.items():
        value = got[name]
        ok = value > 0 if want == ">0" else value == want
        if not ok:
            wrong[name] = (value, want)
    if wrong:
        raise Failed(
            f"tally {wrong} (got, expected); failures: {tally['failures'][:5]}\n{stack.logs()}"
        )


def check_settings(app: App, scenario: dict[str, Any]) -> None:
    for case in scenario["cases"]:
        done = start_app_with_env(app, case["env"])
        if done.returncode == 0:
            raise Failed(f"{case['env']}: exited 0, expected a refusal")
        for text in case.get("stderr_contains", []):
            if text not in done.stderr:
                raise Failed(f"{case['env']}: stderr lacks {text!r}:\n{done.stderr[-2000:]}")
