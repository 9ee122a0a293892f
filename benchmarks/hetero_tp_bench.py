"""`transfer_bench.py --hetero-tp`: a prefiller of TP=2 into a decoder rank of TP=1 (a GQA model's
8 KV heads, 4 per prefiller rank), kvferry against raw NIXL WRITEs of the same bytes from the same
two processes.

Two spawned sender processes (prefiller ranks 0 and 1), each with `batch` chunks of its own 4 heads
(vLLM's CPU layout, block format: 8 layers, blocks of 16 tokens, head size 128, bf16), write into the
same `batch` pages of one receiver (this process) in the decoder's 8-head chunk format: each rank
only its heads' byte runs (kernels/head_map.py `chunk_runs`: one run per layer and block here).
Per repetition and chunk size, both ranks start at one agreed CLOCK_MONOTONIC instant:

- raw: each rank posts one NIXL WRITE of its runs (the very descriptors kvferry posts, built before
  the start; NIXL's lists and transfer handle made after it, as a plain NIXL user does) into pages
  reserved beforehand, with a NIXL notification of kvferry's notice's size;
  the time is until the receiver's NIXL thread (polling as for a transfer of its own) got the later
  of the two notifications, the point at which a decoder can know the bytes are there
  (`raw_sender_done_p50_ms`: until the later sender's NIXL reported its WRITE done instead);
- kvferry (`ratio`): the pages were reserved by both ranks while the prompt computed (untimed: the
  first rank's alloc, the second joining it) and each rank prepared its write on its grant, as
  engine/pd/producer.py does when an early grant comes (`KVSender.prepare`: descriptors and NIXL
  handle), then each rank's `KVSender.write(runs=...)` with its notification; the time is until the
  receiver committed the transfer, i.e. both notifications came.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time

import numpy as np
import torch

from kvferry.buffer import nixl_agent
from kvferry.buffer.pd_buffer import PDBuffer
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.kernels.head_map import ChunkGeometry, chunk_runs
from kvferry.kernels.layout import KVLayout
from kvferry.receiver.kv_receiver import KVReceiver, ReceiverConfig
from kvferry.receiver.transfer_table import Incoming
from kvferry.sender.addr import ReceiverAddr
from kvferry.sender.descs import write_descs
from kvferry.sender.kv_sender import KVSender, SenderConfig

HEADS, HEAD, LAYERS, BS = 8, 128, 8, 16
TOKEN_BYTES = LAYERS * HEADS * HEAD * 2 * 2  # every layer's K and V of one token, all heads, bf16
RAW_NOTE = b"kvf-bench-raw:"  # a raw WRITE's notification: this prefix, the pages' id and the rank


class RawNotes:
    """Raw WRITEs' notifications as a receiver's NIXL thread gets them (RAW_NOTE, then an id padded
    with dots), with when; kvferry's own notifications go on to the receiver as always."""

    def __init__(self, r: KVReceiver) -> None:
        self.seen: dict[bytes, float] = {}
        self.cv = threading.Condition()
        self._kvferry = r._on_notif
        r._on_notif = self._on_notif

    def _on_notif(self, note: bytes, proxy) -> None:
        if not note.startswith(RAW_NOTE):
            self._kvferry(note, proxy)
            return
        with self.cv:
            self.seen[note[len(RAW_NOTE):].rstrip(b".")] = time.monotonic()
            self.cv.notify_all()

    def wait(self, ids: list[bytes], timeout: float) -> list[float] | None:
        """When each of `ids` came (bounded: a notification follows its WRITE's data); None if not all did."""
        with self.cv:
            if not self.cv.wait_for(lambda: all(k in self.seen for k in ids), timeout):
                return None
            return [self.seen.pop(k) for k in ids]


def fingerprint(tp: int, chunk: int) -> m.LayoutFingerprint:
    tokens = chunk // TOKEN_BYTES
    return m.LayoutFingerprint(model="bench", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS // tp,
                               head_size=HEAD, block_size=BS, kv_layout="cpu:[blocks,kv_heads,block_size,2*head_size]",
                               chunk_format="block", chunk_size=tokens, tp_size=tp, page_bytes=chunk // tp,
                               total_kv_heads=HEADS, slices=True)


def runs_for(rank: int, chunk: int) -> np.ndarray:
    def geo(tp: int) -> ChunkGeometry:
        return ChunkGeometry(KVLayout("cpu", 0, BS, HEADS // tp, HEAD, torch.bfloat16), "block", LAYERS)
    return chunk_runs(geo(2), geo(1), HEADS, 2, rank, 1, 0, chunk // TOKEN_BYTES)


def _until(t: float) -> None:
    """Until the agreed start: asleep, then spinning for its last 2 ms, so the thread that starts
    the write (the caller's for kvferry, as vLLM's forward thread is; the NIXL thread's for raw)
    is running at the start in both (a wake-up on this loaded 2-core VM can take milliseconds)."""
    time.sleep(max(0.0, t - 0.002 - time.monotonic()))
    while time.monotonic() < t:
        pass


def grants_notice(rank: int) -> bytes:
    return m.encode(m.ArrivalNotice(transfer_id="t10", generation=1 << 20, writer=rank))


def sender_main(conn, rank: int, addr: tuple, chunk: int, batch: int) -> None:
    torch.set_num_threads(1)
    src = torch.randint(0, 255, (batch * chunk // 2,), dtype=torch.uint8)
    chunks = [(src.data_ptr() + i * chunk // 2, chunk // 2) for i in range(batch)]
    runs = [runs_for(rank, chunk)] * batch
    keys = [i.to_bytes(16, "little") for i in range(1, batch + 1)]
    raddr = ReceiverAddr(*addr)
    with KVSender(SenderConfig(f"hetero-bench-{rank}", tp_rank=rank), fingerprint(2, chunk)) as s:
        s.register(src)
        grants = {}
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "reserve":
                grants[cmd[1]] = g = s.reserve(cmd[1], raddr, keys, batch * chunk // TOKEN_BYTES,
                                               share=(2, rank)).result(60)
                s.prepare(g, chunks, 0, runs)  # as engine/pd/producer.py does when an early grant comes
                conn.send("ok")
            elif cmd[0] == "write":
                _until(cmd[2])
                res = s.write(grants.pop(cmd[1]), chunks, 0, notify=True, runs=runs).result(60)
                conn.send(res.posted_at)
            else:  # raw: the same descriptors, one bare NIXL WRITE into reserved pages
                # As long as kvferry's notice (msgspec: transfer id, generation, writer), padded.
                note = (RAW_NOTE + f"{cmd[3]}:{rank}:".encode()).ljust(len(grants_notice(rank)), b".")
                conn.send(_raw(s, raddr, chunks, cmd[1], runs, cmd[2], note))


def _raw(s: KVSender, addr: ReceiverAddr, chunks, pages: list[int], runs, start: float, note: bytes) -> float:
    import asyncio

    async def peer():
        return (await s._peer(addr))[0]
    p = asyncio.run_coroutine_threadsafe(peer(), s._loop).result(60)

    def timed() -> float:  # on the sender's NIXL thread, the agent's only user
        agent, region = s._agent, p.welcome.region
        local, remote, _, _ = write_descs(chunks, pages, region, 0, runs)
        _until(start)
        ld = agent.get_xfer_descs(local, "DRAM")
        rd = agent.get_xfer_descs(remote, region.mem_type)
        h = agent.initialize_xfer("WRITE", ld, rd, p.agent, note)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        done = time.monotonic()
        agent.release_xfer_handle(h)
        assert state == "DONE", state
        return done

    async def call():
        return await s._nixl.call(timed)
    return asyncio.run_coroutine_threadsafe(call(), s._loop).result(60)


def bench_size(chunk: int, batch: int, reps: int) -> dict:
    buf = PDBuffer(2 * batch * chunk, "cpu", chunk)
    addr = ("127.0.0.1", free_port(), free_port())
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    with KVReceiver(ReceiverConfig(*addr), buf, fingerprint(1, chunk)) as r:
        notes = RawNotes(r)
        sender_done: list[float] = []

        try:
            for rank in range(2):
                mine, child = ctx.Pipe()
                p = ctx.Process(target=sender_main, args=(child, rank, addr, chunk, batch), daemon=True)
                p.start()
                procs.append(p)
                conns.append(mine)
            for c in conns:
                if not c.poll(60):
                    raise RuntimeError("a sender did not start")
                c.recv()

            def ask_all(*cmd):
                for c in conns:
                    c.send(cmd)
                return [c.recv() for c in conns]

            def kvferry(tid: str) -> float:
                ask_all("reserve", tid)
                start = time.monotonic() + 0.01
                ask_all("write", tid, start)
                with r.claim(tid, 30) as got:
                    return got.arrived_at - start

            def raw(i: int) -> float:
                res = buf.reserve(batch, f"raw{i}", lease_seconds=60)
                r.table.add(Incoming(f"raw{i}", "bench", [b"x"] * batch, 0, res, conn=b"bench"))
                r._kick.set()  # poll as fast as for a transfer: UCX needs this side's progress
                start = time.monotonic() + 0.01
                done = ask_all("raw", list(res.pages), start, f"raw{i}")
                came = notes.wait([f"raw{i}:{rank}:".encode() for rank in range(2)], 10)
                if came is None:
                    raise RuntimeError(f"raw{i}: the receiver did not get both raw notifications")
                got = max(came)
                r.table.abort(f"raw{i}", 0, "raw write done", conn=b"bench", final=True)
                sender_done.append(max(done) - start)
                return got - start

            kvferry("warm")
            raw(-1)
            times: dict[str, list[float]] = {"raw": [], "kvferry": []}
            for i in range(reps):  # in turns first: this VM's noise hits both alike
                for name in (("raw", "kvferry") if i % 2 else ("kvferry", "raw")):
                    times[name].append(raw(i) if name == "raw" else kvferry(f"t{i}"))
            assert buf.fully_free(), "pages left reserved after the bench"
        finally:
            for c in conns:
                c.send(("stop",))
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    nbytes = batch * chunk
    rw, kv = statistics.median(times["raw"]), statistics.median(times["kvferry"])
    kv_sorted = sorted(times["kvferry"])
    return {"chunk_bytes": chunk, "batch": batch, "reps": reps, "senders": 2, "runs_per_chunk_per_sender":
            int(len(runs_for(0, chunk))), "raw_nixl_write_gbps": round(nbytes / rw / 1e9, 3),
            "kvferry_gbps": round(nbytes / kv / 1e9, 3), "ratio": round(rw / kv, 3),
            "p50_transfer_ms": round(kv * 1e3, 3),
            "p99_transfer_ms": round(kv_sorted[min(len(kv_sorted) - 1, int(0.99 * len(kv_sorted)))] * 1e3, 3),
            "raw_p50_ms": round(rw * 1e3, 3),
            "raw_sender_done_p50_ms": round(statistics.median(sender_done[1:]) * 1e3, 3),
            "overhead_p50_us": round((kv - rw) * 1e6, 1)}


def run(sizes_mib: list[float], batch: int, reps: int) -> dict:
    nixl_agent.make_agent("kvf-bench-probe")  # fail early, clearly, without nixl
    rows = [bench_size(int(s * (1 << 20)) // TOKEN_BYTES // BS * BS * TOKEN_BYTES, batch, reps) for s in sizes_mib]
    total = sum(r["chunk_bytes"] * r["batch"] for r in rows)
    raw_s = sum(r["chunk_bytes"] * r["batch"] / (r["raw_nixl_write_gbps"] * 1e9) for r in rows)
    our_s = sum(r["chunk_bytes"] * r["batch"] / (r["kvferry_gbps"] * 1e9) for r in rows)
    return {"device": "cpu", "mode": "hetero-tp (P TP=2 -> D TP=1, 8 KV heads)",
            "raw_nixl_write_gbps": round(total / raw_s / 1e9, 3), "kvferry_gbps": round(total / our_s / 1e9, 3),
            "ratio": round(raw_s / our_s, 3), "p50_transfer_ms": statistics.median(r["p50_transfer_ms"] for r in rows),
            "p99_transfer_ms": max(r["p99_transfer_ms"] for r in rows),
            "target_met": all(r["ratio"] >= 0.9 for r in rows), "rows": rows}
