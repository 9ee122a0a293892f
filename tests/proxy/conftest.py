"""Fixtures shared by the proxy's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.common import secret


@pytest.fixture(scope="module")
def cluster_secret(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, secret.ClusterSecret]:
    """A fresh cluster secret for the module: its file and the key read from it."""
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    secret.write_file(str(path), secret.generate())
    return path, secret.from_file(str(path), "test")
