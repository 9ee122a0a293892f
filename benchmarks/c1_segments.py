"""Where a streamed completion's time goes at concurrency 1, per router, by segment.

    python benchmarks/c1_segments.py [--requests 300] [--rounds 3] [--client socket|aiohttp]
        [--baseline-path DIR] [--no-vllm-router] [--workers 1] [--decoder-first]

Two stub engines (prefiller, decoder) with KVFERRY_STUB_TRACE set (testing/stub_engine.py: each
completion's CLOCK_MONOTONIC times), the routers as benchmarks/proxy_bench.py starts them ("direct",
"kvferry", "kvferry_base" with --baseline-path, "kvferry_decoder_first" with --decoder-first,
"vllm_router_rr"), and one client doing one request
at a time on a kept connection, noting when it sent each request and when each SSE event reached
it: a blocking socket (`socket`, cheap) or proxy_bench.py's own aiohttp reader (`aiohttp`). One
machine, one clock, so times compare across processes. Per request (matched by the prompt's
number), medians over the requests of a round, then the median over rounds:

    1 ingress      client sent -> prefiller stub's handler entered (direct: the decoder's)
    2 P service    prefiller stub: handler entered -> answer written (its body read apart)
    3 middle       prefill answer written -> decoder stub's handler entered (the router's turn)
    2+3 P in -> D in  the two together: causal per request (the decoder's leg is sent only once the
                   prefiller's answer reached the router), where `3 middle` alone can read below
                   zero on a busy machine (the stub stamps "written" only once it runs again)
    4 D            decoder stub: handler entered -> first chunk written (its body read apart)
    5 egress       decoder's first chunk written -> client has it (kvferry: the client's second
                   event; its first is the prefiller's token, sent before the decode leg)
    6 D stream     decoder stub: first chunk -> last chunk written
    7 tail         decoder's last chunk written -> client has the whole answer

plus each process's CPU per request (schedstat) and context switches. Segments that share a
boundary blur on a 2-core machine: a process woken by a write often runs on the writer's core at
once, so the writer's next timestamp waits for it (read 2 + 3 together). Targets run in turns.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_bench import request_body, start, start_targets, tree  # noqa: E402

from kvferry.common.netutil import free_port  # noqa: E402

now = time.monotonic_ns


class Client:
    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.sock

    def post(self, path: str, body: bytes) -> dict:
        s = self._connect()
        req = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        events: list[int] = []  # arrival time of each `data: {` event
        buf = b""
        seen = 0
        t_send = now()
        s.sendall(req)
        while True:
            got = s.recv(1 << 16)
            t = now()
            if not got:
                raise ConnectionError("closed")
            buf += got
            n = buf.count(b"data: {")
            events += [t] * (n - seen)
            seen = n
            if b"[DONE]" in buf and buf.endswith(b"0\r\n\r\n"):
                break
        if not buf.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(buf[:300])
        return {"send": t_send, "events": events, "last": t}


class AioClient:
    """proxy_bench.py's client (aiohttp, lines read from the stream), timed per event."""

    def __init__(self, port: int) -> None:
        import asyncio

        import aiohttp
        self.url = f"http://127.0.0.1:{port}"
        self.loop = asyncio.new_event_loop()

        async def mk() -> aiohttp.ClientSession:
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.s = self.loop.run_until_complete(mk())

    async def _post(self, path: str, body: bytes) -> dict:
        events = []
        t_send = now()
        async with self.s.post(self.url + path, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(await r.read())
            async for line in r.content:
                if line.startswith(b"data: {"):
                    events.append(now())
        return {"send": t_send, "events": events, "last": now()}

    def post(self, path: str, body: bytes) -> dict:
        return self.loop.run_until_complete(self._post(path, body))

    def close(self) -> None:
        self.loop.run_until_complete(self.s.close())
        self.loop.close()


def procs_of(pid: int) -> list[int]:
    return [pid] if pid == os.getpid() else tree(pid)  # the client: not the servers it started


def cpu_seconds(pid: int) -> float:
    """On-CPU seconds of `pid`'s tree, all threads (schedstat: ns, not the 10 ms ticks of stat)."""
    total = 0
    for p in procs_of(pid):
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/schedstat") as f:
                    total += int(f.read().split()[0])
        except OSError:
            continue
    return total / 1e9


def switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of `pid`'s tree, all threads."""
    v = nv = 0
    for p in procs_of(pid):
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches"):
                            v += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            nv += int(line.split()[1])
        except OSError:
            continue
    return v, nv


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


def run(name: str, port: int, base: int, n: int, ps: int, ds: int, warm: int, aio: bool,
        pids: dict[str, int]) -> dict:
    c = AioClient(port) if aio else Client(port)
    path = "/v1/completions"
    for i in range(warm):
        c.post(path, request_body("completions", 256, 16, base + 90_000 + i))
    get_json(f"http://127.0.0.1:{ps}/stub/trace")
    get_json(f"http://127.0.0.1:{ds}/stub/trace")
    client = {}
    pids = dict(pids, client=os.getpid())
    c0 = {k: cpu_seconds(v) for k, v in pids.items()}
    s0 = {k: switches(v) for k, v in pids.items()}
    for i in range(n):
        client[base + i] = c.post(path, request_body("completions", 256, 16, base + i))
    c1 = {k: cpu_seconds(v) for k, v in pids.items()}
    s1 = {k: switches(v) for k, v in pids.items()}
    cpu = {f"cpu_ms {k}": round((c1[k] - c0[k]) / n * 1e3, 3) for k in c0}
    cpu |= {f"csw vol {k}": round((s1[k][0] - s0[k][0]) / n, 2) for k in c0}
    cpu |= {f"csw invol {k}": round((s1[k][1] - s0[k][1]) / n, 2) for k in c0}
    pt = {r[0]: r for r in get_json(f"http://127.0.0.1:{ps}/stub/trace")}
    dt = {r[0]: r for r in get_json(f"http://127.0.0.1:{ds}/stub/trace")}
    if aio:
        c.close()
    else:
        c.sock.close()
    seg: dict[str, list[float]] = {}

    def add(k: str, v: float) -> None:
        seg.setdefault(k, []).append(v / 1e6)
    for no, cl in client.items():
        d = dt.get(no)
        if d is None:
            continue
        p = pt.get(no)
        # The client's receipt of the decoder's first token: kvferry's first event is the prefiller's.
        early = name.startswith("kvferry") and name != "kvferry_decoder_first"
        ev_dec = cl["events"][1] if (p is not None and early) else cl["events"][0]
        add("total", cl["last"] - cl["send"])
        add("client_ttft", cl["events"][0] - cl["send"])
        if p is not None:
            add("1 ingress (send -> P in)", p[2] - cl["send"])
            add("2 P body read", p[3] - p[2])
            add("2 P service (in -> written)", p[5] - p[2])
            add("3 middle (P written -> D in)", d[2] - p[5])
            add("2+3 P in -> D in", d[2] - p[2])
        else:
            add("1 ingress (send -> D in)", d[2] - cl["send"])
        add("4 D body read", d[3] - d[2])
        add("4 D in -> first chunk written", d[4] - d[2])
        add("5 egress (D first -> client)", ev_dec - d[4])
        add("6 D first -> last written", d[5] - d[4])
        add("7 tail (D last -> client last)", cl["last"] - d[5])
    return {k: med(v) for k, v in sorted(seg.items())} | cpu | {"n": len(seg.get("total", []))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=50)
    ap.add_argument("--baseline-path", default=None)
    ap.add_argument("--no-vllm-router", action="store_true")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--client", choices=("socket", "aiohttp"), default="socket")
    ap.add_argument("--decoder-first", action="store_true", help="also kvferry --first-token decoder")
    args = ap.parse_args()
    env = dict(os.environ, KVFERRY_STUB_TRACE="1")
    ps, ds = free_port(), free_port()
    stub = [sys.executable, "-m", "kvferry.testing.stub_engine", "--port"]
    procs = [start([*stub, str(ps)], f"http://127.0.0.1:{ps}/health", env),
             start([*stub, str(ds)], f"http://127.0.0.1:{ds}/health", env)]
    try:
        routers = start_targets(args, ps, ds, routers=("vllm_router_rr",))
        procs += routers.values()
        targets = {"direct": ds} | {n: int(r.url.rsplit(":", 1)[1]) for n, r in routers.items()}
        tpids = {n: r.pid for n, r in routers.items()}
        print("pids", [p.pid for p in procs], file=sys.stderr, flush=True)
        results: dict[str, list[dict]] = {k: [] for k in targets}
        for rnd in range(args.rounds):
            for ti, (name, port) in enumerate(targets.items()):
                base = (rnd * 10 + ti) * 100_000 + 1
                pids = {"P stub": procs[0].pid, "D stub": procs[1].pid}
                if name in tpids:
                    pids["router"] = tpids[name]
                r = run(name, port, base, args.requests, ps, ds, args.warm, args.client == "aiohttp", pids)
                results[name].append(r)
                print(rnd, name, json.dumps(r), file=sys.stderr, flush=True)
        # Median over rounds of each segment's per-round median.
        summary = {name: {k: med([r[k] for r in rs]) for k in rs[0]} for name, rs in results.items()}
        for name in summary:
            if name != "direct":
                summary[name]["added total"] = round(summary[name]["total"] - summary["direct"]["total"], 3)
        print(json.dumps({"rounds": results, "summary": summary}))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
