#!/usr/bin/env python3
"""Generates the Python client's sync modules from their asyncio sources
(clients/python/src/idem/_*_async.py -> _*_sync.py), as psycopg 3 does: the
asyncio code is the one source, the sync twin is derived from it.

    scripts/gen-python-sync.py           # (re)writes the sync modules
    scripts/gen-python-sync.py --check   # regenerates in memory, diffs, fails on a difference

What the conversion does, on the source's syntax tree (positions from ``ast``,
edits on the text, so comments and layout stay):

- ``async def``/``async with``/``async for`` lose ``async``, ``await x``
  becomes ``x``;
- the names in ``NAMES`` (classes, methods, attributes, imported names) and
  the dotted names in ``DOTTED`` (``asyncio.sleep``) are renamed, the
  modules in ``MODULES`` imported under their sync names;
- ``if True:  # ASYNC`` keeps only its ``else:`` body (nothing without one):
  the places where the two twins really differ;

then ``ruff check --fix`` (imports sorted, unused ones dropped) and ``ruff
format`` with the package's settings. ruff is the one next to the running
Python, else on PATH (``--ruff`` names it).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clients" / "python"
SOURCES = PACKAGE / "src" / "idem"

PAIRS = [
    ("_client_async.py", "_client_sync.py"),
    ("_read_through_async.py", "_read_through_sync.py"),
    ("_fence_async.py", "_fence_sync.py"),
]

NAMES = {
    "AsyncConnection": "Connection",
    "AsyncConnectionPool": "ConnectionPool",
    "AsyncFence": "Fence",
    "AsyncRawCursor": "RawCursor",
    "AsyncReadThrough": "ReadThrough",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "aclose": "close",
    "aredis": "redis",
}

DOTTED = {
    "asyncio.Lock": "threading.Lock",
    "asyncio.sleep": "time.sleep",
}

MODULES = {
    "redis.asyncio": "redis",
    "redis.asyncio.retry": "redis.retry",
    **{f"idem.{a[:-3]}": f"idem.{s[:-3]}" for a, s in PAIRS},
}

ASYNC_MARK = re.compile(r"^\s*if True:\s*#\s*ASYNC\b")


class ConversionError(Exception):
    pass


def _async_blocks(tree: ast.AST, lines: list[str]) -> list[ast.If]:
    """The outermost ``if True:  # ASYNC`` statements."""
    found: list[ast.If] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If)
                and isinstance(child.test, ast.Constant)
                and child.test.value is True
                and ASYNC_MARK.match(lines[child.lineno - 1])
            ):
                found.append(child)
            else:
                visit(child)

    visit(tree)
    return found


def resolve_async_blocks(source: str) -> str:
    """Replaces each ``if True:  # ASYNC`` by its ``else:`` body, dedented."""
    lines = source.splitlines(keepends=True)
    blocks = _async_blocks(ast.parse(source), lines)
    for block in sorted(blocks, key=lambda b: b.lineno, reverse=True):
        assert block.end_lineno is not None
        start, end = block.lineno - 1, block.end_lineno
        kept: list[str] = []
        if block.orelse:
            if len(block.orelse) == 1 and isinstance(block.orelse[0], ast.If):
                head = lines[block.orelse[0].lineno - 1].lstrip()
                if head.startswith("elif"):
                    raise ConversionError(f"line {block.lineno}: no elif after # ASYNC")
            first = block.orelse[0].lineno - 1
            while not lines[first - 1].strip().startswith("else"):
                first -= 1  # comments between ``else:`` and the first statement
            body = lines[first:end]
            cut = block.orelse[0].col_offset - block.col_offset
            for line in body:
                if line.strip() and not line[:cut].isspace():
                    raise ConversionError(f"line {block.lineno}: odd indentation in else body")
                kept.append(line[cut:] if line.strip() else line)
        lines[start:end] = kept
    return "".join(lines)


class _Edits:
    """Byte-offset replacements on the source's lines (ast columns are UTF-8
    byte offsets)."""

    def __init__(self, source: str) -> None:
        self.lines = [line.encode() for line in source.splitlines(keepends=True)]
        self.edits: list[tuple[int, int, int, int, bytes]] = []

    def text(self, line: int, start: int, end: int) -> str:
        return self.lines[line - 1][start:end].decode()

    def replace(self, line: int, start: int, end: int, new: str, end_line: int = 0) -> None:
        self.edits.append((line, start, end_line or line, end, new.encode()))

    def apply(self) -> str:
        lines = self.lines
        for line, start, end_line, end, new in sorted(self.edits, reverse=True):
            head = lines[line - 1][:start]
            tail = lines[end_line - 1][end:]
            lines[line - 1 : end_line] = [head + new + tail]
        return b"".join(lines).decode()


def _import_text(node: ast.Import | ast.ImportFrom) -> str:
    def alias(a: ast.alias, module: bool) -> str:
        name = MODULES.get(a.name, a.name) if module else NAMES.get(a.name, a.name)
        asname = NAMES.get(a.asname, a.asname) if a.asname else None
        return name if asname in (None, name) else f"{name} as {asname}"

    if isinstance(node, ast.Import):
        return "import " + ", ".join(alias(a, True) for a in node.names)
    module = "." * node.level + MODULES.get(node.module or "", node.module or "")
    return f"from {module} import " + ", ".join(alias(a, False) for a in node.names)


def _name_after(edits: _Edits, line: int, col: int, keyword: str, name: str) -> None:
    """Renames the name that follows ``keyword`` (``def``, ``class``)."""
    text = edits.lines[line - 1].decode()
    found = re.compile(rf"{keyword}\s+({re.escape(name)})\b").search(text, col)
    if found is None:
        raise ConversionError(f"line {line}: {keyword} {name} not found")
    start = len(text[: found.start(1)].encode())
    edits.replace(line, start, start + len(name.encode()), NAMES[name])


def convert(source: str, name: str = "") -> str:
    """The sync twin of ``source`` (the module ``name``), before ruff."""
    source = resolve_async_blocks(source)
    tree = ast.parse(source)
    edits = _Edits(source)
    doc = tree.body[0] if tree.body else None
    if (
        isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    ):
        # The source's docstring speaks of the source; the twin points there.
        assert doc.end_lineno is not None
        assert doc.end_col_offset is not None
        text = f'"""The sync twin of ``idem.{name}``, generated from it: see its docstring."""'
        edits.replace(doc.lineno, doc.col_offset, doc.end_col_offset, text, doc.end_lineno)
        tree.body = tree.body[1:]

    def drop_keyword(node: ast.stmt | ast.expr, keyword: str, until: int | None = None) -> None:
        line, col = node.lineno, node.col_offset
        text = edits.text(line, col, len(edits.lines[line - 1]))
        found = re.match(rf"{keyword}\s+", text)
        if found is None:
            raise ConversionError(f"line {line}: expected {keyword!r}, found {text[:20]!r}")
        end = col + len(found.group().encode()) if until is None else until
        edits.replace(line, col, end, "")

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            assert node.end_lineno is not None
            assert node.end_col_offset is not None
            edits.replace(
                node.lineno, node.col_offset, node.end_col_offset, _import_text(node),
                node.end_lineno,
            )  # fmt: skip
            return
        if isinstance(node, ast.AsyncFunctionDef | ast.AsyncWith | ast.AsyncFor):
            drop_keyword(node, "async")
        if isinstance(node, ast.comprehension) and node.is_async:
            raise ConversionError("async comprehensions are not converted")
        if isinstance(node, ast.Await):
            if node.value.lineno != node.lineno:
                raise ConversionError(f"line {node.lineno}: await and its value on two lines")
            drop_keyword(node, "await", node.value.col_offset)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in NAMES:
            _name_after(edits, node.lineno, node.col_offset, "def", node.name)
        if isinstance(node, ast.ClassDef) and node.name in NAMES:
            _name_after(edits, node.lineno, node.col_offset, "class", node.name)
        if isinstance(node, ast.Name) and node.id in NAMES:
            assert node.end_col_offset is not None
            edits.replace(node.lineno, node.col_offset, node.end_col_offset, NAMES[node.id])
        if isinstance(node, ast.Attribute):
            assert node.end_lineno is not None
            assert node.end_col_offset is not None
            if isinstance(node.value, ast.Name):
                dotted = f"{node.value.id}.{node.attr}"
                if dotted in DOTTED:
                    if node.end_lineno != node.lineno:
                        raise ConversionError(f"line {node.lineno}: {dotted} on two lines")
                    edits.replace(node.lineno, node.col_offset, node.end_col_offset, DOTTED[dotted])
                    return
            if node.attr in NAMES:
                end = node.end_col_offset
                edits.replace(node.end_lineno, end - len(node.attr), end, NAMES[node.attr])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return edits.apply()


def _ruff(explicit: str | None) -> str:
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "ruff"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("ruff")
    if found is None:
        raise SystemExit("ruff is needed (pip install ruff, or --ruff PATH)")
    return found


def _run(args: list[str], text: str) -> str:
    done = subprocess.run(args, input=text, capture_output=True, text=True, cwd=PACKAGE)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed:\n{done.stderr}{done.stdout}")
    return done.stdout


def generate(source_name: str, target_name: str, ruff: str) -> str:
    source = (SOURCES / source_name).read_text()
    converted = convert(source, source_name.removesuffix(".py"))
    header = (
        f"# Generated by scripts/gen-python-sync.py from {source_name}: do not edit.\n"
        "# Edit the asyncio source and run the script (clients/python/README.md).\n"
    )
    target = str(SOURCES / target_name)
    fixed = _run(
        [ruff, "check", "--fix", "--select", "I,F401", "--exit-zero", "--quiet",
         "--stdin-filename", target, "-"],
        header + converted,
    )  # fmt: skip
    return _run([ruff, "format", "--quiet", "--stdin-filename", target, "-"], fixed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="diff instead of writing")
    parser.add_argument("--ruff", help="the ruff executable")
    args = parser.parse_args()
    ruff = _ruff(args.ruff)
    stale = 0
    for source_name, target_name in PAIRS:
        try:
            generated = generate(source_name, target_name, ruff)
        except ConversionError as err:
            print(f"{source_name}: {err}", file=sys.stderr)
            return 2
        path = SOURCES / target_name
        current = path.read_text() if path.exists() else ""
        if current == generated:
            continue
        if args.check:
            stale += 1
            sys.stderr.writelines(
                difflib.unified_diff(
                    current.splitlines(keepends=True),
                    generated.splitlines(keepends=True),
                    f"{target_name} (in the tree)",
                    f"{target_name} (generated from {source_name})",
                )
            )
        else:
            path.write_text(generated)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(
            f"{stale} generated module(s) out of date: run scripts/gen-python-sync.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
