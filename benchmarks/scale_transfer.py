"""Transfers at scale: aggregate throughput and per-transfer p99 vs transfers in flight and decoders
per prefiller (real NIXL), and pd_buffer reserve/release operations per second vs occupancy.

    python benchmarks/scale_transfer.py [--quick]      # one JSON line

This process is one prefiller (one `KVSender`); spawned children are the decoders (a `KVReceiver`
and its pd_buffer each, as transfer_bench.py sets them up). A point keeps K transfers in flight,
spread evenly over D decoders: each is `KVSender.send` (the alloc round trip, then one WRITE of its
chunks with the notification), timed from the call until the decoder committed it (CLOCK_MONOTONIC
is one clock for all processes); the decoder claims it at once, which frees its pages, and the
prefiller starts the next one to that decoder. scale_bench.py imports `measure`.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import queue
import random
import statistics
import sys
import threading
import time

import psutil
import torch
import transfer_bench  # this script's folder is first on sys.path

from kvferry.buffer.pd_buffer import PDBuffer
from kvferry.common import zsock
from kvferry.common.netutil import free_port
from kvferry.launcher.vllm_proc import die_with_parent
from kvferry.receiver.kv_receiver import KVReceiver, ReceiverConfig
from kvferry.sender.addr import ReceiverAddr
from kvferry.sender.kv_sender import KVSender, SenderConfig

RATIO_PAIRS = 3


def decoder_main(conn, init_port: int, alloc_port: int, page: int, pages: int) -> None:
    """A decoder: one thread loads what arrived as engine/pd/consumer.py polls (wait_any over the
    transfers it expects, then a claim of each that arrived, which frees its pages), and answers
    (transfer id, when it was committed)."""
    die_with_parent()
    torch.set_num_threads(1)
    buf = PDBuffer(page * pages, "cpu", page)
    pending: set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()
    with KVReceiver(ReceiverConfig("127.0.0.1", init_port, alloc_port, trust=zsock.PLAIN), buf,
                    transfer_bench.fingerprint(page)) as r:
        table = r.table

        def load() -> None:
            while not stop.is_set():
                with lock:
                    expected = list(pending)
                if not expected:
                    time.sleep(0.001)
                    continue
                table.wait_any(expected, 0.05)
                for tid in expected:
                    st = table.status(tid)
                    if st == "pending":
                        continue
                    with lock:
                        pending.discard(tid)
                    try:
                        with r.claim(tid, 0) as got:
                            out: tuple = (tid, got.arrived_at)
                    except Exception as e:  # told to the prefiller, which fails the point
                        out = (tid, None, repr(e))
                    conn.send(out)
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            with lock:
                pending.add(cmd[1])
        stop.set()
        loader.join(5)


class Decoder:
    """A decoder child, its pipe read by a thread into the shared `done` queue."""

    def __init__(self, index: int, page: int, pages: int, done: queue.Queue) -> None:
        ctx = mp.get_context("spawn")
        self.index = index
        self.conn, child = ctx.Pipe()
        self.addr = ReceiverAddr("127.0.0.1", free_port(), free_port())
        self.proc = ctx.Process(target=decoder_main, args=(child, self.addr.init_port, self.addr.alloc_port, page,
                                                           pages), daemon=True)
        self.proc.start()
        self.done = done
        self.lock = threading.Lock()

    def ready(self) -> None:
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError(f"decoder {self.index} did not start")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                self.done.put((self.index, *self.conn.recv()))
        except (EOFError, OSError):
            pass

    def claim(self, tid: str) -> None:
        with self.lock:
            self.conn.send(("claim", tid))

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                with self.lock:
                    self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def run_point(sender: KVSender, decoders: list[Decoder], done: queue.Queue, chunks: list[tuple[int, int]],
              in_flight: int, total: int, tag: str) -> dict:
    """`total` transfers, `in_flight` at a time over `decoders` (evenly); throughput and latencies."""
    nbytes = sum(n for _, n in chunks)
    started: dict[str, float] = {}
    seq = 0

    def start(d: Decoder) -> None:
        nonlocal seq
        tid = f"{tag}-{seq}"
        keys = [(seq * len(chunks) + j + 1).to_bytes(16, "little") for j in range(len(chunks))]
        seq += 1
        started[tid] = time.monotonic()
        fut = sender.send(tid, d.addr, keys, chunks, len(chunks))
        fut.add_done_callback(lambda f, tid=tid: f.exception() and done.put((d.index, tid, None, repr(f.exception()))))
        d.claim(tid)

    procs = [psutil.Process(d.proc.pid) for d in decoders]
    c_dec = sum(sum(p.cpu_times()[:2]) for p in procs)
    c_own, t0 = time.process_time(), time.monotonic()
    for k in range(in_flight):
        start(decoders[k % len(decoders)])
    lat, last = [], t0
    for _ in range(total):
        idx, tid, arrived, *err = done.get(timeout=60)
        if arrived is None:
            raise RuntimeError(f"transfer {tid}: {err}")
        lat.append(arrived - started.pop(tid))
        last = max(last, arrived)
        if seq < total:
            start(decoders[idx])
    wall = last - t0
    own, dec = time.process_time() - c_own, sum(sum(p.cpu_times()[:2]) for p in procs) - c_dec
    lat.sort()
    return {"in_flight": in_flight, "decoders": len(decoders), "transfers": total, "bytes_per_transfer": nbytes,
            "aggregate_gbps": round(total * nbytes / wall / 1e9, 3),
            "transfers_per_s": round(total / wall, 1),
            "p50_ms": round(statistics.median(lat) * 1e3, 3),
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, 3),
            # CPU per transfer (this machine's other load does not count here, unlike in the times)
            "prefiller_cpu_us_per_transfer": round(own / total * 1e6),
            "decoders_cpu_us_per_transfer": round(dec / total * 1e6)}


def transfers(quick: bool) -> tuple[list[dict], dict]:
    """The in-flight x decoders sweep; the config it ran."""
    flights = [1, 8, 64] if quick else [1, 2, 4, 8, 16, 32, 64]
    fanouts = [1, 2] if quick else [1, 2, 4, 8]
    chunk, per = (64 << 10, 4) if quick else (256 << 10, 8)
    reps = 2 if quick else 6  # transfers per point: reps x max(in_flight, 16)
    ratio_n = 128 if quick else 768  # transfers per point of the ratio's pairs
    ratios: list[float] = []
    done: queue.Queue = queue.Queue()
    # Decoder i carries at most ceil(64 / (i + 1)) transfers at once (it serves when D >= i + 1).
    decs = [Decoder(i, chunk, per * (math.ceil(max(flights) / (i + 1)) + 1), done) for i in range(max(fanouts))]
    points = []
    try:
        for d in decs:
            d.ready()
        src = torch.randint(0, 255, (per * chunk,), dtype=torch.uint8)
        chunks = [(src.data_ptr() + i * chunk, chunk) for i in range(per)]
        with KVSender(SenderConfig("scale"), transfer_bench.fingerprint(chunk), "cpu") as sender:
            sender.register(src)
            run_point(sender, decs, done, chunks, len(decs), 2 * len(decs), "warm")  # handshakes
            for fan in fanouts:
                for k in flights:
                    if k < fan:
                        continue
                    points.append(run_point(sender, decs[:fan], done, chunks, k, reps * max(k, 16), f"k{k}d{fan}"))
            # The headline ratio: 8 and 64 in flight into one decoder, in turns, longer, the median of the pairs.
            for i in range(RATIO_PAIRS):
                pair = [run_point(sender, decs[:1], done, chunks, k, ratio_n, f"r{i}k{k}") for k in (8, 64)]
                ratios.append(pair[1]["aggregate_gbps"] / pair[0]["aggregate_gbps"])
    finally:
        for d in decs:
            d.stop()
    return points, {"chunk_bytes": chunk, "chunks_per_transfer": per,
                    "ratio_64_vs_8_pairs": [round(r, 3) for r in ratios]}


def pd_buffer_ops(quick: bool) -> dict[str, float]:
    """Reserve random sizes and release random reservations, holding occupancy near each level: ops
    per second of this thread's CPU time (the machine's other load left out)."""
    pages, window = 4096, (0.3 if quick else 2.0)
    buf = PDBuffer(pages * 256, "cpu", 256)
    rng = random.Random(51)
    out = {}
    for level in (0.1, 0.5, 0.9):
        live: list = []
        used = 0
        while used < level * pages:  # fill to the level
            n = rng.randint(1, 32)
            live.append(buf.reserve(n, "fill", 3600))
            used += n
        ops, t0 = 0, time.thread_time()
        while True:
            n = rng.randint(1, 32)
            if used + n <= level * pages + 16 and n <= buf.free_pages:
                live.append(buf.reserve(n, "op", 3600))
                used += n
            else:
                i = rng.randrange(len(live))
                live[i], live[-1] = live[-1], live[i]
                res = live.pop()
                buf.release(res)
                used -= len(res.pages)
            ops += 1
            if ops % 256 == 0 and time.thread_time() - t0 >= window:
                break
        out[f"{round(level * 100)}%"] = round(ops / (time.thread_time() - t0))
        for res in live:
            buf.release(res)
    return out


def measure(quick: bool) -> dict:
    """Both sweeps, and the headline keys."""
    points, cfg = transfers(quick)
    ops = pd_buffer_ops(quick)
    return {
        "method": (
            f"One KVSender (this process) and 1-{max(p['decoders'] for p in points)} KVReceivers in spawned "
            f"processes over real NIXL (UCX, CPU memory, loopback); each transfer is KVSender.send of "
            f"{cfg['chunks_per_transfer']} chunks of {cfg['chunk_bytes'] >> 10} KiB (alloc round trip, one WRITE "
            "with the notification), timed from the call to the decoder's commit; K transfers are kept in flight, "
            "spread evenly over the decoders, each decoder loading (and so freeing) what arrived as the vLLM "
            "connector's consumer does (wait_any over the expected ids, then claims). Aggregate throughput is all "
            f"bytes over the span of the point. transfer_ratio_64_vs_8: the median of {RATIO_PAIRS} pairs of longer "
            "runs (8 then 64 in flight into one decoder). pd_buffer ops: reserve "
            "1-32 random pages / release a random reservation on a 4096-page PDBuffer held near each occupancy, "
            "single thread, per second of that thread's CPU time. On a 2-core VM shared with other work: noisy."),
        "points": points,
        **cfg,
        "transfer_ratio_64_vs_8": round(statistics.median(cfg["ratio_64_vs_8_pairs"]), 3),
        "pd_buffer_ops_per_s": ops,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(measure(ap.parse_args().quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
