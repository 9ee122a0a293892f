"""Running `kvferry up` in a test: start it and wait for its cluster.json, the launcher's process
tree (from /proc), a SIGTERM that stops it (timed), and the check of its cluster secret."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvferry.common.netutil import free_port
from kvferry.launcher.vllm_proc import stop_group
from tests.polling import until

KVFERRY = str(Path(sys.executable).parent / "kvferry")


def start_up(tmp: Path, *args: str) -> tuple[subprocess.Popen, dict]:
    port = free_port()
    out = open(tmp / "up.out", "w")
    proc = subprocess.Popen([KVFERRY, "up", "--port", str(port), "--log-dir", str(tmp / "logs"), *args],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    state = tmp / "logs" / "cluster.json"

    def up() -> bool:  # the banner, printed once the state file is written
        assert proc.poll() is None, f"kvferry up did not come up:\n{(tmp / 'up.out').read_text()}"
        return "kvferry is up:" in (tmp / "up.out").read_text()
    until(up, 400, lambda: f"kvferry up to come up:\n{(tmp / 'up.out').read_text()}", every=0.5)
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


def assert_the_cluster_has_a_secret_nobody_else_sees(tmp: Path, state: dict) -> None:
    """`kvferry up` made a cluster secret: a file only its owner reads, named (never quoted) in
    cluster.json and the configs, and a peer without it gets no NIXL metadata from a decoder."""
    import zmq

    from kvferry.common import zsock
    from kvferry.common.wire import messages as m
    from tests.transfer_helpers import fingerprint

    path = Path(state["cluster_secret_file"])
    assert os.stat(path).st_mode & 0o777 == 0o600
    text = path.read_text().strip()
    for f in (tmp / "logs").iterdir():
        if f.is_file() and f != path:
            assert text not in f.read_text(errors="replace"), f"the secret is in {f}"
    dec = next(i for i in state["instances"] if i["role"] == "decoder")
    ctx = zmq.Context()
    try:
        sock = zsock.connect(ctx, zmq.DEALER, zsock.PLAIN, zsock.tcp("127.0.0.1", dec["init_port"]))
        sock.send(m.encode(m.Hello(peer_id="outsider", agent_name="x", agent_metadata=b"x",
                                   fingerprint=fingerprint())))
        assert not sock.poll(1500), "a peer without the cluster secret got an answer from the decoder"
    finally:
        ctx.destroy(linger=0)


@contextmanager
def second_proxy(tmp: Path, state: dict, *flags: str) -> Iterator[str]:
    """A proxy of its own (round robin, health every 0.5 s, `flags`) in front of a `kvferry up`
    cluster's instances, with its cluster secret: its URL once /health answers; its log is
    tmp/proxy.log; stopped with its process group on exit."""
    port = free_port()
    args = [sys.executable, "-m", "kvferry.proxy", "--port", str(port), "--policy", "round_robin",
            "--cluster-secret-file", state["cluster_secret_file"], "--health-interval", "0.5", *flags]
    for i in state["instances"]:
        args += (["--prefiller", i["url"]] if i["role"] == "prefiller" else
                 ["--decoder", f"{i['url']},{i['init_port']},{i['alloc_port']}"])
    log_path = tmp / "proxy.log"
    with open(log_path, "wb") as log:
        px = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            def healthy() -> bool:
                assert px.poll() is None, log_path.read_text()
                try:
                    return httpx.get(url + "/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False
            until(healthy, 30, lambda: "the second proxy: " + log_path.read_text(), every=0.2)
            yield url
        finally:
            stop_group(px, 30)
