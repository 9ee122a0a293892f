"""P2P sharing between two real vLLM CPU instances through kvferry-controller over real NIXL
(LMCache's P2P walk-through, the controller's move, the controller's page, a chunk changed in a holder's
CPU tier after its MAC was made, a killed instance). The cluster runs with a cluster secret, as
`kvferry up` makes one: every port speaks CurveZMQ and every lent chunk carries a keyed MAC.

Float32 for the same reason as tests/e2e/test_offload_vllm.py: loaded and computed paths then agree
to 1e-4 in every logprob. The instance-killing test runs last (it takes instance 1 down).
"""

from __future__ import annotations

import ast
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import zmq

from kvferry.buffer.nixl_agent import make_agent
from kvferry.common import secret as csecret
from kvferry.common import zsock
from kvferry.common.hashing import chunk_keys
from kvferry.common.wire import messages as m
from kvferry.engine.offload.ops import offload_salt
from kvferry.testing.store_servers import ControllerProcess
from kvferry.testing.vllm_servers import OffloadServer, p2p_keys
from tests.pd_helpers import completion, prom, source_tokens, tier_value, tokens_and_logprobs
from tests.polling import until

FP32 = ["--dtype", "float32", "--no-enable-prefix-caching"]
HEARTBEAT, HEARTBEAT_TIMEOUT = 0.5, 3.0
_seed = iter(range(20_000, 30_000))


def prompt(n: int = 1000) -> list[int]:
    rng = random.Random(next(_seed))
    return [rng.randrange(10, 4000) for _ in range(n)]


@dataclass
class Setup:
    controller: ControllerProcess
    one: OffloadServer
    two: OffloadServer
    secret: str
    one_p2p: dict[str, object]  # instance 1's P2P keys (its ports)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.controller.url + path, json=body, timeout=30)

    def holders(self, p: list[int]) -> dict[str, int]:
        r = self.post("/lookup", {"tokens": p})
        assert r.status_code == 200, r.text
        return {k: v[1] for k, v in r.json()["layout_info"].items()}

    def wait_holders(self, p: list[int], want: dict[str, int], timeout: float = 10.0) -> None:
        """Until the controller's index says `want` (reports are asynchronous)."""
        until(lambda: self.holders(p) == want, timeout,
              lambda: f"controller lookup to say {want} (says {self.holders(p)})", every=0.1)

    def move(self, p: list[int], copy: bool) -> dict:
        r = self.post("/move", {"old_position": ["instance_1", "LocalCPUBackend"],
                                "new_position": ["instance_2", "LocalCPUBackend"], "tokens": p, "copy": copy})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["num_tokens"] == len(p)

        def event() -> dict:
            return httpx.get(f"{self.controller.url}/move/{body['event_id']}", timeout=10).json()
        return until(lambda: (ev := event())["status"] in ("done", "failed") and ev, 30,
                     lambda: f"move {body['event_id']} to end (still {event()['status']})", every=0.1)


def log(server: OffloadServer) -> str:
    return server.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def setup(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("p2p")
    text = csecret.generate()
    csecret.write_file(str(work / "cluster.secret"), text)
    controller = ControllerProcess(work, secret_file=work / "cluster.secret")
    servers: list[OffloadServer] = []
    keys = [p2p_keys(), p2p_keys()]
    try:
        for name, core, p2p in (("instance_1", "0", keys[0]), ("instance_2", "1", keys[1])):
            servers.append(OffloadServer(
                str(tiny_model_path), log_dir, core, work, server={"extra_args": FP32}, local_cpu=True,
                max_local_cpu_size=0.25, blocking_timeout_secs=3.0, lmcache_worker_heartbeat_time=HEARTBEAT,
                lmcache_worker_heartbeat_timeout=HEARTBEAT_TIMEOUT, **p2p, **controller.worker_keys(name),
            ).start())
        for s in servers:
            s.wait_ready()
        yield Setup(controller, *servers, text, keys[0])
    finally:
        for s in servers:
            s.stop()
        controller.stop()


def test_second_instance_retrieves_the_prompt_from_the_first(setup: Setup) -> None:
    """LMCache's P2P walk-through: a long prompt on instance 1, then on instance 2."""
    one, two = setup.one, setup.two
    p = prompt(1000)
    want = tokens_and_logprobs(completion(one, p, 8))
    setup.wait_holders(p, {"instance_1": len(p)})
    src0 = source_tokens(two)
    got = tokens_and_logprobs(completion(two, p, 8))
    loaded = len(p) - 1  # four chunks, the last partial; vLLM computes the last token itself
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    assert "Established connection to peer_init_url 127.0.0.1:" in log(two)
    assert f"Retrieved {loaded} out of {loaded} required tokens (from {len(p)} total tokens)" in log(two)
    assert "chunks: 4 from p2p" in log(two)
    src = source_tokens(two)
    assert src["external_kv_transfer"] - src0.get("external_kv_transfer", 0) == loaded
    cached = prom(two, "vllm:prompt_tokens_cached_by_source_total")
    assert sum(v for k, v in cached.items() if 'source="p2p"' in k) >= loaded
    until(lambda: tier_value(two, "kvferry:cache_hit_tokens_total", "p2p") >= loaded, 10,
          "kvferry:cache_hit_tokens_total{tier=p2p} to count the load", every=0.5)
    assert sum(prom(two, "kvferry:p2p_read_bytes_total").values()) >= 4 * (8 << 20) - (8 << 20)
    # vLLM collects a worker's counters in its steps: instance 1 reports what it lent in its next one.
    completion(one, prompt(20), 1)
    until(lambda: sum(prom(one, "kvferry:p2p_served_chunks_total").values()) >= 4, 10,
          "kvferry:p2p_served_chunks_total to count the lent chunks", every=0.5)
    # Instance 2 promoted what it fetched: the controller now lists both.
    setup.wait_holders(p, {"instance_1": len(p), "instance_2": len(p)})


def test_move_without_copy_hands_the_prompt_to_instance_2(setup: Setup) -> None:
    one, two = setup.one, setup.two
    p = prompt(1000)
    want = tokens_and_logprobs(completion(one, p, 8))
    setup.wait_holders(p, {"instance_1": len(p)})
    ev = setup.move(p, copy=False)
    assert ev["status"] == "done", ev
    # copy false: instance 1 dropped it; the controller lists instance 2 only.
    setup.wait_holders(p, {"instance_2": len(p)})
    n_p2p = log(two).count("from p2p")
    got = tokens_and_logprobs(completion(two, p, 8))
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    # A local hit: instance 2's scheduler adopted the moved chunks into its CPU index.
    assert "chunks: 4 from cpu" in log(two).rsplit("Retrieved", 1)[1]
    assert log(two).count("from p2p") == n_p2p
    # Instance 1's scheduler forgot them: its next run of the prompt fetches them back from instance 2.
    got = tokens_and_logprobs(completion(one, p, 8))
    assert got[0] == want[0]
    assert "chunks: 4 from p2p" in log(one).rsplit("Retrieved", 1)[1]


def test_move_with_copy_keeps_both(setup: Setup) -> None:
    p = prompt(600)
    completion(setup.one, p, 4)
    setup.wait_holders(p, {"instance_1": len(p)})
    ev = setup.move(p, copy=True)
    assert ev["status"] == "done" and ev["nbytes"] > 0, ev
    setup.wait_holders(p, {"instance_1": len(p), "instance_2": len(p)})
    completion(setup.two, p, 4)
    assert "chunks: 3 from cpu" in log(setup.two).rsplit("Retrieved", 1)[1]


def test_bad_move_requests_name_the_fix(setup: Setup) -> None:
    r = setup.post("/move", {"old_position": ["instance_9", "LocalCPUBackend"],
                             "new_position": ["instance_2", "LocalCPUBackend"], "tokens": [1, 2, 3]})
    assert r.status_code == 400 and "instance_9" in r.json()["error"] and "lmcache_instance_id" in r.json()["error"]
    r = setup.post("/move", {"old_position": ["instance_1", "LocalDiskBackend"],
                             "new_position": ["instance_2", "LocalCPUBackend"], "tokens": [1, 2, 3]})
    assert r.status_code == 400 and "LocalCPUBackend" in r.json()["error"]
    r = setup.post("/move", {"old_position": ["instance_1", "LocalCPUBackend"],
                             "new_position": ["instance_2", "LocalCPUBackend"], "tokens": "hello"})
    assert r.status_code == 400 and "/tokenize" in r.json()["error"]
    # Nothing held: nothing to move, done at once.
    r = setup.post("/move", {"old_position": ["instance_1", "LocalCPUBackend"],
                             "new_position": ["instance_2", "LocalCPUBackend"], "tokens": prompt(300)})
    assert r.status_code == 200 and r.json()["num_tokens"] == 0


def test_web_page_lists_both_instances(setup: Setup, log_dir: Path) -> None:
    exe = shutil.which("chromium-headless-shell") or shutil.which("chromium")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium-headless-shell not found: `make chromium` installs it")
        pytest.skip("chromium-headless-shell not found (make chromium)")
    shot = log_dir / "controller-page.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,800"]
    subprocess.run([exe, *flags, f"--screenshot={shot}", setup.controller.url + "/"], check=True, timeout=60,
                   capture_output=True)
    dom = subprocess.run([exe, *flags, "--dump-dom", setup.controller.url + "/"], check=True, timeout=60,
                         capture_output=True, text=True).stdout
    assert shot.stat().st_size > 10_000  # a rendered page, not an error stub
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("instance_1", "instance_2"):
        assert f"<b class=\"instance\">{name}</b>" in dom
    assert "LocalCPUBackend" in dom and "Recent transfers" in dom
    assert "<td>p2p</td>" in dom and "<td>move</td>" in dom  # the retrieval and the moves are listed


def _holder_fingerprint(sock: zmq.Socket) -> m.LayoutFingerprint:
    """The holder's KV layout, from the refusal of a Hello with a layout that matches nothing
    (the refusal names both sides' fields, as users see it)."""
    probe = m.LayoutFingerprint(model="?", dtype="?", num_layers=0, num_kv_heads=0, head_size=0, block_size=0,
                                kv_layout="?", chunk_format="?", chunk_size=0, tp_size=0, page_bytes=0)
    sock.send(m.encode(m.Hello(peer_id="probe", agent_name="probe", agent_metadata=b"", fingerprint=probe)))
    assert sock.poll(10_000), "the holder did not answer the handshake"
    err = m.decode(sock.recv(), expect=m.ErrorReply)
    text = re.search(r"holder: LayoutFingerprint\((.*?)\); reader:", err.message).group(1)
    return m.LayoutFingerprint(**{k: ast.literal_eval(v)
                                  for k, v in re.findall(r"(\w+)=('(?:[^'\\]|\\.)*'|\d+)", text)})


def _overwrite_a_lent_chunk(setup: Setup, tokens: list[int], chunk: int) -> None:
    """What anyone holding instance 1's NIXL metadata can do (NIXL's data plane has no
    authentication): lease a chunk as a reader would, then WRITE into it instead of READing."""
    p2p = setup.one_p2p
    trust = zsock.Trust(csecret.from_text(setup.secret, "test"))
    ctx = zmq.Context()
    agent = make_agent(f"vandal-{os.getpid()}")
    junk = torch.full((4096,), 0x5A, dtype=torch.uint8)
    reg = agent.register_memory(junk)
    try:
        init = zsock.connect(ctx, zmq.DEALER, trust, zsock.tcp("127.0.0.1", p2p["p2p_init_ports"]))
        fp = _holder_fingerprint(init)
        init.send(m.encode(m.Hello(peer_id="vandal", agent_name=agent.name, agent_metadata=agent.get_agent_metadata(),
                                   fingerprint=fp)))
        assert init.poll(10_000)
        name = agent.add_remote_agent(m.decode(init.recv(), expect=m.Welcome).agent_metadata)
        salt = offload_salt(fp.model, fp.dtype, fp.num_layers, fp.num_kv_heads, fp.head_size, fp.block_size,
                            fp.chunk_size, fp.tp_size)
        key = chunk_keys(tokens, fp.chunk_size, salt)[chunk]
        look = zsock.connect(ctx, zmq.DEALER, trust, zsock.tcp("127.0.0.1", p2p["p2p_lookup_ports"]))
        look.send(m.encode(m.PeerFetch(request_id="r1", agent_name=agent.name, keys=[key])))
        assert look.poll(10_000)
        lease = m.decode(look.recv(), expect=m.PeerChunks)
        assert len(lease.addrs) == 1 and len(lease.tags) == 1, "instance 1 does not hold the chunk, or sent no MAC"
        for md in lease.metadata:
            agent.add_remote_agent(md)
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(junk.data_ptr(), 4096, 0)], "DRAM"),
                                  agent.get_xfer_descs([(lease.addrs[0] + lease.sizes[0] // 2, 4096, 0)], "DRAM"),
                                  name)
        state = agent.transfer(h)
        if state == "PROC":  # the lease keeps the holder's NIXL progressing
            state = until(lambda: (st := agent.check_xfer_state(h)) != "PROC" and st, 20, "the WRITE to end",
                          every=0.001)
        agent.release_xfer_handle(h)
        assert state == "DONE", f"the WRITE into instance 1's CPU tier ended {state}"
        look.send(m.encode(m.PeerRelease(lease_id=lease.lease_id)))
    finally:
        agent.deregister_memory(reg)
        ctx.destroy(linger=0)


def test_a_chunk_changed_after_its_mac_is_a_counted_miss_and_recomputed(setup: Setup) -> None:
    one, two = setup.one, setup.two
    p = prompt(1000)
    want = tokens_and_logprobs(completion(one, p, 8))
    setup.wait_holders(p, {"instance_1": len(p)})
    _overwrite_a_lent_chunk(setup, p, 1)
    rejected0 = sum(prom(two, "kvferry:p2p_rejected_total").values())
    loads0 = log(two).count("from p2p")
    got = tokens_and_logprobs(completion(two, p, 8))
    assert got[0] == want[0], "the recomputed answer differs"
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    assert log(two).count("from p2p") == loads0, "instance 2 loaded the changed chunk"
    assert "failed the cluster-secret MAC" in log(two)
    # vLLM collects a worker's counters in its steps: one more request reports them.
    completion(two, prompt(20), 1)
    until(lambda: sum(prom(two, "kvferry:p2p_rejected_total").values()) >= rejected0 + 1, 10,
          "kvferry:p2p_rejected_total to count the MAC failure", every=0.5)


def test_killed_instance_is_dropped_and_its_prompts_recomputed(setup: Setup) -> None:
    one, two = setup.one, setup.two
    p = prompt(1000)
    want = tokens_and_logprobs(completion(one, p, 8))
    setup.wait_holders(p, {"instance_1": len(p)})
    os.killpg(one.proc.pid, signal.SIGKILL)
    one.proc.wait(timeout=30)
    killed = time.time()
    # Meanwhile instance 2 still gets instance 1 from the controller, fails to fetch (bounded by
    # blocking_timeout_secs, 3 s) and recomputes: the same answer. A fetch from the dead peer
    # without that bound would hold the request until the client's 300 s timeout.
    t0 = time.monotonic()
    got = tokens_and_logprobs(completion(two, p, 8))
    assert time.monotonic() - t0 < 60
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3

    def failed() -> list[dict]:  # instance 2's failed fetches from instance 1 since the kill (its transfer reports)
        state = httpx.get(setup.controller.url + "/api/state", timeout=10).json()
        return [t for t in state["transfers"] if t["kind"] == "p2p" and t["from"] == "instance_1"
                and t["to"] == "instance_2" and not t["ok"] and t["at"] >= killed]
    # The fetch's own clock: it gave up on its 3 s bound (the request's recompute not counted), far
    # from the 10 s of the default blocking_timeout_secs.
    fetches = until(failed, 60, "instance 2's report of its failed fetch", every=0.2)
    assert all(f["ms"] < 2 * 3.0e3 for f in fetches), fetches
    # After the heartbeat timeout the controller forgets instance 1 (its log says why).
    until(lambda: "instance_1" not in httpx.get(setup.controller.url + "/health", timeout=10).json()["instances"],
          60, "the controller to forget the killed instance", every=0.2)
    assert "instance_1" not in setup.holders(p)
    assert "no heartbeat for" in setup.controller.log.read_text()
    # Instance 2 kept what it computed; later requests hit its own CPU tier.
    completion(two, p, 4)
    assert "from cpu" in log(two).rsplit("Retrieved", 1)[1]
