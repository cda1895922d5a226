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
from json.encoder import encode_basestring
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
    # The common types first (strings, then numbers); json.loads makes
    # nothing else but None and the booleans.
    kind = type(value)
    if kind is str:
        out.append(_string(value))
    elif kind is float:
        out.append(format_double(value))
    elif kind is dict:
        if depth >= MAX_DEPTH:
            raise _NotJson("too deep")
        out.append("{")
        first = True
        for name in _sorted_names(value):
            if first:
                first = False
            else:
                out.append(",")
            out.append(_string(name))
            out.append(":")
            _write(value[name], out, depth + 1)
        out.append("}")
    elif kind is list:
        if depth >= MAX_DEPTH:
            raise _NotJson("too deep")
        out.append("[")
        first = True
        for item in value:
            if first:
                first = False
            else:
                out.append(",")
            _write(item, out, depth + 1)
        out.append("]")
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    else:  # pragma: no cover - json.loads makes nothing else
        raise _NotJson(type(value).__name__)


def _sorted_names(obj: dict[str, Any]) -> list[str]:
    """Member names in UTF-16 code-unit order. For names without surrogates
    below U+10000 that is code-point order, str's own; ASCII names (nearly
    all of them) take that path."""
    names = list(obj)
    if all(name.isascii() for name in names):
        names.sort()
        return names
    return sorted(names, key=_utf16_units)


def _utf16_units(name: str) -> bytes:
    # Big-endian UTF-16 compares bytewise as its code units do; an unpaired
    # surrogate cannot be encoded (and is not JSON for idem).
    try:
        return name.encode("utf-16-be")
    except UnicodeEncodeError:
        raise _NotJson("unpaired surrogate") from None


def _string(s: str) -> str:
    """A JSON string with the minimal escapes: the quote, the backslash, and
    the control characters below U+0020 (backspace, tab, newline, form feed
    and carriage return by their short forms, the rest as lowercase
    u00xx escapes). The json module's C encoder writes exactly these; an
    unpaired surrogate passes it, so it is refused here."""
    if not s.isascii() and _has_surrogate(s):
        raise _NotJson("unpaired surrogate")
    return encode_basestring(s)


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_EXACT = float(1 << 53)


def format_double(value: float) -> str:
    """ECMAScript ``Number.prototype.toString`` of a finite double (RFC 8785
    section 3.2.2.3): shortest round-trip digits in ECMAScript's layout."""
    if value == 0:
        return "0"
    if value.is_integer() and -_EXACT < value < _EXACT:
        # Every integer below 2^53 is a double of its own, so its shortest
        # round-trip digits are all of its digits: what ECMAScript writes.
        return str(int(value))
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
