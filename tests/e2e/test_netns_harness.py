"""The network-namespace harness (tests/netns.py) and the delay relay (tests/delay_relay.py) that the
multi-host tests stand on: namespaces reach each other over the bridge, bytes show on the veth
counters, the relay adds its delay each way, and nothing is left behind (also after a SIGKILL)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.delay_relay import RelayThread, start_relay
from tests.netns import NetnsCluster, ours, pid_running, sweep_stale, unavailable_reason
from tests.polling import listening, until

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8); print("up", flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(1 << 16)):
        c.sendall(d)
    c.close()
"""

CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"x"); assert c.recv(1) == b"x"; rtts.append(time.perf_counter() - t)
blob = b"k" * int(sys.argv[3]); got = 0
c.sendall(blob)
while got < len(blob):
    got += len(c.recv(1 << 16))
print(sorted(rtts)[len(rtts) // 2])
"""


def test_netns_harness_links_counters_relay_delay_and_cleanup(tmp_path) -> None:
    port, size = 7700, 2_000_000
    with NetnsCluster(2) as net:
        assert len(ours(net.pid)[0]) == 2
        net.popen(1, [sys.executable, "-c", ECHO, net.addr(1), str(port)], log=tmp_path / "echo.log")
        # the test's process reaches a namespace over the bridge
        until(lambda: listening(net.addr(1), port), 60, f"{net.addr(1)}:{port} to listen")
        # namespace 0 -> 1 directly: the KV-sized blob shows on both links' counters
        rx1, tx1 = net.veth_bytes(1)
        r = net.run(0, [sys.executable, "-c", CLIENT, net.addr(1), str(port), str(size)])
        assert r.returncode == 0, r.stderr
        direct = float(r.stdout)
        rx1b, tx1b = net.veth_bytes(1)
        assert rx1b - rx1 >= size and tx1b - tx1 >= size
        assert rx1b - rx1 < 1.2 * size + 100_000  # nothing else on the link
        # the same through a 2 ms relay on namespace 1's delayed address: 4 ms more per round trip
        relay = start_relay(2.0, [(net.delay_addr(1), port, net.addr(1), port)])
        try:
            r = net.run(0, [sys.executable, "-c", CLIENT, net.delay_addr(1), str(port), str(size)])
            assert r.returncode == 0, r.stderr
            delayed = float(r.stdout)
        finally:
            relay.kill()
            relay.wait(5)
        assert delayed >= 0.004 > direct, (direct, delayed)
        assert delayed < 0.004 + 0.05
        # the in-process relay: its delay can change while it runs, and it counts the exchanges
        relay = RelayThread(0.0, [(net.delay_addr(1), port, net.addr(1), port)])
        try:
            relay.set_delay(1.5)
            r = net.run(0, [sys.executable, "-c", CLIENT, net.delay_addr(1), str(port), "1000"])
            assert r.returncode == 0, r.stderr
            assert float(r.stdout) >= 0.003
            link = relay.links[0]
            assert link.connections == 1 and 20 <= link.exchanges <= 22  # 20 pings, the blob's echo
        finally:
            relay.stop()
        pids = net.pids(1)
        assert pids
    assert ours(net.pid) == ([], [])  # namespaces, veths and bridge gone
    until(lambda: not any(map(pid_running, pids)), timeout=10, what="the echo server to die with its namespace")


def test_netns_harness_sweeps_a_killed_runs_leftovers(tmp_path) -> None:
    """A run SIGKILLed mid-test leaves namespaces with a process in them; the next run removes both."""
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); from netns import NetnsCluster\n"
              "n = NetnsCluster(2).up(); n.popen(0, ['sleep', '600']); print(n.pid, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parents[1])],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout is not None
        pid = int(child.stdout.readline())
        nss, links = ours(pid)
        assert len(nss) == 2 and len(links) == 3
        sleeper = until(lambda: [int(p) for p in subprocess.run(["ip", "netns", "pids", f"kvfns{pid}-0"],
                                                                capture_output=True, text=True).stdout.split()],
                        timeout=10, what="the sleep to run in its namespace")
    finally:
        child.kill()
        child.wait(5)
    removed = sweep_stale()
    assert set(nss) <= set(removed)
    assert ours(pid) == ([], [])
    until(lambda: not any(map(pid_running, sleeper)), timeout=10, what="the leftover sleep to be gone")
