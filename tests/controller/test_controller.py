"""kvferry-controller as a real process, with workers played by real ZMQ sockets (no vLLM):
registration, heartbeat expiry, longest-prefix lookups, resync after a controller restart,
refused duplicates, the HTTP API's errors, hostile frames that must not stop it, the cluster
secret on its ZMQ ports and the admin key on its HTTP API."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvferry.common import secret, zsock
from kvferry.common.hashing import chunk_keys
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.controller.registry import RegistryError, WorkerRegistry
from kvferry.testing.store_servers import ControllerProcess
from tests.polling import until

SALT = b"test-salt"
CHUNK = 4
A, B = "a-cluster-secret-of-32-characters", "another-cluster-secret-entirely!"
ADMIN = "an-admin-key-of-some-length"
# The controller processes must not pick up a secret from the environment the tests run in.
NO_ENV_SECRET = {k: v for k, v in os.environ.items()
                 if k not in ("KVFERRY_CLUSTER_SECRET", "KVFERRY_CLUSTER_SECRET_FILE", "KVFERRY_ADMIN_KEY")}


class FakeWorker:
    """One worker as the controller sees it: pushes reports, answers commands on its worker port."""

    def __init__(self, c: ControllerProcess, instance_id: str, timeout: float = 30.0,
                 trust: zsock.Trust = zsock.PLAIN) -> None:
        self.ctx = zmq.Context.instance()
        self.trust = trust
        self.push = zsock.connect(self.ctx, zmq.PUSH, trust, zsock.tcp("127.0.0.1", c.pull))
        # A PUSH whose CurveZMQ handshake failed has no peer, and a send then waits for one.
        self.push.setsockopt(zmq.SNDTIMEO, 1000)
        self.port = free_port()
        self.commands = zsock.listen(self.ctx, zmq.ROUTER, trust, "127.0.0.1", self.port, "fake worker port")
        self.info = m.WorkerInfo(instance_id=instance_id, worker_id=0, epoch=f"e-{self.port}", host="127.0.0.1",
                                 worker_port=self.port, p2p_init_port=free_port(), p2p_lookup_port=free_port(),
                                 salt=SALT, chunk_size=CHUNK, partial_chunks=True, heartbeat_timeout=timeout,
                                 cpu_capacity=1 << 30)

    def send(self, msg: m.Msg) -> bool:
        """False when the frame could not even be queued (no peer took this socket's handshake)."""
        try:
            self.push.send(m.encode(msg))
            return True
        except zmq.Again:
            return False

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
def controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    c = ControllerProcess(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def keys(tokens: list[int]) -> list[bytes]:
    return chunk_keys(tokens, CHUNK, SALT)


def lookup(c: ControllerProcess, ks: list[bytes], asker: str = "asker", trust: zsock.Trust = zsock.PLAIN,
           wait: float = 5.0) -> m.LookupResponse | None:
    """The controller's answer; None (only when `wait` is given short) when none came."""
    s = zsock.connect(zmq.Context.instance(), zmq.DEALER, trust, zsock.tcp("127.0.0.1", c.reply))
    s.setsockopt(zmq.SNDTIMEO, int(wait * 1000))
    try:
        try:
            s.send(m.encode(m.LookupRequest(instance_id=asker, keys=ks)))
        except zmq.Again:
            assert wait < 5.0, "the lookup could not be sent"
            return None
        if not s.poll(int(wait * 1000)):
            assert wait < 5.0, "no lookup answer"
            return None
        return m.decode(s.recv(), expect=m.LookupResponse)
    finally:
        s.close(linger=0)


def health(c: ControllerProcess) -> dict:
    return httpx.get(c.url + "/health", timeout=10).json()


def worker_info(instance_id: str, **kw: object) -> m.WorkerInfo:
    base = {"instance_id": instance_id, "worker_id": 0, "epoch": "e1", "host": "127.0.0.1", "worker_port": 9,
            "p2p_init_port": 9, "p2p_lookup_port": 9, "salt": SALT, "chunk_size": CHUNK, "partial_chunks": True,
            "heartbeat_timeout": 30.0}
    return m.WorkerInfo(**{**base, **kw})


def state(c: ControllerProcess) -> dict:
    return httpx.get(c.url + "/api/state", timeout=10).json()


def test_lookup_answers_the_longest_prefix_and_forgets_silent_instances(controller: ControllerProcess) -> None:
    tokens = list(range(100, 120))  # 5 chunks of 4
    ks = keys(tokens)
    a, b = FakeWorker(controller, "a", timeout=30.0), FakeWorker(controller, "b", timeout=30.0)
    c = FakeWorker(controller, "c", timeout=1.0)
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
        # c heartbeats once and goes silent: dropped after its 1 s timeout, while a and b
        # (heartbeating, with 30 s timeouts) stay.
        def listed() -> list[str]:
            return sorted(i["instance_id"] for i in state(controller)["instances"])

        until(lambda: c.heartbeat() or "c" in listed(), what="c registered")  # until seen: 1 s is short

        def only_c_dropped() -> bool:
            a.heartbeat()
            b.heartbeat()
            return listed() == ["a", "b"]

        until(only_c_dropped, 60, what=lambda: f"c dropped while a and b stay; listed {listed()}", every=0.2)
        assert "no heartbeat for" in controller.log.read_text()
    finally:
        for w in (a, b, c):
            w.close()


def test_a_restarted_controller_asks_workers_to_resync(controller: ControllerProcess, tmp_path: Path) -> None:
    ks = keys(list(range(8)))
    w = FakeWorker(controller, "a")
    try:
        w.heartbeat()
        w.admit(ks)
        until(lambda: lookup(controller, ks).num_chunks == 2, what="the admission")
        controller.stop()
        c2 = ControllerProcess(tmp_path, port=controller.port)
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


def test_a_second_process_cannot_take_a_live_instance_id(controller: ControllerProcess) -> None:
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


def test_http_errors_name_the_fix(controller: ControllerProcess) -> None:
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
    # A body that fails the API's typed models is a 400 naming the field, never FastAPI's 422 list.
    r = httpx.post(url + "/move", json={"old_position": [1, "LocalCPUBackend"],
                                        "new_position": ["y", "LocalCPUBackend"], "tokens": [1]}, timeout=10)
    assert r.status_code == 400 and "old_position must be [instance_id, location]" in r.json()["error"]
    r = httpx.post(url + "/lookup", json=[1, 2], timeout=10)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]
    r = httpx.post(url + "/lookup", json={"tokens": [True]}, timeout=10)
    assert r.status_code == 400 and "/tokenize" in r.json()["error"]
    r = httpx.post(url + "/clear", json={"instance_id": 3}, timeout=10)
    assert r.status_code == 400 and "instance_id must be a string" in r.json()["error"]
    r = httpx.post(url + "/clear", json={"location": "disk"}, timeout=10)
    assert r.status_code == 400 and "use \"LocalCPUBackend\"" in r.json()["error"]
    # As before, a JSON body is read whatever its Content-Type (curl -d sends a form type).
    r = httpx.post(url + "/lookup", content=b'{"tokens": [1]}',
                   headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=10)
    assert r.status_code == 200 and r.json()["layout_info"] == {}
    # A browser's POST from another site is refused (the body is read as JSON whatever its type);
    # one from the controller's own page passes.
    for hdrs in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
        r = httpx.post(url + "/clear", content=b'{}', headers={"Content-Type": "text/plain", **hdrs}, timeout=10)
        assert r.status_code == 403 and "cross-site" in r.json()["error"], hdrs
    r = httpx.post(url + "/lookup", json={"tokens": [1]}, headers={"Origin": url}, timeout=10)
    assert r.status_code == 200
    r = httpx.get(url + "/move/nope", timeout=10)
    assert r.status_code == 404 and "event_id 'nope'" in r.json()["error"]
    r = httpx.delete(url + "/move", timeout=10)
    assert r.status_code == 405 and r.json()["error"]
    r = httpx.post(url + "/clear", json={"instance_id": "ghost"}, timeout=10)
    assert r.status_code == 400 and "ghost" in r.json()["error"]
    h = health(controller)
    assert h["status"] == "ok" and h["instances"] == []
    assert set(h["loops"]) == {"pull", "heartbeat", "reply", "sweep"} and all(v["ok"] for v in h["loops"].values())
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


def test_bad_frames_and_messages_that_cannot_apply_do_not_stop_the_controller(controller: ControllerProcess) -> None:
    """Each of these used to be able to end the pull loop (an unobserved task exception) or, once
    registered, break lookups for everyone; now each is logged, counted, and the controller goes on."""
    junk = zmq.Context.instance().socket(zmq.PUSH)
    junk.connect(f"tcp://127.0.0.1:{controller.pull}")
    hb = zmq.Context.instance().socket(zmq.PUSH)
    hb.connect(f"tcp://127.0.0.1:{controller.heartbeat}")
    k = keys(list(range(8)))
    try:
        junk.send(b"\x00garbage")
        # Decodes on the old protocol, where it raised inside handle() (zip(strict=True)).
        junk.send(msgspec.msgpack.encode({"t": "admit", "v": m.PROTOCOL_VERSION, "instance_id": "x", "worker_id": 0,
                                          "epoch": "e1", "location": "LocalCPUBackend", "keys": k, "sizes": [1]}))
        # Decode fine, cannot be applied: a rank beyond its TP size; chunk_size 0 (once registered, it
        # made POST /lookup fail for every instance); a TP size no LookupResponse can name.
        junk.send(m.encode(m.RegisterWorker(worker=worker_info("rank", worker_id=3, tp_size=2))))
        hb.send(m.encode(m.Heartbeat(worker=worker_info("zero", chunk_size=0), num_chunks=0, used_bytes=0)))
        junk.send(m.encode(m.RegisterWorker(worker=worker_info("huge", tp_size=1 << 20))))
        until(lambda: health(controller)["counters"]["rejected_messages"] >= 3, what="the rejected registrations")
        h = health(controller)
        assert h["counters"]["bad_frames"] >= 2 and h["status"] == "ok", h
        assert all(v["ok"] and v["restarts"] == 0 for v in h["loops"].values()), h["loops"]
        log = controller.log.read_text()
        assert "dropped a bad message on the pull port" in log
        # Rate-limited: the first of them is logged (which one depends on the two ports' order).
        assert re.search(r"dropped a (RegisterWorker|Heartbeat) from instance '(rank|zero|huge)' on the "
                         r"(pull|heartbeat) port: instance \S+ worker \d+: (worker id|chunk_size)", log), log
        assert "Traceback" not in log
        # The same controller still registers workers, indexes their chunks and answers lookups.
        w = FakeWorker(controller, "good")
        try:
            w.heartbeat()
            w.admit(k)
            until(lambda: lookup(controller, k).num_chunks == 2, what="the good worker's chunks")
            assert [i["instance_id"] for i in state(controller)["instances"]] == ["good"]
            r = httpx.post(controller.url + "/lookup", json={"tokens": list(range(8))}, timeout=10)
            assert r.status_code == 200 and r.json()["layout_info"] == {"good": ["LocalCPUBackend", 8]}
        finally:
            w.close()
    finally:
        junk.close(linger=0)
        hb.close(linger=0)


def test_the_registry_is_bounded() -> None:
    reg = WorkerRegistry(max_workers=2, max_chunks_per_worker=3, max_chunks=4)
    assert reg.register(worker_info("a")) and reg.register(worker_info("b"))
    with pytest.raises(RegistryError, match="already tracks 2 workers"):
        reg.register(worker_info("c"))
    assert reg.register(worker_info("a", epoch="e2")), "a restart replaces its old self within the bound"

    def admit(iid: str, ks: list[bytes], epoch: str = "e1", reset: bool = False) -> None:
        reg.admit(m.ChunkAdmit(instance_id=iid, worker_id=0, epoch=epoch, location="LocalCPUBackend", keys=ks,
                               sizes=[10] * len(ks), reset=reset))

    ks = [bytes([i]) * 16 for i in range(8)]
    with pytest.raises(RegistryError, match="1 chunk.* left out"):
        admit("a", ks[:4], epoch="e2")
    a = reg.worker("a", 0, "e2")
    assert len(a.chunks) == 3 and a.capped and reg.indexed == 3
    with pytest.raises(RegistryError, match="left out"):
        admit("b", ks[4:6])  # one fits under the total bound of 4
    assert len(reg.worker("b", 0, "e1").chunks) == 1 and reg.indexed == 4
    admit("a", ks[:2], epoch="e2", reset=True)  # a resync starts its count again
    assert reg.indexed == 3 and not a.capped
    reg.deregister("b", 0, "e1")
    assert reg.indexed == 2 and reg.num_workers == 1
    assert reg.lookup(ks).num_chunks == 2


def test_with_a_cluster_secret_only_workers_holding_it_get_through(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    secret.write_file(str(path), A)
    good_t = zsock.Trust(secret.from_text(A, "test"))
    c = ControllerProcess(tmp_path, secret_file=path)
    good = FakeWorker(c, "good", trust=good_t)
    wrong = FakeWorker(c, "wrong", trust=zsock.Trust(secret.from_text(B, "test")))
    plain = FakeWorker(c, "plain")
    k = keys(list(range(8)))
    try:
        # A worker the controller does not know, holding chunks: it is asked to resync, over CurveZMQ.
        good.heartbeat(num_chunks=2)
        assert isinstance(good.command(), m.Resync)
        good.admit(k, reset=True)
        ans = until(lambda: (r := lookup(c, k, trust=good_t)).num_chunks == 2 and r, what="the good worker")
        assert ans.instance_id == "good"
        for w in (wrong, plain):
            w.heartbeat(num_chunks=2)
            w.admit(k)
            assert lookup(c, k, trust=w.trust, wait=1.5) is None, "a worker without the secret got an answer"
        assert not wrong.commands.poll(200) and not plain.commands.poll(200)
        assert [i["instance_id"] for i in state(c)["instances"]] == ["good"]
        h = health(c)
        assert h["counters"]["bad_frames"] == 0, "CurveZMQ drops them before a frame reaches the controller"
        assert lookup(c, k, trust=good_t).instance_id == "good"
    finally:
        for w in (good, wrong, plain):
            w.close()
        c.stop()


def test_the_admin_key_guards_everything_but_health(tmp_path: Path) -> None:
    c = ControllerProcess(tmp_path, admin_key=ADMIN)
    try:
        url = c.url
        guarded = [("POST", "/move", {"tokens": [1]}), ("POST", "/clear", {}), ("GET", "/api/state", None),
                   ("GET", "/", None), ("GET", "/move/nope", None), ("POST", "/lookup", {"tokens": [1]}),
                   ("POST", "/check_finish", {"event_id": "x"})]
        wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {ADMIN}x"},
                 {"Authorization": ADMIN}]
        for method, path, body in guarded:
            for headers in wrong:
                r = httpx.request(method, url + path, json=body, headers=headers, timeout=10)
                assert r.status_code == 401, (path, headers, r.status_code)
                assert r.headers["WWW-Authenticate"] == 'Basic realm="kvferry-controller"'
                assert "--admin-key" in r.json()["error"]
            r = httpx.request(method, url + path, json=body, auth=("admin", "wrong"), timeout=10)
            assert r.status_code == 401
        bearer = {"Authorization": f"Bearer {ADMIN}"}
        for method, path, body in guarded:
            assert httpx.request(method, url + path, json=body, headers=bearer, timeout=10).status_code != 401, path
        for auth in ({"headers": bearer}, {"auth": ("anyone", ADMIN)}):  # Basic: what a browser sends
            assert httpx.get(url + "/api/state", timeout=10, **auth).status_code == 200
            assert "kvferry controller" in httpx.get(url + "/", timeout=10, **auth).text
            r = httpx.post(url + "/clear", json={}, timeout=10, **auth)
            assert r.status_code == 200 and r.json()["status"] == "done"
            r = httpx.post(url + "/move", json={"old_position": ["x", "LocalCPUBackend"], "tokens": [1],
                                                "new_position": ["y", "LocalCPUBackend"]}, timeout=10, **auth)
            assert r.status_code == 400 and "not registered" in r.json()["error"]  # through the key, to the API
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert health(c)["counters"]["unauthorized_http"] >= len(guarded) * (len(wrong) + 1)
    finally:
        c.stop()


def _controller_exits(*args: str) -> subprocess.CompletedProcess:
    ports = f'{{"pull": {free_port()}, "reply": {free_port()}}}'
    return subprocess.run([sys.executable, "-m", "kvferry.controller.server", "--port", str(free_port()),
                           "--monitor-ports", ports, *args], capture_output=True, text=True, timeout=60,
                          env=NO_ENV_SECRET)


def test_require_cluster_secret_refuses_an_exposed_controller_in_one_line(tmp_path: Path) -> None:
    r = _controller_exits("--host", "0.0.0.0", "--require-cluster-secret")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--cluster-secret-file" in r.stderr and "beyond loopback" in r.stderr
    path = tmp_path / "secret"
    secret.write_file(str(path), A)
    r = _controller_exits("--host", "0.0.0.0", "--require-cluster-secret", "--cluster-secret-file", str(path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--admin-key" in r.stderr
    r = _controller_exits("--cluster-secret-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot read the cluster secret file" in r.stderr


def test_openapi_describes_every_endpoint_and_docs_answer(tmp_path: Path) -> None:
    c = ControllerProcess(tmp_path)
    try:
        spec = httpx.get(c.url + "/openapi.json", timeout=10).json()
        assert {p: set(ops) for p, ops in spec["paths"].items()} == {
            "/": {"get"}, "/api/state": {"get"}, "/health": {"get"}, "/lookup": {"post"}, "/move": {"post"},
            "/move/{event_id}": {"get"}, "/check_finish": {"post"}, "/clear": {"post"}}
        move = spec["paths"]["/move"]["post"]
        body = move["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert set(spec["components"]["schemas"][body]["properties"]) == {"tokens", "copy", "old_position",
                                                                          "new_position"}
        assert {"200", "400", "401"} <= set(move["responses"])
        r = httpx.get(c.url + "/docs", timeout=10)
        assert r.status_code == 200 and "swagger" in r.text.lower() and "/openapi.json" in r.text
    finally:
        c.stop()
    assert c.proc.returncode == 0, "SIGTERM must stop the controller cleanly"


def test_docs_and_admin_routes_need_the_admin_key(tmp_path: Path) -> None:
    key = ADMIN + "-ключ"  # non-ASCII: matched on the header's UTF-8 bytes
    c = ControllerProcess(tmp_path, admin_key=key)
    try:
        for path in ("/docs", "/openapi.json"):
            assert httpx.get(c.url + path, timeout=10).status_code == 401, path
            assert httpx.get(c.url + path, auth=("admin", key), timeout=10).status_code == 200, path
            r = httpx.get(c.url + path, headers={"Authorization": f"Bearer {key}".encode()}, timeout=10)
            assert r.status_code == 200, path
        for path in ("/move", "/clear"):
            r = httpx.post(c.url + path, json={"tokens": [1]}, timeout=10)
            assert r.status_code == 401 and "--admin-key" in r.json()["error"], path
            r = httpx.post(c.url + path, json={"tokens": [1]}, headers={"Authorization": "Bearer client-key"},
                           timeout=10)
            assert r.status_code == 401, path
    finally:
        c.stop()
    assert c.proc.returncode == 0
