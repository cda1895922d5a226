"""The repository's spec/ data files, which this package reads instead of
copying their facts: shipped in the wheel as ``idem/_spec/``; in a source
checkout (an editable install) read from the repository's ``spec/``."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, cast


def _read(name: str) -> str:
    shipped = resources.files("idem").joinpath("_spec").joinpath(name)
    if shipped.is_file():
        return shipped.read_text(encoding="utf-8")
    checkout = Path(__file__).resolve().parents[4] / "spec" / name
    return checkout.read_text(encoding="utf-8")


@cache
def load(name: str) -> dict[str, Any]:
    """One spec file, parsed (``errors.json``, ``http.json``)."""
    return cast(dict[str, Any], json.loads(_read(name)))


def errors() -> dict[str, Any]:
    return load("errors.json")


def http() -> dict[str, Any]:
    return load("http.json")
