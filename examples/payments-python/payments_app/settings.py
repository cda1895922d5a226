"""Settings from the environment, as ``examples/payments-api/src/config.rs``
reads them: the same names, defaults and refusals."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Lookup = Callable[[str], str | None]
BACKENDS = ("auto", "module", "functions", "scripts")
DEMO_TOKENS = "tok_demo=acct_demo,tok_a=acct_a,tok_b=acct_b"
"""The bearer tokens used when ``API_TOKENS`` is unset (scripts/up.sh, the
conformance suite), as in the Rust service: never deploy them."""


class SettingsError(ValueError):
    """A variable is missing or does not parse; the service does not start."""


@dataclass(frozen=True, slots=True)
class Settings:
    redis_url: str
    database_url: str
    port: int
    """The API listens on 127.0.0.1:``port``."""
    read_through: bool
    wait: float | None
    """Duplicates wait this long (seconds) for the original's answer; off when None."""
    lease: float
    """Seconds."""
    pool_size: int
    processor_delay: float
    """Simulated payment-processor latency per new payment (seconds; 0 = none)."""
    fence: bool
    """Commit each new payment with its idempotency row (the fence)."""
    backend: str = "auto"
    """Where idem runs (``BACKEND``): ``auto`` (the module where it is
    loaded, else the Functions library, else scripts), ``module``,
    ``functions`` or ``scripts``."""
    tokens: Mapping[str, str] = field(default_factory=lambda: parse_tokens(DEMO_TOKENS))
    """``API_TOKENS="tok_a=acct_1,tok_b=acct_2"``: the bearer tokens callers
    authenticate with and the account each maps to (default: ``DEMO_TOKENS``)."""

    @staticmethod
    def from_env(env: Mapping[str, str]) -> Settings:
        return Settings.from_lookup(env.get)

    @staticmethod
    def from_lookup(get: Lookup) -> Settings:
        redis_url = get("REDIS_URL") or "redis://127.0.0.1:6390/"
        database_url = get("DATABASE_URL")
        if database_url is None:
            raise SettingsError("DATABASE_URL is not set")
        port = _number(get, "PORT", "is not a port", 8080, 0, 65535)
        read_through = _switch(get, "READ_THROUGH")
        fence = _switch(get, "FENCE")
        wait_ms = _millis(get, "WAIT_MS")
        lease_ms = _millis(get, "LEASE_MS")
        pool_size = _number(get, "PG_POOL_SIZE", "is not a pool size", 16, 1, 2**64 - 1)
        delay_ms = _millis(get, "PROCESSOR_DELAY_MS")
        backend = get("BACKEND") or "auto"
        if backend not in BACKENDS:
            raise SettingsError(f"BACKEND={_quoted(backend)}: use {', '.join(BACKENDS)}")
        table = get("API_TOKENS")
        tokens = parse_tokens(DEMO_TOKENS if table is None else table)
        return Settings(
            tokens=tokens,
            redis_url=redis_url,
            database_url=database_url,
            port=port,
            read_through=read_through,
            wait=wait_ms / 1000 if wait_ms else None,
            lease=(30_000 if lease_ms is None else lease_ms) / 1000,
            pool_size=pool_size,
            processor_delay=(delay_ms or 0) / 1000,
            fence=fence,
            backend=backend,
        )


def parse_tokens(table: str) -> dict[str, str]:
    """``token=account`` pairs separated by commas (spaces around either
    dropped); an empty token or account, a token given twice, or no pair at
    all is refused."""
    tokens: dict[str, str] = {}
    for pair in (p.strip() for p in table.split(",")):
        if not pair:
            continue
        token, eq, account = pair.partition("=")
        if not eq:
            raise SettingsError(f"API_TOKENS: {_quoted(pair)} is not token=account")
        token, account = token.strip(), account.strip()
        if not token or not account:
            raise SettingsError(f"API_TOKENS: {_quoted(pair)} has an empty token or account")
        if token in tokens:
            raise SettingsError("API_TOKENS: a token is given twice")
        tokens[token] = account
    if not tokens:
        raise SettingsError("API_TOKENS has no token=account pair")
    return tokens


def _switch(get: Lookup, name: str) -> bool:
    """An on/off setting, on when unset."""
    value = get(name)
    if value is None or value in ("1", "true", "on"):
        return True
    if value in ("0", "false", "off"):
        return False
    raise SettingsError(f"{name}={_quoted(value)}: use on or off")


def _unsigned(value: str) -> int | None:
    """Rust's ``str::parse`` of an unsigned integer: ASCII digits, one leading
    ``+`` allowed, nothing else."""
    digits = value[1:] if value.startswith("+") else value
    if not digits or not all("0" <= c <= "9" for c in digits):
        return None
    return int(digits)


def _number(get: Lookup, name: str, what: str, default: int, low: int, high: int) -> int:
    value = get(name)
    if value is None:
        return default
    parsed = _unsigned(value)
    if parsed is None or not low <= parsed <= high:
        raise SettingsError(f"{name}={_quoted(value)} {what}")
    return parsed


def _millis(get: Lookup, name: str) -> int | None:
    value = get(name)
    if value is None:
        return None
    parsed = _unsigned(value)
    if parsed is None or parsed >= 2**64:
        raise SettingsError(f"{name}={_quoted(value)} is not a number of milliseconds")
    return parsed


def _quoted(value: str) -> str:
    """The value quoted as the Rust service's messages quote it (``{:?}``)."""
    return json.dumps(value, ensure_ascii=False)
