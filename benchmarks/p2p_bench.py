"""Time to first token on instance 2 for a long prompt, cold vs fetched from instance 1 over P2P,
and the P2P retrieval rate next to raw NIXL between two processes on the same cores.

    python benchmarks/p2p_bench.py --json [--rounds 5] [--prompt-tokens 3000] [--cluster-secret]
    python benchmarks/p2p_bench.py --json --mac-only [--mac-rounds 15] [--mac-chunks 12]

kvferry-controller and two kv_both vLLM servers (tiny model, bf16, vLLM's prefix cache off;
instance 1 on core 0, instance 2 on core 1) with LMCache's P2P keys. After a warm-up (a prompt on
each, then one P2P fetch, which makes instance 2's NIXL handshake with instance 1), each round,
with fresh random prompts P and Q:

  cold(Q)   Q on instance 2: computed
  P on instance 1 (computed and stored), then, once the controller lists it,
  p2p(P)    P on instance 2: fetched from instance 1's CPU tier over NIXL

TTFT is the first streamed token of a max_tokens=2 request (medians). `p2p_gbps` is each P2P
retrieval as instance 2 reports it to the controller: bytes / (lookup on the peer + lease + NIXL
READ into slots of its CPU tier). `raw_nixl_gbps`: two plain processes pinned to the same two
cores READ as many bytes in the same chunk-sized descriptors, each time from and into memory not
moved before (regions of one registration per side, touched, as kvferry's CPU tier is), driving
NIXL UCX progress the way kvferry does; `raw_nixl_reread_gbps`: the same pair READing one region
again and again (what this bench reported as raw before; no fetch of new KV does that). A new pair after each
round (one READ to connect, then `--raw-reps` of each), medians of
all: this VM's speed drifts by +-30 % within a minute (a baseline taken once compares badly), and
a pair kept running beside the servers measured half its fresh speed (3-4 vs 6-9 GB/s).
Target: p2p_gbps >= 0.8 x raw_nixl_gbps. With `--cluster-secret` every kvferry port (controller,
P2P handshake and leases) speaks CurveZMQ with a new cluster secret; its cost is the change of
`p2p_vs_raw` against a run without (the raw pair is the same in both).

The chunk MAC's cost (`mac_*`, also the whole output of `--mac-only`), side by side in one run:
three holder processes (core 0) lend the same 12 x 4 MiB chunks, one without a cluster secret, one
with it (tags made when a chunk enters its CPU tier), one with it making the tags at every lease;
a reader (core 1) gets all 12 from each in turn, the order rotating every round, as a request's
load does (lease, NIXL READ, checks; with the secret the reader verifies every tag). Medians:
`get_gbps_plain`, `get_gbps_mac`, `get_gbps_mac_tag_at_lease`; `mac_cost` = 1 - mac / plain
(target < 0.10); `mac_hash_gbps_one_core`: ChunkMAC on one 4 MiB chunk here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import httpx
import msgspec

from kvferry.common import secret
from kvferry.common.netutil import free_port
from kvferry.launcher import tiny_model
from kvferry.testing.store_servers import ControllerProcess
from kvferry.testing.vllm_servers import OffloadServer, p2p_keys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_bench import stream  # noqa: E402

CHUNK = 256
TOKEN_BYTES = 16 << 10  # bf16 tiny model: 8 layers x 8 KV heads x 64 x (K, V) x 2 bytes

MAX_RAW_HELLO = 4 << 20  # the raw pair's one message, decoded typed and bounded (never pickle from a socket)


class RawHolderHello(msgspec.Struct, frozen=True):
    """The raw pair's one message: the holder's NIXL metadata and its regions' descriptors."""

    metadata: Annotated[bytes, msgspec.Meta(max_length=1 << 20)]
    regions: Annotated[list[Annotated[list[tuple[int, int, int]], msgspec.Meta(max_length=1 << 12)]],
                       msgspec.Meta(max_length=1 << 10)]


def decode_raw_hello(frame: bytes) -> RawHolderHello:
    if len(frame) > MAX_RAW_HELLO:
        raise ValueError(f"raw NIXL holder sent {len(frame)} bytes (at most {MAX_RAW_HELLO})")
    return msgspec.msgpack.decode(frame, type=RawHolderHello)


def raw_role(role: str, port: int, sizes: list[int], regions: int, core: int) -> None:
    """One side of the raw NIXL measurement (a child process): `regions` copies of the chunks in
    one registration, touched. The reader takes "new|same <reps>" lines on stdin (READ regions
    1, 2, ... each once, or region 0 again and again) and answers each with a JSON list of GB/s;
    an empty line ends it."""
    import torch
    import zmq

    from kvferry.buffer.nixl_agent import make_agent
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    agent = make_agent(f"raw-{role}-{os.getpid()}")
    nbytes = sum(sizes)
    buf = torch.ones(regions * nbytes, dtype=torch.uint8)  # touched: no page faults in the transfer
    reg = agent.register_memory(buf)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def descs(region: int) -> list[tuple[int, int, int]]:
        return [(buf.data_ptr() + region * nbytes + o, n, 0) for o, n in zip(offsets, sizes, strict=True)]

    sock = zmq.Context.instance().socket(zmq.REP if role == "holder" else zmq.REQ)
    if role == "holder":
        sock.bind(f"tcp://127.0.0.1:{port}")
        sock.recv()
        sock.send(msgspec.msgpack.encode(RawHolderHello(agent.get_agent_metadata(),
                                                        [descs(r) for r in range(regions)])))
        while True:  # "go" ... "idle" brackets the reader's READs, as a lease does kvferry's
            if not sock.poll(120_000):  # the pair lives for one round's READs
                raise SystemExit("raw NIXL holder: the reader went silent")
            msg = sock.recv()
            sock.send(b"ok")
            if msg == b"done":
                break
            deadline = time.monotonic() + 120
            while msg == b"go" and not sock.poll(0):  # drive progress, as kvferry's holder does in a lease
                if time.monotonic() > deadline:
                    raise SystemExit("raw NIXL holder: the reader never said idle")
                agent.get_new_notifs()
                time.sleep(0.0002)
    else:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"hello")
        hello = decode_raw_hello(sock.recv())
        remote = hello.regions
        name = agent.add_remote_agent(hello.metadata)
        pairs = [(agent.get_xfer_descs(descs(r), "DRAM"), agent.get_xfer_descs(remote[r], "DRAM"))
                 for r in range(regions)]
        for line in sys.stdin:
            if not line.strip():
                break
            mode, reps = line.split()
            todo = [pairs[1 + i % (regions - 1)] if mode == "new" else pairs[0] for i in range(int(reps))]
            sock.send(b"go")
            sock.recv()
            rates = [nbytes / read_once(agent, local, rd, name) / 1e9 for local, rd in todo]
            sock.send(b"idle")
            sock.recv()
            print(json.dumps(rates), flush=True)
        sock.send(b"done")
        sock.recv()
    agent.deregister_memory(reg)


def read_once(agent, local, rdescs, name: str) -> float:
    """Seconds one NIXL READ takes, polled the way the bench's reader drives it."""
    t0 = time.perf_counter()
    h = agent.initialize_xfer("READ", local, rdescs, name)
    state = agent.transfer(h)
    deadline = time.monotonic() + 30
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.0002)
        state = agent.check_xfer_state(h)
    dt = time.perf_counter() - t0
    agent.release_xfer_handle(h)
    assert state == "DONE", state
    return dt


class RawNixl:
    """A raw NIXL pair of processes (one per round: see the module docstring)."""

    def __init__(self, sizes: list[int], regions: int) -> None:
        port = free_port()
        me = [sys.executable, __file__, "--raw-role"]
        args = [str(port), json.dumps(sizes), str(regions)]
        self.holder = subprocess.Popen([*me, "holder", *args, "0"], stderr=subprocess.DEVNULL)
        self.reader = subprocess.Popen([*me, "reader", *args, "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True)

    def measure(self, mode: str, reps: int, timeout: float = 120.0) -> list[float]:
        self.reader.stdin.write(f"{mode} {reps}\n")
        self.reader.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:  # NIXL logs to stdout too: the answer is the line holding a JSON list
            if not select.select([self.reader.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise RuntimeError(f"the raw NIXL reader did not answer in {timeout:.0f} s")
            line = self.reader.stdout.readline()
            if not line:
                raise RuntimeError("the raw NIXL reader exited")
            if line.startswith("["):
                return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.stdin.write("\n")
            self.reader.stdin.close()
        for p in (self.reader, self.holder):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # e.g. the reader failed: nothing releases the holder
                p.kill()
                p.wait(timeout=10)


# ---- get throughput with and without the chunk MAC (no vLLM: P2P services in their own processes)
MAC_CHUNK = CHUNK * TOKEN_BYTES  # 4 MiB


def _mac_worker(name: str, secret_text: str | None, nchunks: int):
    from kvferry.common.config import KVFerryConfig
    from kvferry.common.wire import messages as m
    from kvferry.engine.p2p.service import P2PService
    from kvferry.engine.tiers.cpu import CPUTier
    fp = m.LayoutFingerprint(model="p2p-bench", dtype="bfloat16", num_layers=8, num_kv_heads=8, head_size=64,
                             block_size=16, kv_layout="cpu", chunk_format="block", chunk_size=CHUNK,
                             page_bytes=MAC_CHUNK)
    cfg = KVFerryConfig(enable_p2p=True, enable_controller=True, p2p_host="127.0.0.1", p2p_init_ports=free_port(),
                        p2p_lookup_ports=free_port(), lmcache_worker_ports=free_port(), lmcache_instance_id=name,
                        controller_pull_url=f"127.0.0.1:{free_port()}",
                        controller_reply_url=f"127.0.0.1:{free_port()}", blocking_timeout_secs=10.0,
                        cluster_secret=secret_text)
    cpu = CPUTier(capacity=(nchunks + 2) * MAC_CHUNK, slot_bytes=MAC_CHUNK)
    return P2PService(cfg, cpu, 0, 1, b"p2p-bench", fp, f"ipc://@kvferry-p2p-bench-{name}-{os.getpid()}")


def mac_holder(conn, name: str, secret_text: str | None, tag_at: str, nchunks: int, core: int) -> None:
    """A holder process lending `nchunks` random 4 MiB chunks; with `tag_at` "lease" every lease
    hashes its chunks (no tag made at store, none kept), as a lender that tags on demand would."""
    import torch
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    w = _mac_worker(name, secret_text, nchunks)
    if tag_at == "lease":
        w.lender.tag_on_store = False
        lend = w.lender._lend

        async def lend_untagged(msg):
            w.lender._tags.clear()
            return await lend(msg)
        w.lender._lend = lend_untagged
    keys = [f"bench-chunk-{i:04d}".encode() for i in range(nchunks)]
    for k in keys:
        t = w.cpu.alloc(MAC_CHUNK)
        t.copy_(torch.randint(0, 256, (MAC_CHUNK,), dtype=torch.uint8))
        w.cpu.put(k, t)
    want = nchunks if secret_text and tag_at == "store" else 0
    deadline = time.monotonic() + 60
    while w.lender.sizes()["tags"] < want and time.monotonic() < deadline:
        time.sleep(0.05)
    conn.send((w.info.p2p_init_port, w.info.p2p_lookup_port, keys))
    conn.poll(600)
    w.close()
    w.cpu.close()


def mac_bench(rounds: int, nchunks: int, reader_core: int = 1, holder_core: int = 0) -> dict:
    """Median get throughput (lease + NIXL READ + checks, as a request's load does) of `nchunks`
    x 4 MiB from a holder without a secret, with one (tags made at store), and with one making
    tags at each lease; the three in turn in every round, the order rotating."""
    from kvferry.common.wire import messages as m
    from kvferry.common.wire.chunk_mac import ChunkMAC
    text = secret.generate()
    configs = {"plain": None, "mac": "store", "mac_tag_at_lease": "lease"}
    ctx = mp.get_context("spawn")
    holders, conns = {}, {}
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {reader_core})
    readers = {}
    try:
        for label, tag_at in configs.items():
            a, b = ctx.Pipe()
            proc = ctx.Process(target=mac_holder, args=(b, f"holder-{label}", None if tag_at is None else text,
                                                        tag_at or "store", nchunks, holder_core), daemon=True)
            proc.start()
            if not a.poll(180):
                raise RuntimeError(f"the {label} holder did not start")
            init, look, keys = a.recv()
            holders[label] = (proc, m.PeerAddr(host="127.0.0.1", init_port=init, lookup_port=look), keys)
            conns[label] = a
        readers = {"plain": _mac_worker("reader-plain", None, nchunks),
                   "secret": _mac_worker("reader-secret", text, nchunks)}
        rates: dict[str, list[float]] = {k: [] for k in configs}
        labels = list(configs)
        for r in range(-2, rounds):  # two warm-up rounds (handshakes, first use of the registrations)
            for label in labels[r % 3:] + labels[:r % 3]:
                _, addr, keys = holders[label]
                reader = readers["plain" if configs[label] is None else "secret"]
                t0 = time.perf_counter()
                out = reader.fetch(f"holder-{label}", addr, keys, [MAC_CHUNK] * nchunks)
                dt = time.perf_counter() - t0
                if out is None:
                    raise RuntimeError(f"a {label} get failed (see the log)")
                del out
                if r >= 0:
                    rates[label].append(nchunks * MAC_CHUNK / dt / 1e9)
        mac = ChunkMAC(secret.from_text(text, "bench"))
        import torch
        data = memoryview(torch.randint(0, 256, (MAC_CHUNK,), dtype=torch.uint8).numpy())
        t0 = time.perf_counter()
        for _ in range(20):
            mac.tag(b"k" * 16, data)
        hash_gbps = 20 * MAC_CHUNK / (time.perf_counter() - t0) / 1e9
    finally:
        for w in readers.values():
            w.close()
            w.cpu.close()
        for a in conns.values():
            with contextlib.suppress(OSError):
                a.send("stop")
        for proc, _, _ in holders.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        os.sched_setaffinity(0, old)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["mac"] / med["plain"]
    return {"mac_chunk_bytes": MAC_CHUNK, "mac_chunks_per_get": nchunks, "mac_rounds": rounds,
            "get_gbps_plain": round(med["plain"], 3), "get_gbps_mac": round(med["mac"], 3),
            "get_gbps_mac_tag_at_lease": round(med["mac_tag_at_lease"], 3),
            "mac_vs_plain": round(ratio, 3), "mac_cost": round(1 - ratio, 3),
            "mac_tag_at_lease_vs_plain": round(med["mac_tag_at_lease"] / med["plain"], 3),
            "mac_hash_gbps_one_core": round(hash_gbps, 3), "mac_target_met": 1 - ratio < 0.10}


def transfers(c: ControllerProcess) -> list[dict]:
    return httpx.get(c.url + "/api/state", timeout=10).json()["transfers"]


def wait_held(c: ControllerProcess, p: list[int], instance: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while instance not in httpx.post(c.url + "/lookup", json={"tokens": p}, timeout=10).json()["layout_info"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the controller never listed {instance} for the prompt")
        time.sleep(0.05)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-role":
        role, port, sizes, regions, core = sys.argv[2:7]
        raw_role(role, int(port), json.loads(sizes), int(regions), int(core))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--raw-reps", type=int, default=4, help="raw NIXL READs after each round")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--cluster-secret", action="store_true", help="run the cluster with a cluster secret")
    ap.add_argument("--mac-only", action="store_true", help="only the get throughput with and without the MAC "
                    "(P2P services in their own processes, no vLLM)")
    ap.add_argument("--mac-rounds", type=int, default=15)
    ap.add_argument("--mac-chunks", type=int, default=12, help="4 MiB chunks per get")
    args = ap.parse_args()
    if args.rounds < 1 or args.raw_reps < 1 or args.mac_rounds < 1 or args.mac_chunks < 1:
        ap.error("--rounds, --raw-reps, --mac-rounds and --mac-chunks must be at least 1")
    if args.mac_only:
        result = mac_bench(args.mac_rounds, args.mac_chunks)
        print(json.dumps(result) if args.json else json.dumps(result, indent=1))
        return 0
    model = tiny_model.ensure()
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-p2p-bench-"))
    logs = Path(args.log_dir) if args.log_dir else tmp
    secret_file = None
    if args.cluster_secret:
        secret_file = tmp / "cluster.secret"
        secret.write_file(str(secret_file), secret.generate())
    controller = ControllerProcess(tmp, secret_file=secret_file)
    servers: list[OffloadServer] = []
    rng = random.Random(0)
    samples: dict[str, list[float]] = {"cold": [], "p2p": []}
    fetches: list[dict] = []
    nchunks = -(-args.prompt_tokens // CHUNK)
    sizes = [min(CHUNK, args.prompt_tokens - i * CHUNK) * TOKEN_BYTES for i in range(nchunks)]
    raw_pair: RawNixl | None = None
    raw: list[float] = []
    reread: list[float] = []
    try:
        for name, core in (("instance_1", "0"), ("instance_2", "1")):
            servers.append(OffloadServer(str(model), logs, core, tmp, local_cpu=True, max_local_cpu_size=2.0,
                                         server={"extra_args": ["--no-enable-prefix-caching"]},
                                         **p2p_keys(), **controller.worker_keys(name)).start())
        for s in servers:
            s.wait_ready(progress=not args.json)
        one, two = servers
        with httpx.Client() as client:
            for s in servers:
                stream(client, s, [rng.randrange(10, 4000) for _ in range(300)], 2)  # warm-up
            # and one P2P fetch: instance 2's handshake with instance 1 (once per pair of processes)
            w = [rng.randrange(10, 4000) for _ in range(600)]
            stream(client, one, w, 2)
            wait_held(controller, w, "instance_1")
            stream(client, two, w, 2)
            for r in range(args.rounds):
                p = [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)]
                q = [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)]
                samples["cold"].append(stream(client, two, q, 2)[0])
                stream(client, one, p, 2)
                wait_held(controller, p, "instance_1")
                before = len(transfers(controller))
                samples["p2p"].append(stream(client, two, p, 2)[0])
                new = [t for t in transfers(controller)[:len(transfers(controller)) - before]
                       if t["kind"] == "p2p" and t["to"] == "instance_2"]
                fetches += new
                raw_pair = RawNixl(sizes, 1 + args.raw_reps)
                raw_pair.measure("same", 1)  # its handshake and first use, as the warm-up does for P2P
                raw += raw_pair.measure("new", args.raw_reps)
                reread += raw_pair.measure("same", args.raw_reps)
                raw_pair.close()
                raw_pair = None
                if not args.json:
                    rates = ", ".join(f"{t['gbps']:.2f} GB/s" for t in new) or "none"
                    print(f"round {r + 1}: cold {samples['cold'][-1] * 1e3:.0f} ms, p2p {samples['p2p'][-1] * 1e3:.0f} "
                          f"ms, fetch {rates}, raw " + " ".join(f"{x:.2f}" for x in raw[-args.raw_reps:])
                          + ", re-read " + " ".join(f"{x:.2f}" for x in reread[-args.raw_reps:]), flush=True)
    finally:
        if raw_pair is not None:
            raw_pair.close()
        for s in servers:
            s.stop()
        controller.stop()
    log = servers[1].log_path.read_text(errors="replace") if servers else ""
    ok = [t for t in fetches if t["ok"]]
    ms = {k: round(statistics.median(v) * 1e3, 1) for k, v in samples.items()}
    result = {"prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "cluster_secret": args.cluster_secret,
              "cold_ttft_ms": ms["cold"],
              "p2p_ttft_ms": ms["p2p"], "p2p_ratio": round(ms["p2p"] / ms["cold"], 3),
              "p2p_gbps": round(statistics.median(t["gbps"] for t in ok), 3) if ok else 0.0,
              "raw_nixl_gbps": round(statistics.median(raw), 3),
              "raw_nixl_reread_gbps": round(statistics.median(reread), 3),
              "p2p_fetches_ok": len(ok), "p2p_fetches_failed": len(fetches) - len(ok),
              "p2p_bytes_per_fetch": ok[0]["bytes"] if ok else 0,
              "p2p_loads_logged": log.count(f"chunks: {-(-args.prompt_tokens // CHUNK)} from p2p")}
    result["p2p_vs_raw"] = round(result["p2p_gbps"] / result["raw_nixl_gbps"], 3)
    result["p2p_vs_reread"] = round(result["p2p_gbps"] / result["raw_nixl_reread_gbps"], 3)
    result["target_met"] = result["p2p_vs_raw"] >= 0.8
    result.update(mac_bench(args.mac_rounds, args.mac_chunks))  # the servers are gone: the cores are free
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
