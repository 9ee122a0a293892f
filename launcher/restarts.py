"""`kvferry up` starts an instance that died again: after a back-off that doubles with each
restart (1 s, 2 s, 4 s, ... at most 30 s), at most `--max-restarts` times; then it says the
instance is in a crash loop and leaves it down. Each restart is a log line and is counted in
`cluster.json` (`restarts`); the proxy takes the instance back once its health checks pass."""

from __future__ import annotations

import sys
import time
from typing import Protocol

BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0


class _Cluster(Protocol):  # launcher.up.Cluster
    instances: list
    restarts: dict[int, int]

    def name(self, s) -> str: ...
    def write_state(self) -> object: ...
    def started(self, s) -> None: ...
    def stopped(self, pid: int) -> None: ...


class Restarts:
    def __init__(self, cluster: _Cluster, limit: int) -> None:
        self.cluster, self.limit = cluster, limit
        self.due: dict[int, float] = {}  # id(instance) -> when it starts again
        self.given_up: set[int] = set()

    def tick(self) -> None:
        """One look at every instance: note the dead, start those whose back-off is over."""
        c, now = self.cluster, time.monotonic()
        for s in c.instances:
            k = id(s)
            if s.proc is None or k in self.given_up:
                continue
            if k in self.due:
                if now >= self.due[k]:
                    del self.due[k]
                    c.restarts[k] = c.restarts.get(k, 0) + 1
                    pid = s.proc.pid
                    s.stop(timeout=2)  # whatever is left of its process group (engine core, workers) goes
                    c.stopped(pid)
                    s.start()
                    c.started(s)
                    c.write_state()
                    print(f"kvferry: {c.name(s)} started again (restart {c.restarts[k]} of at most {self.limit}, "
                          f"pid {s.proc.pid}); the proxy takes it back once it is healthy", file=sys.stderr,
                          flush=True)
                continue
            rc = s.proc.poll()
            if rc is None:
                continue
            n = c.restarts.get(k, 0)
            if n >= self.limit:
                self.given_up.add(k)
                print(f"kvferry: {c.name(s)} ({s.url}) exited with {rc} and was restarted {n} times already: a crash "
                      f"loop; it stays down (--max-restarts {self.limit}); the proxy routes around it. Log: "
                      f"{s.log_path}", file=sys.stderr, flush=True)
                continue
            delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** n)
            self.due[k] = now + delay
            print(f"kvferry: {c.name(s)} ({s.url}) exited with {rc}; starting it again in {delay:.0f}s "
                  f"(restart {n + 1} of at most {self.limit}). Log: {s.log_path}", file=sys.stderr, flush=True)
