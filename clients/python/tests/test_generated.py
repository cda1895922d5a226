"""The sync twins generated from the asyncio sources (scripts/gen-python-sync.py):
what the conversion does, and that the files in the tree are its output."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gen-python-sync.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_python_sync", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOURCE = '''"""The source."""

import asyncio

import redis.asyncio as aredis
from psycopg import AsyncConnection

if True:  # ASYNC
    import threading


class AsyncFence:
    async def aclose(self, conn: AsyncConnection) -> None:
        async with conn.transaction():
            await asyncio.sleep(1)  # a pause
        if True:  # ASYNC
            await conn.set_autocommit(True)
        else:
            # sync only
            conn.autocommit = True

    async def __aenter__(self) -> AsyncFence:
        return self
'''

EXPECTED = '''"""The sync twin of ``idem.x``, generated from it: see its docstring."""

import asyncio

import redis
from psycopg import Connection



class Fence:
    def close(self, conn: Connection) -> None:
        with conn.transaction():
            time.sleep(1)  # a pause
        # sync only
        conn.autocommit = True

    def __enter__(self) -> Fence:
        return self
'''


def test_the_conversion_keeps_comments_and_takes_the_sync_branch() -> None:
    # Before ruff (which then drops the unused import and blank lines).
    assert _script().convert(SOURCE, "x") == EXPECTED


def test_the_generated_modules_are_up_to_date() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
