"""The proxy's overhead: stub engines, the proxies and a load generator, each in its own process.

    python benchmarks/proxy_bench.py --json [--concurrency 1,32,256] [--requests 2000] [--tokens 16]
        [--prompt-words 256] [--endpoint completions|chat] [--rounds 2] [--workers 1]
        [--baseline-path DIR] [--no-vllm-router] [--token-delay SECONDS] [--tokenizer DIR] [--decoder-first]
        [--lmcache-flags] [--traced]

"direct" streams from the decoder stub itself; "kvferry" goes through kvferry's proxy (prefill leg
on the prefiller stub, decode leg on the decoder stub), same load, same run. When `vllm-router`
(Rust, vLLM's router: `pip install vllm-router`) is on PATH or beside this Python, it runs in PD
mode against the same stubs twice: "vllm_router_rr" (--policy round_robin) and
"vllm_router_default" (its default policy, cache_aware, which asks the engines' /tokenize).
`--decoder-first` adds "kvferry_decoder_first": kvferry with `--first-token decoder` (the decoder
computes every token, no token ids on either leg, as vllm-router's PD mode).
`--lmcache-flags` starts every kvferry target with LMCache's disagg_proxy_server.py flags
(`--prefiller-host ... --proxy-port`) instead of kvferry's `--prefiller`/`--decoder` URLs.
`--traced` adds "kvferry_traced": kvferry with --otlp-traces-endpoint, every request traced
(sample ratio 1) into an OTLP receiver (kvferry.testing.otlp_receiver, gRPC) in this process.
`--baseline-path DIR` adds "kvferry_base" (and, with `--decoder-first`,
"kvferry_base_decoder_first"): the proxy imported from DIR/kvferry, an older commit's tree (e.g.
`mkdir -p /tmp/base/kvferry && git archive COMMIT | tar -x -C /tmp/base/kvferry`, then
`--baseline-path /tmp/base`), to measure a change before and after in one run; "vs_base" gives
the ratios per round's medians. Targets are measured in turns (every target at one concurrency,
then the next), `--rounds` times: the machine's speed drifts, so only numbers from one run compare.

Reports per target and concurrency: req/s, p50/p99 TTFT and latency, added p50/p99 latency over
direct, and the router's CPU ms per request (its processes' CPU from /proc, workers included);
with vllm-router, "vs_router_rr": each kvferry mode's CPU ratio and added p50 difference to round
robin's, medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvferry.common.netutil import free_port
from kvferry.launcher.vllm_proc import die_with_parent
from kvferry.testing.processes import wait_http


def start(args: list[str], url: str, env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                         start_new_session=True, preexec_fn=die_with_parent)  # a killed bench leaves no stub
    try:
        wait_http(url, p, timeout=60)
    except (RuntimeError, TimeoutError):
        p.kill()
        raise
    return p


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (a proxy's workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) of `pid` and its descendants."""
    total = 0.0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    return total


def request_body(endpoint: str, words: int, tokens: int, i: int) -> bytes:
    # Each request its own prompt (a number first): no prefix cache makes one target's run cheaper.
    text = f"{i} " + "benchmark prompt " * (words // 2)
    if endpoint == "chat":
        return json.dumps({"model": "stub", "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                           "stream": True}).encode()
    return json.dumps({"model": "stub", "prompt": text, "max_tokens": tokens, "stream": True}).encode()


def load(url: str, path: str, bodies: list[bytes], concurrency: int, out) -> None:
    """Runs in its own process: one streamed request per body, `concurrency` at a time."""
    import aiohttp

    async def run() -> dict:
        ttft, lat, errors = [], [], 0
        todo = list(reversed(bodies))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def worker() -> None:
                nonlocal errors
                while todo:
                    body = todo.pop()
                    t0 = time.perf_counter()
                    first = None
                    try:
                        async with s.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
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


def measure(url: str, path: str, bodies: list[bytes], concurrency: int, cpu_pid: int | None) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    # Warm-up, then the measured run.
    for part in (bodies[:min(200, len(bodies))], bodies):  # the last run is the one reported
        c0 = cpu_seconds(cpu_pid) if cpu_pid else 0.0
        p = ctx.Process(target=load, args=(url, path, part, concurrency, b))
        p.start()
        r = a.recv()
        p.join()
        c1 = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    if not r["lat"]:
        return {"concurrency": concurrency, "requests": 0, "errors": r["errors"]}
    q = lambda xs, f: round(sorted(xs)[min(len(xs) - 1, int(f * len(xs)))] * 1e3, 3)  # noqa: E731
    row = {"concurrency": concurrency, "requests": len(r["lat"]), "errors": r["errors"],
           "req_per_s": round(len(r["lat"]) / r["wall"], 1),
           "p50_ttft_ms": round(statistics.median(r["ttft"]) * 1e3, 3), "p99_ttft_ms": q(r["ttft"], 0.99),
           "p50_latency_ms": round(statistics.median(r["lat"]) * 1e3, 3), "p99_latency_ms": q(r["lat"], 0.99)}
    if cpu_pid:
        row["cpu_ms_per_request"] = round((c1 - c0) / max(1, len(r["lat"]) + r["errors"]) * 1e3, 3)
    return row


def vllm_router_binary() -> str | None:
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


ROUTER_POLICIES = {"vllm_router_rr": ["--policy", "round_robin"], "vllm_router_default": []}


def instance_flags(args: argparse.Namespace, ps: int, ds: int) -> list[str]:
    """kvferry's own instance flags, or with `--lmcache-flags` LMCache's (one prefiller, one decoder,
    and the proxy's notify port, which LMCache's receivers push "KV arrived" to)."""
    if getattr(args, "lmcache_flags", False):  # c1_segments.py passes its own args
        return ["--num-prefillers", "1", "--prefiller-host", "127.0.0.1", "--prefiller-port", str(ps),
                "--num-decoders", "1", "--decoder-host", "127.0.0.1", "--decoder-port", str(ds),
                "--decoder-init-port", str(free_port()), "--decoder-alloc-port", str(free_port()),
                "--proxy-host", "127.0.0.1", "--proxy-port", str(free_port())]
    return ["--prefiller", f"http://127.0.0.1:{ps}", "--decoder", f"http://127.0.0.1:{ds},{free_port()},{free_port()}"]


def start_targets(args: argparse.Namespace, ps: int, ds: int,
                  routers: tuple[str, ...] = tuple(ROUTER_POLICIES)) -> dict[str, subprocess.Popen]:
    """Every router under test (vllm-router with the `routers` policies), listening; name -> process."""
    out: dict[str, subprocess.Popen] = {}
    kv = [("kvferry", None)]
    if args.decoder_first:
        kv.append(("kvferry_decoder_first", None))
    if getattr(args, "traced_endpoint", None):
        kv.append(("kvferry_traced", None))
    if args.baseline_path:
        kv.append(("kvferry_base", str(Path(args.baseline_path).resolve())))
        if args.decoder_first:
            kv.append(("kvferry_base_decoder_first", str(Path(args.baseline_path).resolve())))
    for name, path in kv:
        px = free_port()
        env = dict(os.environ)
        if path:
            env["PYTHONPATH"] = path
        cmd = [sys.executable, "-m", "kvferry.proxy", "--port", str(px), *instance_flags(args, ps, ds),
               "--health-interval", "30"]
        if args.workers is not None:  # a --baseline-path older than --workers does not start: leave it out
            cmd += ["--workers", str(args.workers)]
        if name.endswith("decoder_first"):
            cmd += ["--first-token", "decoder"]
        if name == "kvferry_traced":
            cmd += ["--otlp-traces-endpoint", args.traced_endpoint]
        if getattr(args, "tokenizer", None):
            cmd += ["--tokenizer", args.tokenizer]
        out[name] = start(cmd, f"http://127.0.0.1:{px}/metrics", env)
        out[name].url = f"http://127.0.0.1:{px}"  # type: ignore[attr-defined]
    binary = None if args.no_vllm_router else vllm_router_binary()
    if binary:
        for name in routers:
            port = free_port()
            cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                   "--prefill", f"http://127.0.0.1:{ps}", "--decode", f"http://127.0.0.1:{ds}",
                   "--prometheus-port", str(free_port()), "--log-level", "error", *ROUTER_POLICIES[name]]
            out[name] = start(cmd, f"http://127.0.0.1:{port}/health")
            out[name].url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return out


def compare(result: dict, args: argparse.Namespace, pairs: list[tuple[str, str]], added_key: str) -> dict:
    """Per (mode, other) pair and concurrency, within each round: the CPU-per-request ratio of mode
    to other, and its added p50 as `added_key` says ("added_p50_ratio_median": the ratio,
    "added_p50_more_ms_median": the difference in ms); medians over rounds (the CPU's range too)."""
    out: dict = {}
    for mode, other in pairs:
        if mode not in result or other not in result:
            continue
        for c in args.concurrency.split(","):
            keys = [c] if args.rounds == 1 else [f"{c}#{r}" for r in range(args.rounds)]
            cpu, added = [], []
            for k in keys:
                now, then = result[mode].get(k, {}), result[other].get(k, {})
                if now.get("cpu_ms_per_request") and then.get("cpu_ms_per_request"):
                    cpu.append(now["cpu_ms_per_request"] / then["cpu_ms_per_request"])
                a = result["added"][mode].get(k, {}).get("p50_ms")
                b = result["added"][other].get(k, {}).get("p50_ms")
                if added_key == "added_p50_ratio_median" and a is not None and b:
                    added.append(a / b)
                elif added_key == "added_p50_more_ms_median" and a is not None and b is not None:
                    added.append(a - b)
            out.setdefault(mode, {})[c] = {
                "cpu_ratio_median": round(statistics.median(cpu), 3) if cpu else None,
                "cpu_ratio_range": [round(min(cpu), 3), round(max(cpu), 3)] if cpu else None,
                added_key: round(statistics.median(added), 3) if added else None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--concurrency", default="1,32,256")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=256)
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--rounds", type=int, default=1, help="measure every target this many times, in turns")
    ap.add_argument("--workers", type=int, default=None,
                    help="kvferry-proxy --workers, for every kvferry target (default: its own)")
    ap.add_argument("--baseline-path", default=None, help="also run the proxy imported from this directory")
    ap.add_argument("--no-vllm-router", action="store_true")
    ap.add_argument("--tokenizer", default=None,
                    help="kvferry-proxy --tokenizer: cache-aware routing tokenizes each prompt (vllm-router's "
                         "default policy asks the engines' /tokenize), e.g. ~/.cache/kvferry/tiny-llama")
    ap.add_argument("--token-delay", type=float, default=0.0,
                    help="seconds the stubs take per token (0: a burst; a real decode step is milliseconds)")
    ap.add_argument("--decoder-first", action="store_true",
                    help="also run kvferry-proxy --first-token decoder (\"kvferry_decoder_first\")")
    ap.add_argument("--lmcache-flags", action="store_true",
                    help="start every kvferry target with LMCache's disagg_proxy_server.py flags "
                         "(--prefiller-host/-port ... --proxy-host/-port) instead of --prefiller/--decoder URLs")
    ap.add_argument("--traced", action="store_true",
                    help="also run kvferry-proxy with every request traced (\"kvferry_traced\")")
    args = ap.parse_args()
    receiver = None
    if args.traced:
        from kvferry.testing.otlp_receiver import OTLPReceiver
        receiver = OTLPReceiver().start()
        args.traced_endpoint = receiver.grpc_endpoint
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    bodies = [request_body(args.endpoint, args.prompt_words, args.tokens, i) for i in range(args.requests)]
    ps, ds = free_port(), free_port()
    stub = [sys.executable, "-m", "kvferry.testing.stub_engine", "--token-delay", str(args.token_delay), "--port"]
    procs = [start([*stub, str(ps)], f"http://127.0.0.1:{ps}/health"),
             start([*stub, str(ds)], f"http://127.0.0.1:{ds}/health")]
    try:
        targets = start_targets(args, ps, ds)
        procs += targets.values()
        result: dict = {"direct": {}, **{name: {} for name in targets}, "added": {name: {} for name in targets},
                        "setup": {"endpoint": args.endpoint, "prompt_words": args.prompt_words,
                                  "tokens": args.tokens, "requests": args.requests, "workers": args.workers,
                                  "tokenizer": args.tokenizer, "lmcache_flags": args.lmcache_flags,
                                  "token_delay": args.token_delay}}
        for rnd in range(args.rounds):
            for c in (int(x) for x in args.concurrency.split(",")):
                key = str(c) if args.rounds == 1 else f"{c}#{rnd}"
                d = result["direct"][key] = measure(f"http://127.0.0.1:{ds}", path, bodies, c, None)
                # Every other round in reverse, so no target always runs first or last.
                for name, p in (list(targets.items())[::-1] if rnd % 2 else targets.items()):
                    r = result[name][key] = measure(p.url, path, bodies, c, p.pid)
                    if r.get("requests"):
                        result["added"][name][key] = {"p50_ms": round(r["p50_latency_ms"] - d["p50_latency_ms"], 3),
                                                      "p99_ms": round(r["p99_latency_ms"] - d["p99_latency_ms"], 3)}
                    if not args.json:
                        print(key, name, r, flush=True)
        result["zero_errors"] = {name: all(r["errors"] == 0 for r in result[name].values()) for name in targets}
        if args.baseline_path:
            result["vs_base"] = compare(result, args, [("kvferry", "kvferry_base"), (
                "kvferry_decoder_first", "kvferry_base_decoder_first")], "added_p50_ratio_median")
        if "vllm_router_rr" in targets:
            result["vs_router_rr"] = compare(result, args, [(m, "vllm_router_rr") for m in (
                "kvferry", "kvferry_decoder_first")], "added_p50_more_ms_median")
        if receiver is not None:
            result["traced_spans_received"] = len(receiver.spans())
        print(json.dumps(result))
    finally:
        if receiver is not None:
            receiver.stop()
        for p in procs:
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
