"""Fixtures shared by the proxy's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.common import secret
from tests.logged_proc import Proc


@pytest.fixture(scope="module")
def cluster_secret(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, secret.ClusterSecret]:
    """A fresh cluster secret for the module: its file and the key read from it."""
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    secret.write_file(str(path), secret.generate())
    return path, secret.from_file(str(path), "test")


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts (tests.logged_proc.Proc), stopped after it, newest first."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()
