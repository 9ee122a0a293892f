"""Time to first token on instance 2 for a long prompt, cold vs fetched from instance 1 over P2P,
and the P2P retrieval rate next to raw NIXL between two processes on the same cores.

    python benchmarks/p2p_bench.py --json [--rounds 5] [--prompt-tokens 3000]

kvferry-controller and two kv_both vLLM servers (tiny model, bf16, vLLM's prefix cache off;
instance 1 on core 0, instance 2 on core 1) with seed 003's P2P keys. Each round, with fresh
random prompts P and Q:

  cold(Q)   Q on instance 2: computed
  P on instance 1 (computed and stored), then, once the controller lists it,
  p2p(P)    P on instance 2: fetched from instance 1's CPU tier over NIXL

TTFT is the first streamed token of a max_tokens=2 request (medians). `p2p_gbps` is each P2P
retrieval as instance 2 reports it to the controller: bytes / (lookup on the peer + lease + NIXL
READ into fresh host memory). `raw_nixl_gbps`: two plain processes pinned to the same two cores
READ the same bytes in the same chunk-sized descriptors between pre-registered, pre-touched
buffers (NIXL UCX, progress driven the way kvferry drives it), median of `--raw-reps`.
Target: p2p_gbps >= 0.8 x raw_nixl_gbps.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvferry.common.netutil import free_port
from kvferry.launcher import tiny_model
from kvferry.launcher.pd_instances import OffloadServer, p2p_keys
from kvferry.launcher.stores import Controller

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_bench import stream  # noqa: E402

CHUNK = 256
TOKEN_BYTES = 16 << 10  # bf16 tiny model: 8 layers x 8 KV heads x 64 x (K, V) x 2 bytes


def raw_role(role: str, port: int, sizes: list[int], reps: int, core: int) -> None:
    """One side of the raw NIXL measurement (a child process)."""
    import torch
    import zmq

    from kvferry.buffer.nixl_agent import make_agent
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    agent = make_agent(f"raw-{role}-{os.getpid()}")
    bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]  # touched: no page faults in the transfer
    regs = agent.register_memory(bufs)
    sock = zmq.Context.instance().socket(zmq.REP if role == "holder" else zmq.REQ)
    if role == "holder":
        sock.bind(f"tcp://127.0.0.1:{port}")
        sock.recv()
        sock.send(pickle.dumps((agent.get_agent_metadata(), [(b.data_ptr(), b.numel(), 0) for b in bufs])))
        deadline = time.monotonic() + 300
        while not sock.poll(0):  # drive progress for the reader's READs, as kvferry's holder does
            if time.monotonic() > deadline:
                raise SystemExit("raw NIXL holder: the reader never said done")
            agent.get_new_notifs()
            time.sleep(0.0002)
        sock.recv()
        sock.send(b"bye")
    else:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"hello")
        md, remote = pickle.loads(sock.recv())
        name = agent.add_remote_agent(md)
        local = agent.get_xfer_descs([(b.data_ptr(), b.numel(), 0) for b in bufs], "DRAM")
        rdescs = agent.get_xfer_descs(remote, "DRAM")
        rates = []
        for _ in range(reps):
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
            rates.append(sum(sizes) / dt / 1e9)
        sock.send(b"done")
        sock.recv()
        print(json.dumps(rates), flush=True)
    agent.deregister_memory(regs)


def raw_nixl(sizes: list[int], reps: int) -> list[float]:
    port = free_port()
    args = [json.dumps(sizes), str(reps)]
    me = [sys.executable, __file__, "--raw-role"]
    holder = subprocess.Popen([*me, "holder", str(port), *args, "0"], stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run([*me, "reader", str(port), *args, "1"], capture_output=True, text=True, timeout=300,
                             check=True).stdout
    finally:
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:  # the reader failed: nothing will release the holder
            holder.kill()
            holder.wait(timeout=10)
    return json.loads(out.strip().splitlines()[-1])


def transfers(c: Controller) -> list[dict]:
    return httpx.get(c.url + "/api/state", timeout=10).json()["transfers"]


def wait_held(c: Controller, p: list[int], instance: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while instance not in httpx.post(c.url + "/lookup", json={"tokens": p}, timeout=10).json()["layout_info"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the controller never listed {instance} for the prompt")
        time.sleep(0.05)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-role":
        role, port, sizes, reps, core = sys.argv[2:7]
        raw_role(role, int(port), json.loads(sizes), int(reps), int(core))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--raw-reps", type=int, default=10)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    model = tiny_model.ensure()
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-p2p-bench-"))
    logs = Path(args.log_dir) if args.log_dir else tmp
    controller = Controller(tmp)
    servers: list[OffloadServer] = []
    rng = random.Random(0)
    samples: dict[str, list[float]] = {"cold": [], "p2p": []}
    fetches: list[dict] = []
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
                if not args.json:
                    rates = ", ".join(f"{t['gbps']:.2f} GB/s" for t in new) or "none"
                    print(f"round {r + 1}: cold {samples['cold'][-1] * 1e3:.0f} ms, p2p {samples['p2p'][-1] * 1e3:.0f} "
                          f"ms, fetch {rates}", flush=True)
        nchunks = -(-args.prompt_tokens // CHUNK)
        sizes = [min(CHUNK, args.prompt_tokens - i * CHUNK) * TOKEN_BYTES for i in range(nchunks)]
        raw = raw_nixl(sizes, args.raw_reps)
    finally:
        for s in servers:
            s.stop()
        controller.stop()
    log = servers[1].log_path.read_text(errors="replace") if servers else ""
    ok = [t for t in fetches if t["ok"]]
    ms = {k: round(statistics.median(v) * 1e3, 1) for k, v in samples.items()}
    result = {"prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "cold_ttft_ms": ms["cold"],
              "p2p_ttft_ms": ms["p2p"], "p2p_ratio": round(ms["p2p"] / ms["cold"], 3),
              "p2p_gbps": round(statistics.median(t["gbps"] for t in ok), 3) if ok else 0.0,
              "raw_nixl_gbps": round(statistics.median(raw), 3),
              "p2p_fetches_ok": len(ok), "p2p_fetches_failed": len(fetches) - len(ok),
              "p2p_bytes_per_fetch": ok[0]["bytes"] if ok else 0,
              "p2p_loads_logged": log.count(f"chunks: {-(-args.prompt_tokens // CHUNK)} from p2p")}
    result["p2p_vs_raw"] = round(result["p2p_gbps"] / result["raw_nixl_gbps"], 3)
    result["target_met"] = result["p2p_vs_raw"] >= 0.8
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
