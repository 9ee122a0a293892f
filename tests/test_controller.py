"""kvferry-controller as a real process, with workers played by real ZMQ sockets (no vLLM):
registration, heartbeat expiry, longest-prefix lookups, resync after a controller restart,
refused duplicates, and the HTTP API's errors."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from kvferry.common import messages as m
from kvferry.common.hashing import chunk_keys
from kvferry.common.netutil import free_port
from kvferry.launcher.stores import Controller
from tests.polling import until

SALT = b"test-salt"
CHUNK = 4


class FakeWorker:
    """One worker as the controller sees it: pushes reports, answers commands on its worker port."""

    def __init__(self, c: Controller, instance_id: str, timeout: float = 30.0) -> None:
        self.ctx = zmq.Context.instance()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{c.pull}")
        self.port = free_port()
        self.commands = self.ctx.socket(zmq.ROUTER)
        self.commands.bind(f"tcp://127.0.0.1:{self.port}")
        self.info = m.WorkerInfo(instance_id=instance_id, worker_id=0, epoch=f"e-{self.port}", host="127.0.0.1",
                                 worker_port=self.port, p2p_init_port=free_port(), p2p_lookup_port=free_port(),
                                 salt=SALT, chunk_size=CHUNK, partial_chunks=True, heartbeat_timeout=timeout,
                                 cpu_capacity=1 << 30)

    def send(self, msg: m.Msg) -> None:
        self.push.send(m.encode(msg))

    def heartbeat(self, num_chunks: int = 0) -> None:
        self.send(m.Heartbeat(worker=self.info, num_chunks=num_chunks, used_bytes=0))

    def admit(self, keys: list[bytes], reset: bool = False) -> None:
        self.send(m.ChunkAdmit(instance_id=self.info.instance_id, worker_id=0, epoch=self.info.epoch,
                               location="LocalCPUBackend", keys=keys, sizes=[100] * len(keys), reset=reset))

    def command(self, timeout: float = 10.0) -> m.Msg:
        assert self.commands.poll(int(timeout * 1000)), "the controller sent no command"
        ident, frame = self.commands.recv_multipart()
        msg = m.decode(frame)
        self.commands.send_multipart([ident, m.encode(m.CommandResult(event_id=msg.event_id, ok=True))])
        return msg

    def close(self) -> None:
        self.push.close(linger=0)
        self.commands.close(linger=0)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    c = Controller(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def keys(tokens: list[int]) -> list[bytes]:
    return chunk_keys(tokens, CHUNK, SALT)


def lookup(c: Controller, ks: list[bytes], asker: str = "asker") -> m.LookupResponse:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{c.reply}")
    try:
        s.send(m.encode(m.LookupRequest(instance_id=asker, keys=ks)))
        assert s.poll(5000), "no lookup answer"
        return m.decode(s.recv(), expect=m.LookupResponse)
    finally:
        s.close(linger=0)


def state(c: Controller) -> dict:
    return httpx.get(c.url + "/api/state", timeout=10).json()


def test_lookup_answers_the_longest_prefix_and_forgets_silent_instances(controller: Controller) -> None:
    tokens = list(range(100, 120))  # 5 chunks of 4
    ks = keys(tokens)
    a, b = FakeWorker(controller, "a", timeout=30.0), FakeWorker(controller, "b", timeout=1.0)
    try:
        for w in (a, b):
            w.heartbeat()
        a.admit(ks[:2])
        b.admit(ks[:3])
        ans = until(lambda: (r := lookup(controller, ks)).num_chunks == 3 and r, what="b's three chunks")
        assert ans.instance_id == "b" and ans.peers[0].init_port == b.info.p2p_init_port
        # The same prefix: the asker's own chunks win (a move may have put them there).
        a.admit([ks[2]])
        until(lambda: lookup(controller, ks, asker="a").instance_id == "a", what="a to win its own tie")
        # The HTTP form keys the tokens the way each instance does.
        r = httpx.post(controller.url + "/lookup", json={"tokens": tokens}, timeout=10).json()
        assert r["layout_info"] == {"a": ["LocalCPUBackend", 12], "b": ["LocalCPUBackend", 12]}
        # Evictions count: b drops its first chunk, so it holds no prefix at all.
        b.send(m.ChunkEvict(instance_id="b", worker_id=0, epoch=b.info.epoch, location="LocalCPUBackend",
                            keys=[ks[0]]))
        until(lambda: lookup(controller, ks, asker="x").instance_id == "a", what="b's eviction")
        # b stops heartbeating: dropped after its 1 s timeout, while a (heartbeating) stays.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5:
            a.heartbeat()
            time.sleep(0.2)
        assert [i["instance_id"] for i in state(controller)["instances"]] == ["a"]
        assert "no heartbeat for" in controller.log.read_text()
    finally:
        a.close()
        b.close()


def test_a_restarted_controller_asks_workers_to_resync(controller: Controller, tmp_path: Path) -> None:
    ks = keys(list(range(8)))
    w = FakeWorker(controller, "a")
    try:
        w.heartbeat()
        w.admit(ks)
        until(lambda: lookup(controller, ks).num_chunks == 2, what="the admission")
        controller.stop()
        c2 = Controller(tmp_path, port=controller.port)
        # The new controller has new monitor ports: point the worker's reports at them.
        w.push.close(linger=0)
        w.push = zmq.Context.instance().socket(zmq.PUSH)
        w.push.connect(f"tcp://127.0.0.1:{c2.pull}")
        try:
            w.heartbeat(num_chunks=2)  # a worker the new controller never heard of, holding chunks
            cmd = w.command()
            assert isinstance(cmd, m.Resync)
            w.admit(ks, reset=True)
            until(lambda: lookup(c2, ks).num_chunks == 2, what="the resync")
        finally:
            c2.stop()
    finally:
        w.close()


def test_a_second_process_cannot_take_a_live_instance_id(controller: Controller) -> None:
    first, second = FakeWorker(controller, "same"), FakeWorker(controller, "same")
    try:
        first.heartbeat()
        until(lambda: state(controller)["instances"], what="registration")
        second.heartbeat()
        until(lambda: "Give each instance its own lmcache_instance_id" in controller.log.read_text(),
              what="the refusal")
        workers = state(controller)["instances"][0]["workers"]
        assert [w["worker_port"] for w in workers] == [first.port]
    finally:
        first.close()
        second.close()


def test_http_errors_name_the_fix(controller: Controller) -> None:
    url = controller.url
    r = httpx.post(url + "/move", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = httpx.post(url + "/lookup", json={"tokens": [1, -2]}, timeout=10)
    assert r.status_code == 400 and "/tokenize" in r.json()["error"]
    r = httpx.post(url + "/move", json={"old_position": ["x", "LocalCPUBackend"],
                                        "new_position": ["x", "LocalCPUBackend"], "tokens": [1]}, timeout=10)
    assert r.status_code == 400 and "name two instances" in r.json()["error"]
    r = httpx.post(url + "/move", json={"old_position": ["x"], "new_position": ["y", "LocalCPUBackend"],
                                        "tokens": [1]}, timeout=10)
    assert r.status_code == 400 and "[instance_id, location]" in r.json()["error"]
    r = httpx.post(url + "/move", json={"old_position": ["x", "LocalCPUBackend"],
                                        "new_position": ["y", "LocalCPUBackend"], "tokens": [1], "copy": "yes"},
                   timeout=10)
    assert r.status_code == 400 and "copy" in r.json()["error"]
    r = httpx.get(url + "/move/nope", timeout=10)
    assert r.status_code == 404
    r = httpx.post(url + "/clear", json={"instance_id": "ghost"}, timeout=10)
    assert r.status_code == 400 and "ghost" in r.json()["error"]
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok", "instances": []}
    page = httpx.get(url + "/", timeout=10).text
    assert "No instance has registered yet" in page


@pytest.mark.parametrize("ports, msg", [
    ('{"pull": 1}', "needs a 'reply' port"),
    ("pull=1", "is not JSON"),
    ('{"pull": 1, "reply": 2, "web": 3}', "unknown key"),
    ('{"pull": 1, "reply": 70000}', "not a port number"),
])
def test_bad_monitor_ports_are_refused(ports: str, msg: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvferry.controller.server", "--monitor-ports", ports],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and msg in r.stderr
