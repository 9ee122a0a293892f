"""Stops what `kvferry up` started when it dies without stopping it (SIGKILL, a crash).

PR_SET_PDEATHSIG sends each vLLM SIGTERM when its launcher dies, but vLLM ignores SIGTERM while
it starts up (0.32, CPU: still running 40 s after one), so a launcher killed while an instance
started or restarted left that vLLM and its engine core behind. The reaper, a small process in a
session of its own, reads process-group ids on its stdin, the launcher's pipe: ``+PGID`` when a
group starts, ``-PGID`` once it is stopped. When the pipe closes (the launcher exited, however
that happened) every group still listed gets SIGTERM, and SIGKILL after GRACE_S.

A launcher killed between starting a process and telling the reaper (a restart's `Popen`
returned, the `+PGID` line not yet written) would leave that process unlisted. So every process
the launcher starts also carries its tag in the environment (TAG_ENV, inherited from the
launcher's): when the pipe closes the reaper also finds, in /proc, every live process with the
tag, and reaps it too (its group where it leads one, else the process alone).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

GRACE_S = 10.0
MAX_GROUPS = 4096
TAG_ENV = "LAUNCHED_BY_KVFERRY_UP"  # not KVFERRY_*: those are config keys (common/config.py)


def _signal(target: tuple[int, bool], sig: int) -> bool:
    """Send `sig` (0: only look) to a (process group, True) or a (lone process, False); whether
    it was there to receive it."""
    ident, group = target
    try:
        (os.killpg if group else os.kill)(ident, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def tagged(tag: str) -> tuple[set[int], set[int]]:
    """(process groups, lone processes) of the live processes whose environment carries `tag`
    (TAG_ENV): a process that leads its group stands for the group, any other for itself."""
    want = f"{TAG_ENV}={tag}".encode()
    groups: set[int] = set()
    lone: set[int] = set()
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc (not Linux): only the pipe's list is reaped
        return groups, lone
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read(1 << 20)
            pgid = os.getpgid(pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if want in env.split(b"\0"):
            (groups if pgid == pid else lone).add(pid)
    return groups, lone


def reap(groups: set[int], grace: float = GRACE_S, lone: set[int] | None = None) -> None:
    """SIGTERM every group (and lone process) still there, SIGKILL what is left after `grace` seconds."""
    live = [t for t in [(g, True) for g in groups] + [(p, False) for p in lone or ()] if _signal(t, 0)]
    for t in live:
        _signal(t, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        time.sleep(0.2)
        live = [t for t in live if _signal(t, 0)]
    for t in live:
        _signal(t, signal.SIGKILL)


def main() -> int:
    grace = float(sys.argv[1]) if len(sys.argv) > 1 else GRACE_S
    tag = sys.argv[2] if len(sys.argv) > 2 else None
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
    lone: set[int] = set()
    if tag:
        found, lone = tagged(tag)
        groups |= found
    reap(groups, grace, lone)
    return 0


class Reaper:
    """The launcher's end: `track` each process-group leader it starts, `forget` it once stopped."""

    def __init__(self, grace: float = GRACE_S) -> None:
        """Also gives this process TAG_ENV: every process it starts from now on inherits the tag
        (the reaper itself, started first, does not)."""
        self.grace = grace
        self.tag = secrets.token_hex(16)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvferry.launcher.reaper", str(grace), self.tag],
                                     stdin=subprocess.PIPE, start_new_session=True, text=True)
        os.environ[TAG_ENV] = self.tag

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
