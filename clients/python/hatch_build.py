"""Ships the repository's spec/ data files (errors.json, http.json and what
later clients add) inside the wheel as idem/_spec/, so the package reads the
same facts the Rust crate is tested against. Built from the repository,
spec/ is two levels up; built from an sdist, the sdist carries it as _spec/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SHIPPED = ("errors.json", "http.json", "read_through.json", "fence.json")


class SpecHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        for candidate in (root.parent.parent / "spec", root / "_spec"):
            if all((candidate / name).is_file() for name in SHIPPED):
                spec = candidate
                break
        else:
            raise FileNotFoundError("spec/ (the repository's) or _spec/ (an sdist's) is missing")
        target = "idem/_spec" if self.target_name == "wheel" else "_spec"
        for path in sorted(spec.glob("*.json")) + sorted(spec.glob("*.sql")):
            build_data["force_include"][str(path)] = f"{target}/{path.name}"
