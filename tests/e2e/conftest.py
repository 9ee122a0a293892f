"""Fixtures shared by the real-vLLM tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from tests.up_cluster import start_up, stop


@pytest.fixture(scope="module")
def kvferry_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., SimpleNamespace]]:
    """Starts `kvferry up` with the given flags (and environment), once a call, for the module: a
    module's `cluster` fixture starts its cluster through it, and each is stopped at the module's end
    (if a test did not stop it). A call returns its process, its cluster.json and its folder."""
    started: list[SimpleNamespace] = []

    def start(name: str, *flags: str, env: dict[str, str] | None = None) -> SimpleNamespace:
        tmp = tmp_path_factory.mktemp(name)
        with pytest.MonkeyPatch.context() as mp:  # the launcher's environment, not the tests'
            for k, v in (env or {}).items():
                mp.setenv(k, v)
            proc, state = start_up(tmp, *flags)
        started.append(up := SimpleNamespace(proc=proc, state=state, tmp=tmp))
        return up

    try:
        yield start
    finally:
        for up in started:
            if up.proc.poll() is None:
                stop(up.proc)
