#!/usr/bin/env python3
"""Fails when the files of a crate's src/ import each other in a circle.

A file's imports are the `crate::a::b` and `super::x` paths it names in `use`
lines (or inline); each resolves to the file that defines that module. Usage:
import_cycles.py SRC_DIR [SRC_DIR...]
"""
import re
import sys
from pathlib import Path


def module_of(src: Path, f: Path) -> tuple:
    rel = f.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("lib", "main", "mod"):
        parts = parts[:-1]
    return tuple(parts)


def resolve(mods: dict, path: tuple):
    """The longest module prefix of `path` that is a file of the crate."""
    for n in range(len(path), 0, -1):
        if path[:n] in mods:
            return path[:n]
    return None


def graph(src: Path) -> dict:
    files = [f for f in src.rglob("*.rs")]
    mods = {module_of(src, f): f for f in files}
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        text = f.read_text()
        text = re.sub(r"//[^\n]*", "", text)
        # Test modules may use their parent; they are not part of the graph.
        text = re.split(r"#\[cfg\(test\)\]", text)[0]
        here = m if f.stem in ("lib", "main", "mod") else m[:-1]
        for group in re.findall(r"\b(crate|super)((?:::\{[^;]*?\}|::\w+)+)", text):
            root, rest = group
            base = () if root == "crate" else here[:-1] if f.stem in ("mod",) else here
            if root == "super" and f.stem == "mod":
                base = m[:-1]
            if root == "super" and f.stem not in ("mod",):
                base = m[:-1]
            names = re.findall(r"\w+|\{[^}]*\}", rest.replace("::", " "))
            prefix = list(base)
            for n in names:
                if n.startswith("{"):
                    for inner in re.findall(r"\w+", n):
                        t = resolve(mods, tuple(prefix + [inner]))
                        if t is not None and t != m:
                            edges[m].add(t)
                    break
                prefix.append(n)
            else:
                t = resolve(mods, tuple(prefix))
                if t is not None and t != m and t != ():
                    edges[m].add(t)
    # A parent module declaring its children is not an import.
    for m in edges:
        edges[m] = {t for t in edges[m] if t[: len(m)] != m or m == ()}
        edges[m].discard(())
    return edges


def cycles(edges: dict):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in edges:
        if v not in index:
            strong(v)
    return out


def main() -> int:
    bad = 0
    for arg in sys.argv[1:]:
        src = Path(arg)
        for comp in cycles(graph(src)):
            names = sorted("::".join(c) or "lib" for c in comp)
            print(f"{src}: import circle: {' <-> '.join(names)}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
