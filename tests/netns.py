"""Linux network namespaces for multi-host tests: a bridge and N namespaces on one kernel, each with
its own veth and address, as separate machines on one switch would have.

    with NetnsCluster(3) as net:            # skips the test where not root or no `ip`
        proc = net.popen(0, ["python", "-m", "http.server", "8000", "--bind", net.addr(0)])
        httpx.get(f"http://{net.addr(0)}:8000/")     # the test's own process is on the bridge
        net.veth_bytes(0)                   # (rx, tx) bytes of namespace 0's link

Layout: bridge `kvfb<pid>` in the test's namespace with `10.77.S.1/24`; namespace `kvfns<pid>-<i>`
with `veth0` at `10.77.S.<10+i>` (its peer `kvfv<pid>h<i>` on the bridge) and loopback up;
`S` is a /24 no interface here uses yet. `delay_addr(i)` (`10.77.S.<100+i>`, on the bridge) is
where `tests/delay_relay.py` listens for namespace i's ports, so a peer reaching i there goes
through the relay's delay.

Cleanup is guaranteed: `close()` (the context manager's exit, an atexit hook, SIGTERM) kills every
process in every namespace it made (`ip netns pids`, not only the ones it started) and deletes the
namespaces and the bridge (a veth dies with its namespace). A run killed with SIGKILL leaves them
behind: the next `NetnsCluster` sweeps every `kvfns<pid>-*` / `kvfb<pid>` whose pid is dead.
Traffic goes only to loopback and to these namespaces: no route or forwarding is added."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.polling import TimedOut, until

NS_PREFIX = "kvfns"
BRIDGE_PREFIX = "kvfb"
VETH_PREFIX = "kvfv"
SUBNET_BASE = "10.77"
NS_VETH = "veth0"


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2): network-namespace tests need it"
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns add, bridges, veths)"
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces"
    return None


def ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def pid_running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_ns_processes(ns: str, timeout: float = 10) -> None:
    """SIGKILL every process whose network namespace is `ns`, bounded wait until none is left."""
    def none_left() -> bool:
        r = ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids
    with contextlib.suppress(TimedOut):  # a clean-up: it does not fail on what it could not kill
        until(none_left, timeout, every=0.1)


def namespaces() -> list[str]:
    r = ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def links() -> list[str]:
    r = ip("-o", "link", "show", check=False)
    return [line.split(":")[1].strip().split("@")[0] for line in r.stdout.splitlines() if ":" in line]


def ours(pid: int | None = None) -> tuple[list[str], list[str]]:
    """Namespaces and links of this harness (of run `pid` when given, else of every run)."""
    tag = str(pid) if pid is not None else r"\d+"
    ns_re = re.compile(rf"^{NS_PREFIX}({tag})-\d+$")
    link_re = re.compile(rf"^(?:{BRIDGE_PREFIX}|{VETH_PREFIX})({tag})(?:h\d+)?$")
    return ([n for n in namespaces() if ns_re.match(n)], [ln for ln in links() if link_re.match(ln)])


def sweep_stale() -> list[str]:
    """Delete namespaces and links left by runs whose process is gone; returns what it removed."""
    removed: list[str] = []
    nss, lks = ours()
    for ns in nss:
        pid = int(re.match(rf"^{NS_PREFIX}(\d+)-", ns).group(1))  # type: ignore[union-attr]
        if not pid_running(pid):
            _kill_ns_processes(ns)
            ip("netns", "delete", ns, check=False)
            removed.append(ns)
    for link in lks:
        pid = int(re.match(rf"^(?:{BRIDGE_PREFIX}|{VETH_PREFIX})(\d+)", link).group(1))  # type: ignore[union-attr]
        if not pid_running(pid):
            ip("link", "delete", link, check=False)
            removed.append(link)
    return removed


def _free_subnet() -> int:
    used = ip("-4", "-o", "addr", "show", check=False).stdout
    start = os.getpid() % 200
    for k in range(200):
        s = (start + k) % 200 + 20
        if f" {SUBNET_BASE}.{s}." not in used:
            return s
    raise RuntimeError(f"no free {SUBNET_BASE}.S.0/24 subnet for the test bridge")


class NetnsCluster:
    """`n` namespaces on one bridge; see the module's docstring."""

    def __init__(self, n: int, tag: str | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            import pytest
            pytest.skip(reason)
        self.n = n
        self.pid = os.getpid()
        self.tag = tag or str(self.pid)  # one harness per process at a time (the names carry the pid)
        self.bridge = f"{BRIDGE_PREFIX}{self.tag}"
        self.names = [f"{NS_PREFIX}{self.tag}-{i}" for i in range(n)]
        self.host_veths = [f"{VETH_PREFIX}{self.tag}h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self._closed = False
        self._up = False

    # -- addresses --
    def addr(self, i: int) -> str:
        """Namespace i's own address (on its veth0)."""
        return f"{SUBNET_BASE}.{self.subnet}.{10 + i}"

    def delay_addr(self, i: int) -> str:
        """Where namespace i's ports are reached through a delay relay (an address of the bridge)."""
        return f"{SUBNET_BASE}.{self.subnet}.{100 + i}"

    @property
    def bridge_addr(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.1"

    # -- life cycle --
    def up(self) -> NetnsCluster:
        sweep_stale()
        self.subnet = _free_subnet()
        atexit.register(self.close)
        self._prev_term = signal.getsignal(signal.SIGTERM)
        with contextlib.suppress(ValueError):  # only the main thread may set it
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._up = True
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
            for i in range(self.n):
                ip("addr", "add", f"{self.delay_addr(i)}/32", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i, (ns, hv) in enumerate(zip(self.names, self.host_veths, strict=True)):
                ip("netns", "add", ns)
                ip("link", "add", hv, "type", "veth", "peer", "name", NS_VETH, "netns", ns)
                ip("link", "set", hv, "master", self.bridge)
                ip("link", "set", hv, "up")
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", NS_VETH)
                ip("-n", ns, "link", "set", NS_VETH, "up")
            self._wait_reachable()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_reachable(self, timeout: float = 10) -> None:
        """A bridge port forwards only after its (short) setup; wait until each link is up."""
        until(lambda: all(Path(f"/sys/class/net/{hv}/operstate").read_text().strip() == "up"
                          for hv in self.host_veths), timeout, "every bridge link to come up")

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.close()
        prev = self._prev_term
        if callable(prev):
            prev(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def close(self) -> None:
        """Kill everything in the namespaces, delete them and the bridge; idempotent."""
        if self._closed or not self._up:
            return
        self._closed = True
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for ns in self.names:
            _kill_ns_processes(ns)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for ns in self.names:
            ip("netns", "delete", ns, check=False)
        ip("link", "delete", self.bridge, check=False)
        for hv in self.host_veths:
            ip("link", "delete", hv, check=False)
        with contextlib.suppress(ValueError):
            atexit.unregister(self.close)
        with contextlib.suppress(ValueError, TypeError):
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_term)

    def __enter__(self) -> NetnsCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- processes --
    def wrap(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` run in namespace i (`ip netns exec` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              log: Path | None = None) -> subprocess.Popen:
        """Start `argv` in namespace i, in its own session (killed as a group at close)."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        try:
            p = subprocess.Popen(self.wrap(i, argv), env=None if env is None else dict(env), stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self.procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(i, argv), capture_output=True, text=True, timeout=timeout)

    def kill_all(self, i: int) -> None:
        """SIGKILL every process in namespace i at once (a machine that dies)."""
        _kill_ns_processes(self.names[i])

    def pids(self, i: int) -> list[int]:
        """Every process in namespace i."""
        r = ip("netns", "pids", self.names[i], check=False)
        return [int(p) for p in r.stdout.split()]

    # -- counters --
    def veth_bytes(self, i: int) -> tuple[int, int]:
        """(bytes into namespace i, bytes out of it) on its link, read on the bridge side."""
        base = Path(f"/sys/class/net/{self.host_veths[i]}/statistics")
        # the bridge side's tx is what namespace i received
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())

