"""Shared fixtures: the tiny model and real vLLM CPU servers."""

from __future__ import annotations

import concurrent.futures
import contextlib
import faulthandler
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry.common.netutil import free_port
from kvferry.launcher import tiny_model
from kvferry.launcher.vllm_proc import VLLMServer
from tests.polling import TimedOut

REPO = Path(__file__).resolve().parent.parent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A test that timed out waiting shows where every thread was: this process's and its
    receiver processes' (tests/transfer_helpers.py), on stderr beside the failure."""
    yield
    if call.when != "call" or call.excinfo is None:
        return
    if not call.excinfo.errisinstance((TimeoutError, concurrent.futures.TimeoutError, TimedOut)):
        return
    from tests.transfer_helpers import DUMPABLE
    print(f"--- {item.nodeid} timed out: every thread's stack ---", file=sys.stderr)
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    for pid in list(DUMPABLE):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    if DUMPABLE:
        time.sleep(1)  # a sleep (window): the receivers write their stacks to the shared stderr


@pytest.hookimpl(optionalhook=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The size report (tests/test_layout.py `oversized`) after a run that checked the layout:
    what may hold more than one job, to read, never a failure."""
    ran = any(str(getattr(r, "nodeid", "")).startswith("tests/test_layout.py")
              for reports in terminalreporter.stats.values() for r in reports)
    if not ran:
        return
    from layout_sizes import oversized
    big = oversized()
    if big:
        terminalreporter.section("sizes to read (more than one job?)")
        for line in big:
            terminalreporter.write_line(line)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Two work units for `make test`'s two workers (`-n 2 --dist loadgroup`): tests/e2e (clusters of
    real vLLM servers, pinned to cores 0 and 1), in file order, on one; everything else on the
    other. Run alone, the rest leaves a 2-core machine half idle (it waits on sockets, leases and
    timers), so side by side the suite ends sooner (docs/testing.md). Not xdist_group marks: xdist
    3.8 writes a mark's group into a test's node id, which pytest 9.2 no longer reads from there."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling
    return TwoUnits(LoadScopeScheduling(config, log))


class TwoUnits:
    """xdist's loadscope scheduler, through its public interface (xdist.scheduler.Scheduling), shown
    each test as `vllm::...` or `rest::...`: loadscope makes one work unit of the tests whose ids
    agree up to their last `::`, so these are two units, each in collection order."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.original: dict[str, str] = {}  # the id loadscope is shown -> the test's own id

    def shown(self, nodeid: str) -> str:
        unit = "vllm" if nodeid.startswith("tests/e2e/") else "rest"
        name = f"{unit}::{nodeid.replace(':', '%3A')}"  # no other `::` in it: the unit is its scope
        self.original[name] = nodeid
        return name

    @property
    def nodes(self) -> list:
        return self.inner.nodes

    @property
    def collection_is_completed(self) -> bool:
        return self.inner.collection_is_completed

    @property
    def tests_finished(self) -> bool:
        return self.inner.tests_finished

    @property
    def has_pending(self) -> bool:
        return self.inner.has_pending

    def add_node(self, node) -> None:
        self.inner.add_node(node)

    def add_node_collection(self, node, collection) -> None:
        self.inner.add_node_collection(node, [self.shown(n) for n in collection])

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        self.inner.mark_test_complete(node, item_index, duration)

    def mark_test_pending(self, item: str) -> None:
        self.inner.mark_test_pending(item)

    def remove_pending_tests_from_node(self, node, indices) -> None:
        self.inner.remove_pending_tests_from_node(node, indices)

    def remove_node(self, node) -> str | None:
        crashed = self.inner.remove_node(node)
        return None if crashed is None else self.original.get(crashed, crashed)

    def schedule(self) -> None:
        self.inner.schedule()


@pytest.fixture(scope="module", autouse=True)
def no_store_client_left_behind() -> Iterator[None]:
    """A module that joins a Mooncake store in the test process leaves it before its master stops:
    a client of a stopped master holds the process ~10 s at exit (`make test` must end with pytest)."""
    yield
    mc = sys.modules.get("kvferry.engine.remote.mooncake_backend")
    if mc is not None and mc.open_clients():
        n = mc.close_all()
        pytest.fail(f"{n} Mooncake client(s) left joined after this module: call mooncake_backend.close_all() "
                    "before stopping the master", pytrace=False)


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    """Stops the stub engines and proxies a test started (tests/stub_procs.py), even when the test
    failed before its own cleanup. A module-scoped fixture's processes are started before a test's
    own fixtures, so they are not counted as the test's."""
    from tests.stub_procs import stopped_at_the_end
    with stopped_at_the_end():
        yield


@pytest.fixture
def kvf_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """caplog with kvferry's loggers at INFO (importing kvferry sets no level: the root's WARNING
    would hide their INFO lines). Its records reach caplog as any library's do."""
    import logging
    caplog.set_level(logging.INFO, logger="kvferry")
    return caplog


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return tiny_model.ensure()


@pytest.fixture(scope="session")
def tiny_kv1_model_path() -> Path:
    """The tiny Llama with one KV head (replicated on every rank at TP > 1), built once and cached
    in ~/.cache/kvferry/tiny-llama-kv1."""
    return tiny_model.ensure(kv_heads=1)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = os.environ.get("KVFERRY_TEST_LOG_DIR")
    return Path(d) if d else tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def plain_vllm(tiny_model_path: Path, log_dir: Path) -> Iterator[VLLMServer]:
    """One plain vLLM CPU server (no connector) on core 0, shared by the session."""
    port = free_port()
    server = VLLMServer(str(tiny_model_path), port, log_dir / f"vllm-plain-{port}.log", cores="0")
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_available() -> None:
    """redis-server must be installed (`make redis`); under CI=true (.ci/run) a missing
    one fails instead of skipping."""
    from kvferry.testing.store_servers import redis_server_binary
    if redis_server_binary() is None:
        msg = "redis-server not installed: run `make redis` (apt-get install redis-server)"
        if os.environ.get("CI") == "true":  # not a KVFERRY_* variable: those are config keys
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def etcd_available() -> None:
    """etcd must be installed (`make etcd`); under CI=true (.ci/run) a missing one fails instead
    of skipping."""
    from kvferry.launcher.services import etcd_binary
    if etcd_binary() is None:
        msg = "etcd not installed: run `make etcd` (apt-get install etcd-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def prometheus_available() -> None:
    """prometheus and promtool must be installed (`make prometheus`); under CI=true (.ci/run) a
    missing one fails instead of skipping."""
    from kvferry.testing.prometheus import prometheus_binary, promtool_binary
    if prometheus_binary() is None or promtool_binary() is None:
        msg = "prometheus or promtool not installed: run `make prometheus` (apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def etcd_server(etcd_available: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One real etcd for the session's discovery tests (each test uses its own key prefix)."""
    from kvferry.launcher.services import start_etcd
    proc = start_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield proc
    finally:
        proc.stop()
