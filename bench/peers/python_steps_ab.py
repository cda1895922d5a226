"""The Python middleware's pure per-request steps (the key header parsed,
the Redis key, the fingerprint with canonical JSON of a 14-byte and a
600-byte body), the package at REV against this tree's, in ONE process:
REV's package is exported (with spec/) and imported as ``idem_old``, and
the two are timed in alternation, 41 times each; medians and the median of
the per-pair ratios (steadier on a shared machine than separate runs).
Usage: python bench/peers/python_steps_ab.py REV (the peers venv's python;
run from the repository; taskset -c 0 to keep it on one core)."""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from python_micro import HEADERS, LARGE, SMALL  # noqa: E402


def export(rev: str, into: Path) -> None:
    tar = subprocess.run(
        ["git", "archive", rev, "clients/python/src", "spec"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    src = into / "clients/python/src"
    (src / "idem").rename(src / "idem_old")
    for f in (src / "idem_old").glob("*.py"):
        text = f.read_text().replace("from idem.", "from idem_old.").replace("from idem import", "from idem_old import")
        f.write_text(text.replace("import idem.", "import idem_old."))
    sys.path.append(str(src))


def run(f: Any, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    rev = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="idem-steps-ab-") as d:
        export(rev, Path(d))
        import idem.fingerprint as fn
        import idem.keys as kn
        import idem_old.fingerprint as fo  # type: ignore[import-not-found]
        import idem_old.keys as ko  # type: ignore[import-not-found]

        f_old, f_new = fo.Fingerprinter(canonical_json=True), fn.Fingerprinter(canonical_json=True)
        pairs = {
            "parse_key": (lambda k: k.parse_key([b"n1234-0-5678"]), ko, kn),
            "redis_key": (lambda k: k.redis_key("idem:", "", "n1234-0-5678"), ko, kn),
            "fingerprint 14 B": (lambda f: f.fingerprint("POST", b"/p", HEADERS, SMALL), f_old, f_new),
            "fingerprint 600 B": (lambda f: f.fingerprint("POST", b"/p", HEADERS, LARGE), f_old, f_new),
        }
        out = {}
        for name, (call, old, new) in pairs.items():
            assert call(old) == call(new), name
            n = 200 if "600" in name else 1000
            before, after, ratio = [], [], []
            for _ in range(41):
                a, b = run(lambda: call(old), n), run(lambda: call(new), n)
                before.append(a)
                after.append(b)
                ratio.append(b / a)
            out[name] = {
                f"{rev} µs": round(statistics.median(before), 2),
                "this tree µs": round(statistics.median(after), 2),
                "ratio": round(statistics.median(ratio), 2),
            }
        print(json.dumps(out, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
