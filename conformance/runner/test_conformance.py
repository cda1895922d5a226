"""The conformance suite as pytest tests: every scenario file against every
example app (``CONFORMANCE_APPS=rust,python`` narrows them; an app whose
driver is missing is skipped) on every backend (``CONFORMANCE_BACKENDS``,
``module,functions`` by default), each variant of a scenario on a stack of
its own.

Every scenario runs on both (the library adds about 2 1/2 minutes for the
three apps on a 2-core machine); ``CONFORMANCE_FUNCTIONS_SCENARIOS`` narrows
the library's to a comma list of names, ``chaos`` to ``CHAOS_SET`` (the four
chaos scenarios, four_outcomes, read_through). A scenario with
``"module_only": "why"`` is skipped on the library with its reason; one
that starts no Redis (``kind: settings``) runs on the first backend only."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from runner.harness import BACKENDS, CONFORMANCE, App, Stack, start_app_with_env
from runner.scenario import Failed, Run, load_scenarios

SCENARIOS = load_scenarios(CONFORMANCE / "scenarios")


def selected_apps() -> list[str]:
    chosen = os.environ.get("CONFORMANCE_APPS")
    return [a for a in chosen.split(",") if a] if chosen else App.names()


CHAOS_SET = (
    "chaos_holder_freezes", "chaos_redis_forgets_in_progress",
    "chaos_redis_forgets_unmirrored", "chaos_redis_restarts",
    "four_outcomes", "read_through",
)  # fmt: skip


def selected_backends() -> list[str]:
    chosen = os.environ.get("CONFORMANCE_BACKENDS", ",".join(BACKENDS))
    backends = [b for b in chosen.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise ValueError(f"CONFORMANCE_BACKENDS: {sorted(unknown)}, not of {BACKENDS}")
    return backends


def on_backend(scenario: dict[str, Any], backend: str, first: bool) -> bool:
    """Whether the scenario is a case on ``backend`` (a module-only one is,
    and skips with its reason)."""
    if scenario.get("kind") == "settings":
        return first
    if backend == "module":
        return True
    chosen = os.environ.get("CONFORMANCE_FUNCTIONS_SCENARIOS", "all")
    if chosen == "all":
        return True
    names = chosen.split(",")
    return scenario["name"] in (CHAOS_SET if names == ["chaos"] else names)


def cases() -> list[Any]:
    out = []
    backends = selected_backends()
    for app in selected_apps():
        for n, backend in enumerate(backends):
            for scenario in SCENARIOS:
                if not on_backend(scenario, backend, n == 0):
                    continue
                for variant in scenario.get("variants", [{"name": "default"}]):
                    case_id = f"{app}-{backend}-{scenario['name']}-{variant['name']}"
                    out.append(pytest.param(app, backend, scenario, variant, id=case_id))
    return out


def app_or_skip(name: str) -> App:
    app = App.load(name)
    if (why := app.missing()) is not None:
        if os.environ.get("CONFORMANCE_REQUIRE", "").split(",").count(name):
            pytest.fail(f"{name}: {why}")
        pytest.skip(f"{name}: {why}")
    return app


@pytest.mark.parametrize(("app_name", "backend", "scenario", "variant"), cases())
def test_scenario(
    app_name: str, backend: str, scenario: dict[str, Any], variant: dict[str, Any]
) -> None:
    app = app_or_skip(app_name)
    if scenario.get("kind") == "settings":
        check_settings(app, scenario)
        return
    if backend != "module" and scenario.get("module_only"):
        pytest.skip(f"module only: {scenario['module_only']}")
    env = {**scenario.get("env", {}), **variant.get("env", {})}
    instances = int(scenario.get("instances", 1))
    with Stack(app, env, instances=instances, backend=backend) as stack:
        run = Run(stack, scenario)
        try:
            tally = asyncio.run(run.execute())
        except Failed as err:
            raise Failed(f"{err}\n{stack.logs()}") from None
        if "tally" in variant:
            print(f"{app_name} {backend} {scenario['name']} {variant['name']}: {tally}")
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
