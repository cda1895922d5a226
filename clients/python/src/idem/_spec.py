"""The repository's spec/ data files, which this package reads instead of
copying their facts: shipped in the wheel as ``idem/_spec/``; in a source
checkout (an editable install) read from the repository's ``spec/``. The
Functions library's source (the repository's ``functions/idem.lua``) is
shipped the same way, as ``idem/_spec/functions/idem.lua``."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, cast


def _read(name: str, directory: str = "spec") -> str:
    shipped = resources.files("idem").joinpath("_spec")
    if directory != "spec":
        shipped = shipped.joinpath(directory)
    shipped = shipped.joinpath(name)
    if shipped.is_file():
        return shipped.read_text(encoding="utf-8")
    checkout = Path(__file__).resolve().parents[4] / directory / name
    return checkout.read_text(encoding="utf-8")


@cache
def load(name: str) -> dict[str, Any]:
    """One spec file, parsed (``errors.json``, ``http.json``)."""
    return cast(dict[str, Any], json.loads(_read(name)))


def errors() -> dict[str, Any]:
    return load("errors.json")


def http() -> dict[str, Any]:
    return load("http.json")


def functions() -> dict[str, Any]:
    """The Functions library's calling contract (``functions.json``)."""
    return load("functions.json")


def outbox_slots() -> dict[str, Any]:
    """The mirror outbox of each hash slot (``outbox_slots.json``)."""
    return load("outbox_slots.json")


@cache
def library_source() -> str:
    """The Functions library's source, ``functions/idem.lua`` (the file
    ``functions.json`` names), exactly as shipped."""
    path = Path(functions()["source"])
    try:
        return _read(path.name, str(path.parent))
    except OSError as err:
        raise RuntimeError(
            f"idem: the Functions library ({path}) is not in this package: "
            "it was built from a checkout without it"
        ) from err
