"""Stops what `kvferry up` started when it dies without stopping it (SIGKILL, a crash).

PR_SET_PDEATHSIG sends each vLLM SIGTERM when its launcher dies, but vLLM ignores SIGTERM while
it starts up (0.32, CPU: still running 40 s after one), so a launcher killed while an instance
started or restarted left that vLLM and its engine core behind. The reaper, a small process in a
session of its own, reads process-group ids on its stdin, the launcher's pipe: ``+PGID`` when a
group starts, ``-PGID`` once it is stopped. When the pipe closes (the launcher exited, however
that happened) every group still listed gets SIGTERM, and SIGKILL after GRACE_S.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0
MAX_GROUPS = 4096


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(groups: set[int], grace: float = GRACE_S) -> None:
    """SIGTERM every group still there, SIGKILL what is left after `grace` seconds."""
    live = [g for g in groups if _alive(g)]
    for g in live:
        _signal(g, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        time.sleep(0.2)
        live = [g for g in live if _alive(g)]
    for g in live:
        _signal(g, signal.SIGKILL)


def main() -> int:
    grace = float(sys.argv[1]) if len(sys.argv) > 1 else GRACE_S
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is the launcher's to handle
    groups: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if len(line) < 2 or line[0] not in "+-" or not line[1:].isdigit():
            continue  # only the launcher writes here; anything else is ignored
        pgid = int(line[1:])
        if pgid <= 1:
            continue
        if line[0] == "+" and len(groups) < MAX_GROUPS:
            groups.add(pgid)
        elif line[0] == "-":
            groups.discard(pgid)
    reap(groups, grace)
    return 0


class Reaper:
    """The launcher's end: `track` each process-group leader it starts, `forget` it once stopped."""

    def __init__(self, grace: float = GRACE_S) -> None:
        self.grace = grace
        self.proc = subprocess.Popen([sys.executable, "-m", "kvferry.launcher.reaper", str(grace)],
                                     stdin=subprocess.PIPE, start_new_session=True, text=True)

    def _say(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # the reaper is gone: nothing to tell

    def track(self, proc: subprocess.Popen) -> None:
        self._say(f"+{proc.pid}")

    def forget(self, pid: int) -> None:
        self._say(f"-{pid}")

    def close(self) -> None:
        """After a clean stop: nothing is left to reap, and the reaper exits."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(self.grace + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


if __name__ == "__main__":
    sys.exit(main())
