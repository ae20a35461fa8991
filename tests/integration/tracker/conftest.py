"""Fixtures of the tracker's integration tests: valkey-servers whose clock a test shifts
(``sim.clockshim``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sim import clockshim
from sim.clockshim import FailoverPair, ShiftedRedis


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The clock shim, compiled (a C compiler is on every machine of the project's kind)."""
    so = clockshim.compile_shim(tmp_path_factory.mktemp("clock-shim"))
    if so is None:
        pytest.skip("no C compiler for the clock shim")
    return so


@pytest.fixture(scope="module")
def shifted_redis(shim: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ShiftedRedis]:
    """One valkey-server whose wall clock the test shifts."""
    node = clockshim.shifted_server(shim, tmp_path_factory.mktemp("shifted-redis"))
    node.server.start()
    try:
        yield node
    finally:
        node.server.stop()


@pytest.fixture
def failover_pair(shim: Path, tmp_path: Path) -> Iterator[FailoverPair]:
    """A Redis Cluster of one primary (every slot) and its replica, each with its own clock."""
    with clockshim.failover_pair(shim, tmp_path) as pair:
        yield pair
