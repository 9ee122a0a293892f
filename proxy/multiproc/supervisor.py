"""`kvferry-proxy --workers N`: N processes serve one port, routing as one proxy.

The supervisor (this module; it runs no event loop and serves nothing) makes what the workers
share, then forks them: each worker is a whole proxy (instances, health checks, KV-event streams,
discovery) that binds --port with SO_REUSEPORT, so the kernel spreads connections over them. They
share:
- load: each instance's requests in flight and queued prompt tokens (multiproc/board.py), so two
  workers do not both send their next prompt to the prefiller that looks idle to each alone;
  round-robin turns too; and instance ids (a row's), so every worker names an instance alike;
- admin changes (multiproc/admin_log.py): one made through any worker holds on all of them for every later
  request; the file keeps current state only (compacted), which a replacement worker replays;
- metrics: prometheus-client's multiprocess mode (metrics.py), /metrics sums every worker's.

A worker that dies is replaced (its share of the load is zeroed first: its requests died with
it); one that exits with status 2 (a configuration error, already printed) stops them all. SIGINT or
SIGTERM to the supervisor stops every worker; a worker also stops when the supervisor dies
(PR_SET_PDEATHSIG), so nothing outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import tempfile
import time

from kvferry.common.log import get_logger
from kvferry.proxy.multiproc.admin_log import Peers
from kvferry.proxy.multiproc.board import LoadBoard
from kvferry.proxy.options import ProxyOptions

logger = get_logger(__name__)

RESTART_PAUSE_S = 0.5  # between a worker's death and its replacement (no tight loop on a crash at start)
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this
START_S = 300.0  # a worker not listening by then is killed (loading a tokenizer takes seconds, not minutes)
START_PROGRESS_S = 15.0  # a line while one is still starting
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    def __init__(self, opts: ProxyOptions, n: int, serve_one) -> None:
        """`serve_one(opts, board, peers, index, ready) -> int`: one worker's whole life (server.py),
        calling ready() once it listens; its exit status."""
        self.opts, self.n, self.serve_one = opts, n, serve_one
        self.folder = tempfile.mkdtemp(prefix="kvferry-proxy-")
        os.mkdir(os.path.join(self.folder, "metrics"))
        changes = os.path.join(self.folder, "admin-changes.jsonl")
        open(changes, "wb").close()
        static = [spec.url for spec in (*opts.prefillers, *opts.decoders)]
        self.board = LoadBoard(n, os.path.join(self.folder, "board.lock"))
        self.peers = Peers(changes, n, static)
        self.pids: dict[int, int] = {}  # pid -> worker index
        self._stop = False

    def _spawn(self, index: int) -> int | None:
        """Start worker `index` and wait until it listens: None, or its exit status when it
        exited first (a configuration error is 2, printed by the worker)."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                os.close(r)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _die_with_parent()
                from kvferry.proxy import metrics
                metrics.multiprocess(os.path.join(self.folder, "metrics"))
                self.board.worker = self.peers.worker = index

                def ready() -> None:
                    os.write(w, b"1")
                    os.close(w)
                code = self.serve_one(self.opts, self.board, self.peers, index, ready)
            except KeyboardInterrupt:
                code = 0
            except BaseException:  # noqa: BLE001 - logged; the supervisor replaces the worker
                logger.exception("proxy worker %d failed", index)
            finally:
                os._exit(code)
        os.close(w)
        self.pids[pid] = index
        started = next_line = time.monotonic()
        try:
            while not self._stop:
                readable, _, _ = select.select([r], [], [], 0.2)
                if readable:
                    if os.read(r, 1):
                        return None
                    break  # the pipe closed without a word: the worker exited
                waited = time.monotonic() - started
                if waited >= START_S:
                    logger.error("proxy worker %d (pid %d) is not listening after %.0f s: killed", index, pid, waited)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    break
                if time.monotonic() - next_line >= START_PROGRESS_S:
                    next_line = time.monotonic()
                    logger.info("proxy worker %d (pid %d) still starting (%.0f s)", index, pid, waited)
            else:
                return None
        finally:
            os.close(r)
        _, status = os.waitpid(pid, 0)
        self.pids.pop(pid, None)
        self.board.clear_worker(index)
        return os.waitstatus_to_exitcode(status)

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    def run(self) -> int:
        """Until SIGINT/SIGTERM (0) or a worker's configuration error (2)."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 0
        try:
            for i in range(self.n):  # one at a time: a configuration error is printed once
                rc = self._spawn(i)
                if rc is not None:
                    return 2 if rc == 2 else 1
            logger.info("kvferry proxy: %d workers on port %d", self.n, self.opts.port)
            while not self._stop:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    pid, status = 0, 0
                if pid == 0:
                    time.sleep(0.1)
                    continue
                index = self.pids.pop(pid, None)
                if index is None:
                    continue
                rc = os.waitstatus_to_exitcode(status)
                self.board.clear_worker(index)
                from kvferry.proxy import metrics
                metrics.worker_died(pid, os.path.join(self.folder, "metrics"))
                if rc == 2:
                    code = 2  # its error is printed: every worker would fail alike
                    break
                if self._stop:
                    break
                logger.warning("proxy worker %d (pid %d) exited with %d; starting another", index, pid, rc)
                time.sleep(RESTART_PAUSE_S)
                rc = self._spawn(index)
                if rc == 2:
                    code = 2
                    break
        finally:
            self._stop_all()
            for s, h in old.items():
                signal.signal(s, h)
            shutil.rmtree(self.folder, ignore_errors=True)
        return code

    def _stop_all(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.pids and time.monotonic() < deadline:
            for pid in list(self.pids):
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done:
                    self.pids.pop(pid)
            time.sleep(0.05)
        for pid in list(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            self.pids.pop(pid)
