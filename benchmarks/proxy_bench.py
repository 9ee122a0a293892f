"""The proxy's overhead: stub engines, the proxy and a load generator, each in its own process.

    python benchmarks/proxy_bench.py --json [--concurrency 1,32,256] [--requests 2000] [--tokens 16]

"direct" streams from the decoder stub itself; "proxy" goes through kvferry's proxy (prefill leg
on the prefiller stub, decode leg on the decoder stub), same load, same run. Reports req/s, p50/p99
TTFT and latency, the proxy's added p50/p99 latency, and the proxy process's CPU seconds per
request (from /proc). Targets (concurrency 1 / 32): added p50 <= 1 ms, <= 1.2 ms of proxy CPU per
request, and >= 2x the ~280 req/s of the Python proxies users run today at concurrency 32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

from kvferry.common.netutil import free_port
from kvferry.testing.processes import wait_http


def start(args: list[str], url: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(url, p)
    except (RuntimeError, TimeoutError):
        p.kill()
        raise
    return p


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def load(url: str, concurrency: int, requests: int, tokens: int, out) -> None:
    """Runs in its own process: `requests` streaming completions, `concurrency` at a time."""
    import aiohttp

    async def run() -> dict:
        ttft, lat, errors = [], [], 0
        body = json.dumps({"model": "stub", "prompt": "benchmark prompt " * 8, "max_tokens": tokens,
                           "stream": True}).encode()
        left = requests
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def worker() -> None:
                nonlocal left, errors
                while left > 0:
                    left -= 1
                    t0 = time.perf_counter()
                    first = None
                    try:
                        async with s.post(url + "/v1/completions", data=body,
                                          headers={"Content-Type": "application/json"}) as r:
                            if r.status != 200:
                                errors += 1
                                await r.read()
                                continue
                            async for line in r.content:
                                if first is None and line.startswith(b"data: {"):
                                    first = time.perf_counter() - t0
                    except aiohttp.ClientError:
                        errors += 1
                        continue
                    ttft.append(first or 0.0)
                    lat.append(time.perf_counter() - t0)
            t = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - t
        return {"ttft": ttft, "lat": lat, "errors": errors, "wall": wall}
    out.send(asyncio.run(run()))


def measure(url: str, concurrency: int, requests: int, tokens: int, cpu_pid: int | None) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    # Warm-up, then the measured run.
    for n in (min(200, requests), requests):  # the last run is the one reported
        c0 = cpu_seconds(cpu_pid) if cpu_pid else 0.0
        p = ctx.Process(target=load, args=(url, concurrency, n, tokens, b))
        p.start()
        r = a.recv()
        p.join()
        c1 = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    q = lambda xs, f: round(sorted(xs)[min(len(xs) - 1, int(f * len(xs)))] * 1e3, 3)  # noqa: E731
    row = {"concurrency": concurrency, "requests": len(r["lat"]), "errors": r["errors"],
           "req_per_s": round(len(r["lat"]) / r["wall"], 1),
           "p50_ttft_ms": round(statistics.median(r["ttft"]) * 1e3, 3), "p99_ttft_ms": q(r["ttft"], 0.99),
           "p50_latency_ms": round(statistics.median(r["lat"]) * 1e3, 3), "p99_latency_ms": q(r["lat"], 0.99)}
    if cpu_pid:
        row["proxy_cpu_ms_per_request"] = round((c1 - c0) / max(1, len(r["lat"]) + r["errors"]) * 1e3, 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--concurrency", default="1,32,256")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    ps, ds, px = free_port(), free_port(), free_port()
    procs = [start(["-m", "kvferry.testing.stub_engine", "--port", str(ps)], f"http://127.0.0.1:{ps}/health"),
             start(["-m", "kvferry.testing.stub_engine", "--port", str(ds)], f"http://127.0.0.1:{ds}/health")]
    try:
        proxy = start(["-m", "kvferry.proxy", "--port", str(px), "--prefiller", f"http://127.0.0.1:{ps}",
                       "--decoder", f"http://127.0.0.1:{ds},{free_port()},{free_port()}", "--health-interval", "30"],
                      f"http://127.0.0.1:{px}/metrics")
        procs.append(proxy)
        result: dict = {"direct": {}, "proxy": {}, "added": {}}
        for c in (int(x) for x in args.concurrency.split(",")):
            d = measure(f"http://127.0.0.1:{ds}", c, args.requests, args.tokens, None)
            p = measure(f"http://127.0.0.1:{px}", c, args.requests, args.tokens, proxy.pid)
            result["direct"][str(c)], result["proxy"][str(c)] = d, p
            result["added"][str(c)] = {"p50_ms": round(p["p50_latency_ms"] - d["p50_latency_ms"], 3),
                                       "p99_ms": round(p["p99_latency_ms"] - d["p99_latency_ms"], 3)}
            if not args.json:
                print(c, "direct", d, "\n  proxy", p, flush=True)
        one, many = result["proxy"].get("1"), result["proxy"].get("32")
        result["targets"] = {
            "added_p50_ms_at_1_le_1": one is not None and result["added"]["1"]["p50_ms"] <= 1.0,
            "cpu_ms_per_request_le_1.2": all(r["proxy_cpu_ms_per_request"] <= 1.2 for r in result["proxy"].values()),
            "req_per_s_at_32_ge_560": many is not None and many["req_per_s"] >= 560,
            "zero_errors": all(r["errors"] == 0 for r in result["proxy"].values())}
        print(json.dumps(result))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
