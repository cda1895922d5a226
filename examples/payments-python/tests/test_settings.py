"""The environment as examples/payments-api/src/config.rs reads it: defaults,
overrides, and the refusals (the conformance suite's settings scenario runs
the same refusals through ./serve against every app)."""

from __future__ import annotations

import pytest

from payments_app.settings import Settings, SettingsError


def settings(**env: str) -> Settings:
    return Settings.from_env(env)


def test_defaults() -> None:
    s = settings(DATABASE_URL="postgres://x/db")
    assert s.port == 8080
    assert s.redis_url == "redis://127.0.0.1:6390/"
    assert s.read_through
    assert s.fence
    assert s.wait is None
    assert s.lease == 30.0
    assert s.pool_size == 16
    assert s.processor_delay == 0.0
    assert s.backend == "auto"
    assert s.tokens == {"tok_demo": "acct_demo", "tok_a": "acct_a", "tok_b": "acct_b"}


def test_overrides() -> None:
    s = settings(
        DATABASE_URL="postgres://x/db",
        PORT="9000",
        READ_THROUGH="off",
        WAIT_MS="5000",
        FENCE="0",
        LEASE_MS="1000",
        PG_POOL_SIZE="4",
        PROCESSOR_DELAY_MS="250",
        BACKEND="functions",
    )
    assert (s.port, s.read_through, s.wait, s.fence) == (9000, False, 5.0, False)
    assert (s.lease, s.pool_size, s.processor_delay) == (1.0, 4, 0.25)
    assert s.backend == "functions"
    assert settings(DATABASE_URL="x", WAIT_MS="0").wait is None, "0 turns waiting off"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "DATABASE_URL is not set"),
        ({"PORT": "http"}, 'PORT="http" is not a port'),
        ({"PORT": "65536"}, 'PORT="65536" is not a port'),
        ({"PORT": "-1"}, 'PORT="-1" is not a port'),
        ({"READ_THROUGH": "maybe"}, 'READ_THROUGH="maybe": use on or off'),
        ({"FENCE": "ON"}, 'FENCE="ON": use on or off'),
        ({"WAIT_MS": "1.5"}, 'WAIT_MS="1.5" is not a number of milliseconds'),
        ({"LEASE_MS": " 5"}, 'LEASE_MS=" 5" is not a number of milliseconds'),
        ({"PROCESSOR_DELAY_MS": ""}, 'PROCESSOR_DELAY_MS="" is not a number of milliseconds'),
        ({"PG_POOL_SIZE": "many"}, 'PG_POOL_SIZE="many"'),
        ({"BACKEND": "lua"}, 'BACKEND="lua": use auto, module, functions, scripts'),
    ],
)
def test_refusals(env: dict[str, str], message: str) -> None:
    full = env if not env else {"DATABASE_URL": "x", **env}
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Settings.from_env(full)


def test_api_tokens() -> None:
    s = settings(DATABASE_URL="x", API_TOKENS=" t1=acct_1, t2 = acct_2 ,")
    assert s.tokens == {"t1": "acct_1", "t2": "acct_2"}
    for bad in ("t1", "=acct", "t1=", "a=1,a=2", ",", ""):
        with pytest.raises(SettingsError):
            settings(DATABASE_URL="x", API_TOKENS=bad)
