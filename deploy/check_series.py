#!/usr/bin/env python3
"""Checks deploy/: the Grafana dashboard is valid JSON of the expected shape,
and every PromQL query in it and in the Prometheus rules names only series
the code exports, the rules' own recordings, or Prometheus' `up`; and
every alert's `runbook` annotation points at a section of the runbook.

The exported series are read from the code's one list of names: the
`names` modules of crates/idem-client/src/middleware/metrics.rs and
crates/idem-writer/src/ops/metrics.rs (whose unit tests hold the registries to
them). Histograms (`*_duration_seconds`) also export `_bucket`, `_sum` and
`_count`. Run by scripts/test-ops.sh; exits 1 naming each problem.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
NAME_SOURCES = [
    ROOT / "crates/idem-client/src/middleware/metrics.rs",
    ROOT / "crates/idem-writer/src/ops/metrics.rs",
]
RULES = ROOT / "deploy/prometheus/idem-rules.yml"
DASHBOARD = ROOT / "deploy/grafana/idem.json"
RUNBOOK = ROOT / "docs/operations/runbook.md"
PROMETHEUS_OWN = {"up"}
KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
}


def exported() -> set[str]:
    names: set[str] = set()
    for source in NAME_SOURCES:
        found = re.findall(r'pub const \w+: &str = "(idem_\w+)";', source.read_text())
        if not found:
            sys.exit(f"no metric names found in {source}")
        names.update(found)
    for name in list(names):
        if name.endswith("_duration_seconds"):
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def series_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr
    )
    names = set()
    for match in re.finditer(r"(?<![\w.])[a-zA-Z_:][\w:]*", expr):
        rest = expr[match.end():].lstrip()
        if rest.startswith("("):
            continue  # a function or an aggregation
        if match.group().lower() in KEYWORDS:
            continue
        names.add(match.group())
    return names


def dashboard_queries(problems: list[str]) -> list[tuple[str, str]]:
    try:
        dashboard = json.loads(DASHBOARD.read_text())
    except json.JSONDecodeError as err:
        problems.append(f"{DASHBOARD}: not valid JSON: {err}")
        return []
    for key in ("title", "uid", "panels", "schemaVersion", "templating"):
        if key not in dashboard:
            problems.append(f"{DASHBOARD}: no {key!r}")
    queries = []
    ids = set()
    for panel in dashboard.get("panels", []):
        title = panel.get("title", "?")
        if panel.get("id") in ids:
            problems.append(f"dashboard panel {title!r}: duplicate id {panel.get('id')}")
        ids.add(panel.get("id"))
        if "gridPos" not in panel or "type" not in panel:
            problems.append(f"dashboard panel {title!r}: no gridPos or type")
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"dashboard panel {title!r}: no queries")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            problems.append(f"dashboard panel {title!r}: refIds missing or repeated")
        for target in targets:
            if not target.get("expr"):
                problems.append(f"dashboard panel {title!r}: a query without expr")
                continue
            queries.append((f"dashboard panel {title!r}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("definition")
        if query:
            inner = re.fullmatch(r"label_values\((\w+)\s*,\s*\w+\)", query)
            if inner:
                queries.append((f"dashboard variable {variable['name']!r}", inner.group(1)))
            else:
                queries.append((f"dashboard variable {variable['name']!r}", query))
    return queries


def heading_ids(markdown: str) -> set[str]:
    """The ids mdBook gives the headings: lowercase, spaces as dashes."""
    ids = set()
    for line in markdown.splitlines():
        match = re.match(r"#+\s+(.*)", line)
        if match:
            text = re.sub(r"[^\w\s-]", "", match.group(1)).strip().lower()
            ids.add(re.sub(r"\s", "-", text))
    return ids


def main() -> int:
    problems: list[str] = []
    known = exported()
    rules = yaml.safe_load(RULES.read_text())
    sections = heading_ids(RUNBOOK.read_text())
    queries: list[tuple[str, str]] = []
    recorded = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                recorded.add(rule["record"])
            queries.append((f"rule {rule.get('record') or rule.get('alert')}", rule["expr"]))
            if "alert" in rule:
                runbook = rule.get("annotations", {}).get("runbook", "")
                page, _, anchor = runbook.partition("#")
                if page != "docs/operations/runbook.md" or anchor not in sections:
                    problems.append(f"alert {rule['alert']}: runbook {runbook!r} is no runbook section")
    queries += dashboard_queries(problems)
    allowed = known | recorded | PROMETHEUS_OWN
    used = set()
    for where, expr in queries:
        names = series_in(expr)
        if not names:
            problems.append(f"{where}: names no series: {expr}")
        for name in sorted(names - allowed):
            problems.append(f"{where}: {name} is not exported by idem (nor recorded): {expr}")
        used |= names
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    unused = sorted(
        n for n in known - used if not re.search(r"(_sum|_count|_duration_seconds)$", n)
    )
    print(
        f"{len(queries)} queries over {len(used & known)} of {len(known)} exported series"
        f" and {len(recorded)} recordings: all known"
        + (f" (not queried: {', '.join(unused)})" if unused else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
