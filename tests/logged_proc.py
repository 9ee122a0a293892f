"""A Python child process (`python ARGS`) whose output goes to a log file the test reads back, in a
session of its own so stopping it stops what it started; and the two calls the discovery tests
make of the stub engines and proxies so started (by URL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from kvferry.launcher.vllm_proc import stop_group


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> None:
        stop_group(self.proc, 10)


def served(stub: str) -> int:
    """Requests the stub engine at `stub` was asked."""
    return len(httpx.get(f"{stub}/stub/log", timeout=5).json()["requests"])


def complete(proxy: str, n: int) -> None:
    """`n` completions through the proxy at `proxy`, each answered 200."""
    for _ in range(n):
        r = httpx.post(f"{proxy}/v1/completions", json={"model": "stub", "prompt": "hello there", "max_tokens": 3},
                       timeout=10)
        assert r.status_code == 200, r.text
