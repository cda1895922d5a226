#!/usr/bin/env python3
"""Prints the slowest tests of a cargo nextest run and each test binary's
total, from nextest's JUnit report: slowest.py JUNIT_XML [COUNT]."""

import sys
import xml.etree.ElementTree as ET


def main() -> int:
    path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"slowest.py: no report ({e})", file=sys.stderr)
        return 1
    tests, binaries = [], {}
    for suite in root.iter("testsuite"):
        binary = suite.get("name", "?")
        for case in suite.iter("testcase"):
            seconds = float(case.get("time", "0"))
            tests.append((seconds, f"{binary} {case.get('name', '?')}"))
            n, total = binaries.get(binary, (0, 0.0))
            binaries[binary] = (n + 1, total + seconds)
    print(f"==> the {count} slowest tests (s)")
    for seconds, name in sorted(tests, reverse=True)[:count]:
        print(f"    {seconds:7.1f}  {name}")
    print("==> test binaries: tests, their summed time (s)")
    for binary, (n, total) in sorted(binaries.items(), key=lambda b: -b[1][1]):
        print(f"    {total:7.1f}  {n:4d}  {binary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
