"""Summarises a ``node --cpu-prof`` profile (the driver's ``--node-prof``):
self time by file group (idem-client, express, @redis/client, node: core,
...) and the heaviest functions, self and inclusive, as percentages of the
samples outside the idle and GC nodes' share (printed too).
Usage: python cpuprofile.py FILE.cpuprofile [--top 25] [--grep idem-client]"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict


def group(url: str) -> str:
    if not url:
        return "(native / vm)"
    if url.startswith("node:"):
        return "node: core"
    m = re.search(r"node_modules/((?:@[^/]+/)?[^/]+)", url)
    if m:
        return m.group(1)
    if "clients/node" in url:
        return "idem-client"
    return url.rsplit("/", 1)[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--grep", default="")
    opts = ap.parse_args()
    prof = json.load(open(opts.file))
    nodes = {n["id"]: n for n in prof["nodes"]}
    parent = {c: n["id"] for n in prof["nodes"] for c in n.get("children", [])}
    deltas = prof["timeDeltas"]
    self_us: Counter[int] = Counter()
    for sample, dt in zip(prof["samples"], deltas[1:] + [0], strict=True):
        self_us[sample] += dt
    special = {"(idle)", "(program)", "(garbage collector)", "(root)"}
    total = sum(self_us.values())
    idle = sum(v for k, v in self_us.items() if nodes[k]["callFrame"]["functionName"] == "(idle)")
    busy = total - idle
    print(f"samples {len(prof['samples'])}, {total / 1e6:.2f} s profiled, {idle / 1e6:.2f} s idle; "
          f"shares below are of the {busy / 1e6:.2f} s busy")
    by_group: Counter[str] = Counter()
    by_fn: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    for node_id, us in self_us.items():
        cf = nodes[node_id]["callFrame"]
        name = cf["functionName"] or "(anonymous)"
        if name == "(idle)":
            continue
        g = "(vm)" if name in special else group(cf["url"])
        by_group[g] += us
        label = f"{name} {g}:{cf['url'].rsplit('/', 1)[-1]}:{cf['lineNumber'] + 1}"
        by_fn[label] += us
        seen = set()
        n = node_id
        while n is not None:
            c = nodes[n]["callFrame"]
            lab = f"{c['functionName'] or '(anonymous)'} {group(c['url'])}:{c['url'].rsplit('/', 1)[-1]}:{c['lineNumber'] + 1}"
            if lab not in seen:
                incl[lab] += us
                seen.add(lab)
            n = parent.get(n)
    print("\nself time by package:")
    for g, us in by_group.most_common():
        print(f"  {100 * us / busy:5.1f}%  {g}")
    print(f"\nheaviest functions, self:")
    for f, us in by_fn.most_common(opts.top):
        if opts.grep in f:
            print(f"  {100 * us / busy:5.1f}%  {f}")
    print(f"\nheaviest functions, inclusive{f' (matching {opts.grep})' if opts.grep else ''}:")
    shown = 0
    for f, us in incl.most_common():
        if opts.grep in f and not f.startswith("(root)"):
            print(f"  {100 * us / busy:5.1f}%  {f}")
            shown += 1
            if shown >= opts.top:
                break


if __name__ == "__main__":
    main()
