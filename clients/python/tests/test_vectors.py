"""The shared vectors in spec/vectors/ (the same files the Rust crate's
tests/spec_vectors.rs holds the Rust implementation to)."""

from __future__ import annotations

import json
import struct
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from redis._parsers.base import BaseParser

import idem
from idem import errors, wire
from idem.canonical_json import canonicalize, format_double
from idem.keys import InvalidKeyError, parse_key, redis_key, tenant_of_lines
from idem.types import InFlight, Mismatch, New, Record, Replay, StoredResponse

SPEC = Path(__file__).resolve().parents[3] / "spec"


def load(name: str) -> dict[str, Any]:
    return json.loads((SPEC / name).read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def b(v: Any) -> bytes:
    """Bytes as the spec writes them: a string (its UTF-8) or {"hex": ...}."""
    return v.encode() if isinstance(v, str) else bytes.fromhex(v["hex"])


def cases(file: str, field: str = "cases") -> list[Any]:
    doc = load(file)
    return [pytest.param(c, id=c.get("name", str(i))) for i, c in enumerate(doc[field])]


def test_every_vector_file_is_read_here() -> None:
    read = {
        "fingerprint.json", "canonical_json.json", "rfc8785.json", "keys.json",
        "downstream_key.json", "replies.json", "commands.json",
    }  # fmt: skip
    assert {p.name for p in (SPEC / "vectors").glob("*.json")} == read


@pytest.mark.parametrize("case", cases("vectors/fingerprint.json"))
def test_fingerprint(case: dict[str, Any]) -> None:
    cfg, req, expected = case["fingerprinter"], case["request"], case["expected"]
    fingerprinter = idem.Fingerprinter(headers=cfg["headers"], canonical_json=cfg["canonical_json"])
    headers = [(n.encode(), b(v)) for n, v in req["headers"]]
    fp = fingerprinter.fingerprint(req["method"], req["target"], headers, b(req["body"]))
    assert fp.hex() == expected["fingerprint"]
    assert fp.stored_hex == expected["stored_hex"] == idem.stored_hex(fp)
    if expected["body"] == "canonical":
        assert canonicalize(b(req["body"])) == b(expected["canonical_body"])


@pytest.mark.parametrize("case", cases("vectors/canonical_json.json"))
def test_canonical_json(case: dict[str, Any]) -> None:
    out = canonicalize(b(case["input"]))
    expected = case["expected"]
    assert out == (None if expected is None else expected.encode())


@pytest.mark.parametrize("case", cases("vectors/rfc8785.json"))
def test_rfc8785_corpus(case: dict[str, Any]) -> None:
    assert canonicalize(b(case["input"])) == case["expected"].encode()


@pytest.mark.parametrize("case", cases("vectors/rfc8785.json", "numbers"))
def test_rfc8785_numbers(case: dict[str, Any]) -> None:
    (value,) = struct.unpack(">d", bytes.fromhex(case["ieee_hex"]))
    if case["expected"] is None:
        with pytest.raises(ValueError, match="JSON cannot carry"):
            format_double(value)
    else:
        assert format_double(value) == case["expected"]


@pytest.mark.parametrize("case", cases("vectors/keys.json", "header"))
def test_key_header(case: dict[str, Any]) -> None:
    lines = [b(line) for line in case["lines"]]
    expected = case["expected"]
    if "error" in expected:
        with pytest.raises(InvalidKeyError) as err:
            parse_key(lines)
        assert err.value.kind == expected["error"]
        assert err.value.detail == load("http.json")["key_errors"][expected["error"]]
    elif expected.get("absent"):
        assert parse_key(lines) is None
    else:
        assert parse_key(lines) == expected["key"]


@pytest.mark.parametrize("case", cases("vectors/keys.json", "tenant"))
def test_tenant(case: dict[str, Any]) -> None:
    assert tenant_of_lines([b(line) for line in case["lines"]]) == case["expected"]


@pytest.mark.parametrize("case", cases("vectors/keys.json", "redis_key"))
def test_redis_key(case: dict[str, Any]) -> None:
    assert redis_key(case["prefix"], case["tenant"], case["key"]) == case["expected"]


def test_max_key_bytes() -> None:
    assert load("vectors/keys.json")["max_key_bytes"] == idem.keys.MAX_KEY_BYTES


def test_max_tenant_bytes() -> None:
    assert load("vectors/keys.json")["max_tenant_bytes"] == idem.keys.MAX_TENANT_BYTES
    assert load("http.json")["defaults"]["max_tenant_bytes"] == idem.keys.MAX_TENANT_BYTES


@pytest.mark.parametrize("case", cases("vectors/keys.json", "tenant_check"))
def test_tenant_check(case: dict[str, Any]) -> None:
    if "lines" in case:
        tenant = tenant_of_lines([b(line) for line in case["lines"]])
    else:
        tenant = case["value"]
    expected = case["expected"]
    if "error" in expected:
        with pytest.raises(idem.InvalidTenantError) as err:
            idem.check_tenant(tenant)
        assert err.value.problem == expected["error"]
    else:
        assert idem.check_tenant(tenant) == expected["tenant"]


@pytest.mark.parametrize("case", cases("vectors/downstream_key.json"))
def test_downstream_key(case: dict[str, Any]) -> None:
    assert idem.downstream_key(case["key"], b(case["fingerprint"])) == case["expected"]


# ---------------------------------------------------------------- replies


def frame(v: dict[str, Any]) -> Any:
    """A frame as redis-py hands it over (bytes, int, list, None)."""
    (kind, value), = v.items()  # fmt: skip
    if kind == "array":
        return [frame(item) for item in value]
    if kind == "bulk":
        return b(value)
    if kind == "simple":
        return value.encode()
    if kind == "int":
        return value
    assert kind == "null"
    return None


def stored(v: dict[str, Any]) -> StoredResponse:
    return StoredResponse(v["status"], b(v["body"]), tuple((n, b(x)) for n, x in v["headers"]))


def outcome(v: dict[str, Any]) -> idem.Outcome:
    if "new" in v:
        return New(v["new"]["token"])
    if "in_flight" in v:
        return InFlight(v["in_flight"]["retry_after_ms"])
    if "replay" in v:
        return Replay(stored(v["replay"]))
    assert "mismatch" in v
    return Mismatch()


@pytest.mark.parametrize("case", cases("vectors/replies.json", "begin"))
def test_begin_reply(case: dict[str, Any]) -> None:
    expected = outcome(case["outcome"])
    assert wire.parse_begin(frame(case["fields"])) == expected
    assert wire.parse_begin(frame(case["packed"])) == expected


@pytest.mark.parametrize("case", cases("vectors/replies.json", "begin_equivalent"))
def test_begin_reply_equivalent(case: dict[str, Any]) -> None:
    assert wire.parse_begin(frame(case["reply"])) == outcome(case["outcome"])


@pytest.mark.parametrize("case", cases("vectors/replies.json", "begin_invalid"))
def test_begin_reply_invalid(case: dict[str, Any]) -> None:
    with pytest.raises(errors.UnexpectedReplyError):
        wire.parse_begin(frame(case["reply"]))


def record(v: dict[str, Any]) -> Record:
    if v["state"] == "in_progress":
        return Record("in_progress", v["fingerprint_hex"], v["token"], v["created_at"],
                      v["expires_at"], lease_until=v["lease_until"])  # fmt: skip
    return Record(
        "completed", v["fingerprint_hex"], v["token"], v["created_at"], v["expires_at"],
        response=stored(v), completed_at=v["completed_at"], mirror=v["mirror"],
    )  # fmt: skip


@pytest.mark.parametrize("case", cases("vectors/replies.json", "get"))
def test_get_reply(case: dict[str, Any]) -> None:
    expected = None if case["record"] is None else record(case["record"])
    assert wire.parse_record(frame(case["reply"])) == expected


@pytest.mark.parametrize("case", cases("vectors/replies.json", "pull"))
def test_pull_reply(case: dict[str, Any]) -> None:
    expected = [
        idem.PulledRecord(b(r["key"]), r["token"], r["fingerprint_hex"], stored(r),
                          r["created_at"], r["completed_at"], r["expires_at"])
        for r in case["records"]
    ]  # fmt: skip
    assert wire.parse_pull(frame(case["reply"])) == expected


def test_small_replies() -> None:
    doc = load("vectors/replies.json")
    assert wire.parse_ok(frame(doc["complete"]["reply"])) is None
    for case in doc["abort"]:
        assert wire.parse_abort(frame(case["reply"])) is case["released"]
    for case in doc["touch"]:
        assert wire.parse_touch(frame(case["reply"])) == case["remaining_ms"]
    with pytest.raises(errors.UnexpectedReplyError):
        wire.parse_abort(b"OK")
    with pytest.raises(errors.UnexpectedReplyError):
        wire.parse_touch(-1)


# ---------------------------------------------------------------- commands


@pytest.mark.parametrize("case", cases("vectors/commands.json", "ttl_secs"))
def test_ttl_rounding(case: dict[str, Any]) -> None:
    us = case["us"]
    assert wire.ttl_secs(timedelta(microseconds=us)) == case["secs"]
    assert wire.ttl_secs(us / 1_000_000) == case["secs"]


@pytest.mark.parametrize("case", cases("vectors/commands.json", "client_ms"))
def test_ms_rounding(case: dict[str, Any]) -> None:
    us = case["us"]
    assert wire.client_ms(timedelta(microseconds=us)) == case["ms"]
    assert wire.client_ms(us / 1_000_000) == case["ms"]


def args(v: list[Any]) -> list[bytes]:
    return [b(a) for a in v]


@pytest.mark.parametrize("case", cases("vectors/commands.json", "begin"))
def test_begin_command(case: dict[str, Any]) -> None:
    lease = None if case["lease_ms"] is None else case["lease_ms"] / 1000
    wait = None if case["wait_ms"] is None else case["wait_ms"] / 1000
    got = wire.begin_args(
        b(case["key"]), b(case["fingerprint"]), case["ttl_secs"],
        lease=lease, wait=wait, packed=case["packed"],
    )  # fmt: skip
    assert got == args(case["args"])


@pytest.mark.parametrize("case", cases("vectors/commands.json", "complete"))
def test_complete_command(case: dict[str, Any]) -> None:
    response = StoredResponse(
        case["status"], b(case["body"]), tuple((n, b(v)) for n, v in case["headers"])
    )
    got = wire.complete_args(b(case["key"]), case["token"], response, mirrored=case["mirrored"])
    assert got == args(case["args"])


def test_other_commands() -> None:
    doc = load("vectors/commands.json")
    for c in doc["abort"]:
        assert wire.abort_args(b(c["key"]), c["token"]) == args(c["args"])
    for c in doc["touch"]:
        assert wire.touch_args(b(c["key"]), c["token"], c["lease_ms"] / 1000) == args(c["args"])
    for c in doc["get"]:
        assert wire.get_args(b(c["key"])) == args(c["args"])


# ---------------------------------------------------------------- errors


def redis_py_error(text: str) -> Exception:
    """What redis-py raises for the error reply ``-text``."""
    return BaseParser.parse_error(text)  # type: ignore[no-any-return]


def test_every_module_code_has_its_class() -> None:
    spec = load("errors.json")
    assert [c["code"] for c in spec["module_codes"]] == list(errors.MODULE_ERRORS)
    for entry in spec["module_codes"]:
        err = errors.from_redis(redis_py_error(f"{entry['code']} some detail"))
        assert type(err).__name__ == entry["name"] + "Error"
        assert err.code == entry["code"]
        assert err.detail == "some detail"
        assert isinstance(err, errors.ModuleError)
        assert err.is_transient == (entry["code"] in spec["transient_codes"])
        assert not err.is_unavailable
        assert getattr(idem, type(err).__name__) is type(err)


def test_redis_errors_are_classified_as_the_spec_says() -> None:
    spec = load("errors.json")
    for code in spec["unavailable_codes"]:
        err = errors.from_redis(redis_py_error(f"{code} not now"))
        assert isinstance(err, errors.UnavailableError), code
        assert err.is_unreachable and err.is_unavailable and err.is_transient
    for code in spec["writes_refused_codes"]:
        err = errors.from_redis(redis_py_error(f"{code} not now"))
        assert isinstance(err, errors.WritesRefusedError), code
        assert err.is_unavailable and not err.is_unreachable and err.is_transient
    for code in spec["configuration_codes"]:
        err = errors.from_redis(redis_py_error(f"{code} refused"))
        assert isinstance(err, errors.OtherRedisError), code
        assert not err.is_transient
    other = errors.from_redis(redis_py_error("ERR unknown command"))
    assert isinstance(other, errors.OtherRedisError) and not other.is_unavailable
    assert isinstance(errors.from_redis(ConnectionRefusedError()), errors.UnavailableError)
    refusal = errors.from_redis(redis_py_error("BADARG " + spec["packed_refused_detail"]))
    assert wire.refuses_packed(refusal)
    assert not wire.refuses_packed(errors.from_redis(redis_py_error("BADARG unknown option 'X'")))


def test_read_through_sql_comes_from_the_spec() -> None:
    spec = load("read_through.json")
    assert spec["lookup_sql"].replace("$1", "%s") == idem.read_through.LOOKUP_SQL
    assert spec["timeout_ms"] / 1000 == idem.read_through.DEFAULT_TIMEOUT


def test_the_installed_package_ships_the_repositorys_spec() -> None:
    from importlib import resources

    shipped = resources.files("idem").joinpath("_spec")
    if not shipped.joinpath("errors.json").is_file():
        pytest.skip("an editable install reads the repository's spec/ directly")
    for name in ("errors.json", "http.json", "read_through.json"):
        assert shipped.joinpath(name).read_bytes() == (SPEC / name).read_bytes(), name
