"""RFC 8785 JSON Canonicalization Scheme (JCS) as idem applies it to request
bodies, byte for byte what the Rust client's ``canonical_json`` produces
(held to spec/vectors/canonical_json.json and the RFC 8785 corpus in
spec/vectors/rfc8785.json):

- the body must be RFC 8259 JSON in UTF-8 (no BOM, no NaN or Infinity, no
  unpaired surrogates, no number beyond a double's range, at most 127 levels
  of nesting), else it is not JSON and ``canonicalize`` answers ``None``
  (callers then take the raw bytes);
- numbers are IEEE-754 doubles written as ECMAScript writes them
  (integers beyond 2^53 collapse as in JavaScript);
- a repeated member name keeps its last value;
- members are sorted by their names' UTF-16 code units, strings carry the
  minimal escapes, and nothing is added between tokens.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 127
"""Deepest nesting of arrays and objects accepted (as the Rust parser)."""


class _NotJson(Exception):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotJson(name)


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotJson("number out of range")
    return value


_DECODER = json.JSONDecoder(
    parse_float=_parse_float, parse_int=_parse_float, parse_constant=_refuse_constant
)


def canonicalize(data: bytes) -> bytes | None:
    """The canonical form of a JSON document, or ``None`` when it is not JSON."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if text.startswith("\ufeff"):
        return None
    try:
        value = _DECODER.decode(text)
    except (ValueError, _NotJson, RecursionError):
        return None
    out: list[str] = []
    try:
        _write(value, out, 0)
        return "".join(out).encode("utf-8")
    except (_NotJson, UnicodeEncodeError):
        return None


def _write(value: Any, out: list[str], depth: int) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, float):
        out.append(format_double(value))
    elif isinstance(value, str):
        _write_string(value, out)
    elif isinstance(value, list):
        if depth >= MAX_DEPTH:
            raise _NotJson("too deep")
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out, depth + 1)
        out.append("]")
    elif isinstance(value, dict):
        if depth >= MAX_DEPTH:
            raise _NotJson("too deep")
        out.append("{")
        for i, name in enumerate(sorted(value, key=_utf16_units)):
            if i:
                out.append(",")
            _write_string(name, out)
            out.append(":")
            _write(value[name], out, depth + 1)
        out.append("}")
    else:  # pragma: no cover - json.loads makes nothing else
        raise _NotJson(type(value).__name__)


def _utf16_units(name: str) -> bytes:
    # Big-endian UTF-16 compares bytewise as its code units do; an unpaired
    # surrogate cannot be encoded (and is not JSON for idem).
    try:
        return name.encode("utf-16-be")
    except UnicodeEncodeError:
        raise _NotJson("unpaired surrogate") from None


_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _write_string(s: str, out: list[str]) -> None:
    out.append('"')
    start = 0
    for i, ch in enumerate(s):
        if ch in _ESCAPES or ch < " ":
            out.append(s[start:i])
            out.append(_ESCAPES.get(ch) or f"\\u{ord(ch):04x}")
            start = i + 1
        elif "\ud800" <= ch <= "\udfff":
            raise _NotJson("unpaired surrogate")
    out.append(s[start:])
    out.append('"')


def format_double(value: float) -> str:
    """ECMAScript ``Number.prototype.toString`` of a finite double (RFC 8785
    section 3.2.2.3): shortest round-trip digits in ECMAScript's layout."""
    if value == 0:
        return "0"
    if not math.isfinite(value):
        raise ValueError(f"JSON cannot carry {value!r}")
    sign = "-" if value < 0 else ""
    digits, n = _shortest_digits(abs(value))
    k = len(digits)
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = f"{digits[:n]}.{digits[n:]}"
    elif -6 < n <= 0:
        body = "0." + "0" * -n + digits
    else:
        e = n - 1
        mantissa = digits[0] + ("." + digits[1:] if k > 1 else "")
        body = f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + body


def _shortest_digits(value: float) -> tuple[str, int]:
    """Digits d1..dk (no leading or trailing zeros) and n with
    value = 0.d1..dk x 10^n, from Python's shortest round-trip repr."""
    mantissa, _, exp = repr(value).partition("e")
    whole, _, frac = mantissa.partition(".")
    all_digits = whole + frac
    point = len(whole) + (int(exp) if exp else 0)
    stripped = all_digits.lstrip("0")
    point -= len(all_digits) - len(stripped)
    return stripped.rstrip("0"), point
