"""kvferry's whole transfer protocol against a bare NIXL WRITE of the same bytes, same two processes.

    python benchmarks/transfer_bench.py --json [--chunk-mib 1,4,16,32] [--batch 8] [--reps 10]

This process is the sender, a spawned child is the receiver. Per repetition and chunk size:

- raw: one NIXL WRITE of `batch` chunks (one descriptor each) from the sender's registered
  memory into pages of the receiver's pd_buffer, timed until NIXL reports it done. The pages are
  reserved beforehand (untimed) so the receiver polls UCX as fast as for its own transfers:
  UCX's rendezvous protocol needs the target's progress to move large messages;
- kvferry: `KVSender.send()` of the same chunks: alloc round trip, write, notification, and the
  receiver marking them readable. Its time runs from the call to the moment the receiver's
  NIXL thread committed the transfer (CLOCK_MONOTONIC is one clock for both processes).

The two alternate within each repetition so this VM's noise hits both alike; medians are
reported. Target: ratio >= 0.9 for >= 1 MiB chunks and batches of >= 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from kvferry.buffer import nixl_agent
from kvferry.buffer.pd_buffer import PDBuffer
from kvferry.common import messages as m
from kvferry.common.netutil import free_port
from kvferry.receiver.server import KVReceiver, ReceiverConfig
from kvferry.receiver.transfers import Incoming
from kvferry.sender.client import KVSender, ReceiverAddr, SenderConfig

DEBUG = bool(os.environ.get("KVFERRY_BENCH_DEBUG"))


def fingerprint(page: int) -> m.LayoutFingerprint:
    return m.LayoutFingerprint(model="bench", dtype="bfloat16", num_layers=8, num_kv_heads=8, head_size=64,
                               block_size=128, kv_layout="cpu", chunk_format="block", chunk_size=page // 16384,
                               page_bytes=page)


def receiver_main(conn, init_port: int, alloc_port: int, page: int, pages: int) -> None:
    torch.set_num_threads(1)
    buf = PDBuffer(page * pages, "cpu", page)
    with KVReceiver(ReceiverConfig("127.0.0.1", init_port, alloc_port), buf, fingerprint(page)) as r:
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "hold":  # pages for a raw write, expected like a transfer (fast polling)
                res = buf.reserve(cmd[2], cmd[1], lease_seconds=60)
                r.table.add(Incoming(cmd[1], "bench", [b"x"] * cmd[2], [], 0, res))
                r._kick.set()
                conn.send(list(res.pages))
            elif cmd[0] == "drop":
                r.table.abort(cmd[1], 0, "raw write done")
                conn.send(True)
            else:
                with r.claim(cmd[1], 30) as got:
                    conn.send(got.arrived_at)


def raw_write(sender: KVSender, addr: ReceiverAddr, chunks: list[tuple[int, int]], pages: list[int]) -> float:
    """A bare NIXL WRITE into the receiver's `pages`, through the sender's own agent and
    connection (bench-only access to its internals), timed until NIXL says done."""
    async def run() -> float:
        peer, _ = await sender._peer(addr)
        return await sender._nixl.call(timed, peer)

    def timed(peer) -> float:  # on the sender's NIXL thread, the agent's only user
        agent = sender._agent
        t = time.monotonic()
        local = agent.get_xfer_descs([(a, n, 0) for a, n in chunks], "DRAM")
        remote = agent.get_xfer_descs([(peer.buffer_addr + p * peer.page_bytes, n, 0)
                                       for p, (_, n) in zip(pages, chunks, strict=True)], peer.mem_type)
        h = agent.initialize_xfer("WRITE", local, remote, peer.agent_name)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        dt = time.monotonic() - t
        agent.release_xfer_handle(h)
        assert state == "DONE", state
        return dt
    return asyncio.run_coroutine_threadsafe(run(), sender._loop).result(60)


def bench_size(chunk: int, batch: int, reps: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    ip, ap = free_port(), free_port()
    proc = ctx.Process(target=receiver_main, args=(child, ip, ap, chunk, 2 * batch), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("receiver did not start")
        parent.recv()
        src = torch.randint(0, 255, (batch * chunk,), dtype=torch.uint8)
        chunks = [(src.data_ptr() + i * chunk, chunk) for i in range(batch)]
        addr = ReceiverAddr("127.0.0.1", ip, ap)
        with KVSender(SenderConfig("bench"), fingerprint(chunk)) as sender:
            sender.register(src)
            keys = [i.to_bytes(16, "little") for i in range(1, batch + 1)]
            sender.send("warm", addr, keys, chunks, batch).result(60)
            parent.send(("claim", "warm"))
            parent.recv()
            raw, ours = [], []
            for i in range(-1, reps):  # -1: warm-up
                parent.send(("hold", f"raw{i}", batch))
                pages = parent.recv()
                dt = raw_write(sender, addr, chunks, pages)
                parent.send(("drop", f"raw{i}"))
                parent.recv()
                if i < 0:
                    continue
                raw.append(dt)
                tid = f"t{i}"
                t0 = time.monotonic()
                res = sender.send(tid, addr, keys, chunks, batch).result(60)
                parent.send(("claim", tid))
                ours.append(parent.recv() - t0)
                if DEBUG:
                    print(f"send {res.seconds * 1e3:.2f} ms, readable {ours[-1] * 1e3:.2f} ms", file=sys.stderr)
        parent.send(("stop",))
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    nbytes = batch * chunk
    r, o = statistics.median(raw), statistics.median(ours)
    ours_sorted = sorted(ours)
    return {"chunk_bytes": chunk, "batch": batch, "reps": reps,
            "raw_nixl_write_gbps": round(nbytes / r / 1e9, 3), "kvferry_gbps": round(nbytes / o / 1e9, 3),
            "ratio": round(r / o, 3), "p50_transfer_ms": round(o * 1e3, 3),
            "p99_transfer_ms": round(ours_sorted[min(len(ours) - 1, int(0.99 * len(ours)))] * 1e3, 3),
            "raw_p50_ms": round(r * 1e3, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--chunk-mib", default="1,4,16,32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    nixl_agent.make_agent("kvf-bench-probe")  # fail early, clearly, without nixl
    rows = [bench_size(int(float(s) * (1 << 20)), args.batch, args.reps) for s in args.chunk_mib.split(",")]
    total = sum(r["chunk_bytes"] * r["batch"] for r in rows)
    raw_s = sum(r["chunk_bytes"] * r["batch"] / (r["raw_nixl_write_gbps"] * 1e9) for r in rows)
    our_s = sum(r["chunk_bytes"] * r["batch"] / (r["kvferry_gbps"] * 1e9) for r in rows)
    result = {"raw_nixl_write_gbps": round(total / raw_s / 1e9, 3), "kvferry_gbps": round(total / our_s / 1e9, 3),
              "ratio": round(raw_s / our_s, 3),
              "p50_transfer_ms": statistics.median(r["p50_transfer_ms"] for r in rows),
              "p99_transfer_ms": max(r["p99_transfer_ms"] for r in rows),
              "target_met": all(r["ratio"] >= 0.9 for r in rows), "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        for r in rows:
            print(f"{r['chunk_bytes'] >> 20:>4} MiB x{r['batch']}: raw {r['raw_nixl_write_gbps']:.2f} GB/s, "
                  f"kvferry {r['kvferry_gbps']:.2f} GB/s, ratio {r['ratio']}, p50 {r['p50_transfer_ms']} ms")
        print("target met" if result["target_met"] else "target NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
