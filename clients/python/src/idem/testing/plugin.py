"""idem's pytest fixtures, over ``idem.testing``: load with
``pytest_plugins = ["idem.testing.plugin"]`` in a ``conftest.py``.

- ``redis_server`` (session): a redis-server with the module;
- ``managed_server`` (session): one as a managed service runs it (no
  module, ``MODULE`` renamed away: clients load the Functions library);
- ``fresh_redis``: a server with the module for one test (to reconfigure
  or stop);
- ``idem_redis_args``, ``idem_module_candidates`` (session): what the
  servers are started with and where the module is looked for without
  ``$IDEM_MODULE``; override them in a ``conftest.py``.

A module that cannot be found stops the session (``pytest.exit``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from idem import testing
from idem.testing import RedisServer


@pytest.fixture(scope="session")
def idem_redis_args() -> tuple[str, ...]:
    """redis-server options every server of these fixtures gets."""
    return ("--enable-debug-command", "yes")


@pytest.fixture(scope="session")
def idem_module_candidates() -> Sequence[Path]:
    """Where the module is looked for when ``$IDEM_MODULE`` is not set."""
    return ()


def _start(args: tuple[str, ...], candidates: Sequence[Path], module: bool = True) -> RedisServer:
    try:
        testing.module_path(candidates)
    except testing.HarnessError as err:
        pytest.exit(f"{err} (or run scripts/test-python.sh)", 2)
    return testing.start_redis(module=module, extra_args=args, module_candidates=candidates)


@pytest.fixture(scope="session")
def redis_server(
    idem_redis_args: tuple[str, ...], idem_module_candidates: Sequence[Path]
) -> Iterator[RedisServer]:
    """A redis-server with the module, for the session."""
    server = _start(idem_redis_args, idem_module_candidates)
    try:
        yield server
    finally:
        testing.stop_redis(server)


@pytest.fixture(scope="session")
def managed_server(
    idem_redis_args: tuple[str, ...], idem_module_candidates: Sequence[Path]
) -> Iterator[RedisServer]:
    """A server as a managed service runs it: no module, ``MODULE`` renamed
    away; the clients load the library into it."""
    server = _start(idem_redis_args, idem_module_candidates, module=False)
    try:
        yield server
    finally:
        testing.stop_redis(server)


@pytest.fixture
def fresh_redis(
    idem_redis_args: tuple[str, ...], idem_module_candidates: Sequence[Path]
) -> Iterator[RedisServer]:
    """A server of its own, for tests that change its configuration or stop it."""
    server = _start(idem_redis_args, idem_module_candidates)
    try:
        yield server
    finally:
        testing.stop_redis(server)
