"""Ships the repository's spec/ data files (errors.json, http.json and what
later clients add) inside the wheel as idem/_spec/, so the package reads the
same facts the Rust crate is tested against, and the Functions library
(functions/idem.lua, the file spec/functions.json names) as
idem/_spec/functions/idem.lua, the source the client loads into a Redis
without the module. Built from the repository, spec/ and functions/ are two
levels up; built from an sdist, the sdist carries them as _spec/.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SHIPPED = ("errors.json", "http.json", "read_through.json", "fence.json", "functions.json")


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
        source = Path(json.loads((spec / "functions.json").read_text())["source"])
        for library in (root.parent.parent / source, spec / source):
            if library.is_file():
                build_data["force_include"][str(library)] = f"{target}/{source}"
                break
        else:
            # The client then refuses the library backends with a clear error.
            warnings.warn(f"{source} is missing: the package cannot load the library", stacklevel=1)
