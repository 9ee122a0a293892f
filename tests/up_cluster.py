"""Running `kvferry up` in a test: start it and wait for its cluster.json, the launcher's process
tree (from /proc), and a SIGTERM that stops it (timed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvferry.common.netutil import free_port

KVFERRY = str(Path(sys.executable).parent / "kvferry")


def start_up(tmp: Path, *args: str) -> tuple[subprocess.Popen, dict]:
    port = free_port()
    out = open(tmp / "up.out", "w")
    proc = subprocess.Popen([KVFERRY, "up", "--port", str(port), "--log-dir", str(tmp / "logs"), *args],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    state = tmp / "logs" / "cluster.json"
    deadline = time.monotonic() + 400
    while not state.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"kvferry up did not come up:\n{(tmp / 'up.out').read_text()}")
        time.sleep(1)
    time.sleep(0.5)  # the banner follows the state file
    return proc, json.loads(state.read_text())


def tree(pid: int) -> set[int]:
    """pid and all its descendants, from /proc."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += kids.get(p, [])
    return out


def stop(proc: subprocess.Popen) -> float:
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    return time.monotonic() - t
