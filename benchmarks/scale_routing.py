"""Routing cost against cluster size: CPU per routing decision (p50/p99) and proxy CPU per
request at 2, 16, 128 and 1,024 instances, plus an end-to-end point through a real proxy in front
of stub engines. Part of benchmarks/scale_bench.py (`measure(quick)`); runs alone too:

    python benchmarks/scale_routing.py [--quick]

Simulated (in process): half the instances prefillers, half decoders (1 + 1 at 2), registered on
the proxy's own Router (registry, cache view, metrics), each with a KV event stream. A request is
a document (one of 64, 32 blocks of 16 tokens) and a question (4 blocks of its own); documents are
drawn uniformly. Each request is routed (`Router.route`, timed alone in thread CPU time: one
routing decision), counted in flight on its instances until 32 later requests have been routed,
and then its events are fed in: the instance that computed the prompt and the decoder each
publish one BlockStored batch of the prompt's blocks they lacked and, past an engine cache of
2,048 blocks, one BlockRemoved batch of what they evicted (msgpack, decoded and applied by
`KVEventSubscription.apply` as in the proxy). So events arrive at the rate requests do: two or
four batches, about 40 blocks, per request, whatever the instance count. Proxy CPU per request =
the process CPU time of routing, the in-flight counting and the events' ingestion, over the
requests. Health checks and load scrapes (per instance per interval, not per request) are left
out here and are in the end-to-end point.

End to end (not with --quick): kvferry-proxy (`--policy cache`, no KV events: routed by load) in
front of 1 + 1 and 4 + 4 stub engines (`python -m kvferry.testing.stub_engine`), streamed
completions at concurrency 8; the proxy's CPU from /proc per request (benchmarks/proxy_bench.py),
the mean of two runs per size, measured 2, 8, 8, 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections import OrderedDict

import msgspec
from multidict import CIMultiDict

from kvferry.proxy.http.exchange import Request
from kvferry.proxy.instance_flags import InstanceSpec
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.options import parse
from kvferry.proxy.routing.instances import Instance
from kvferry.proxy.routing.kv_event_subscription import BlockRemoved, BlockStored, EventBatch
from kvferry.proxy.routing.prefix_index import prefix_keys
from kvferry.proxy.routing.router import Router
from kvferry.proxy.upstream_client import UpstreamClient

INSTANCES = (2, 16, 128, 1024)
BS = 16
DOCS, DOC_BLOCKS, QUESTION_BLOCKS = 64, 32, 4
ENGINE_BLOCKS = 2048  # what one simulated engine's prefix cache holds
IN_FLIGHT = 32

METHOD = ("in process: Router.route on the proxy's own registry and cache view, N/2 prefillers + N/2 decoders "
          f"with KV event streams; {DOCS} documents x {DOC_BLOCKS} blocks of {BS} tokens + a {QUESTION_BLOCKS}-block "
          f"question; {IN_FLIGHT} requests in flight; events at the request rate (each request: its prompt's new "
          f"blocks stored on the instance that computed it and on the decoder, evictions past {ENGINE_BLOCKS} blocks "
          "per engine, msgpack-decoded by KVEventSubscription.apply). Decision = thread CPU time of one "
          "Router.route; proxy CPU per request = process CPU of routing + in-flight counting + event ingestion. "
          "End to end: kvferry-proxy --policy cache in front of stub engines, proxy CPU from /proc.")


class Engine:
    """What one simulated engine's prefix cache holds (LRU), and the event batches it publishes."""

    def __init__(self) -> None:
        self.held: OrderedDict[bytes, None] = OrderedDict()
        self.seq = 0

    def computed(self, tokens: list[int], keys: list[bytes]) -> list[bytes]:
        """The payloads this engine publishes after computing (or receiving) `tokens`."""
        new = next((i for i, k in enumerate(keys) if k not in self.held), len(keys))
        for k in keys[:new]:
            self.held.move_to_end(k)
        out = []
        if new < len(keys):
            hashes = keys[new:]
            for k in hashes:
                self.held[k] = None
            out.append(EventBatch(time.time(), [BlockStored(hashes, keys[new - 1] if new else None,
                                                            tokens[new * BS:len(keys) * BS], BS, "GPU")]))
        gone = []
        while len(self.held) > ENGINE_BLOCKS:
            gone.append(self.held.popitem(last=False)[0])
        if gone:
            out.append(EventBatch(time.time(), [BlockRemoved(gone, "GPU")]))
        return [msgspec.msgpack.encode(b) for b in out]


def q(xs: list[float], f: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(f * len(s)))]


def quiet() -> None:
    """The proxy's warnings (a stream's state) are not what is measured."""
    logging.getLogger("kvferry").setLevel(logging.ERROR)


class Cluster:
    """`n` simulated instances on the proxy's own Router, with the engines' caches beside them."""

    def __init__(self, n: int, seed: int = 0) -> None:
        opts = parse(["--discovery", "file:///none"])  # instances are registered below
        opts.kv_events_stale_after = 3600.0  # the run is short: no stream goes stale
        prefillers, decoders = max(1, n // 2), max(1, n - n // 2)
        specs = [InstanceSpec("prefiller", f"http://10.0.{i // 250}.{i % 250}:8000") for i in range(prefillers)]
        specs += [InstanceSpec("decoder", f"http://10.1.{i // 250}.{i % 250}:8000") for i in range(decoders)]
        for spec in specs:
            opts.kv_events[spec.url] = (f"ipc:///nonexistent/{spec.url[7:]}", None)
        self.n = n
        self.router = Router(opts, ProxyMetrics(), UpstreamClient(opts))
        insts = [self.router.register(spec) for spec in specs]
        self.streams = self.router.cache.streams
        for stream in self.streams.values():
            stream.last_heard = time.monotonic()  # as if each had just published
        self.engines = {i.id: Engine() for i in insts}
        self.request = Request("POST", "/v1/completions", CIMultiDict())
        self.rng = random.Random(seed)
        self.docs = [[self.rng.randrange(1, 30000) for _ in range(DOC_BLOCKS * BS)] for _ in range(DOCS)]
        self.flight: list[tuple[Instance, Instance | None, int, list[int]]] = []

    def prompt(self) -> list[int]:
        return self.rng.choice(self.docs) + [self.rng.randrange(1, 30000) for _ in range(QUESTION_BLOCKS * BS)]

    def run(self, requests: int) -> tuple[list[float], float, int]:
        """`requests` routed: each decision's thread CPU (us), the process CPU (s) of routing,
        counting and event ingestion, and the event batches ingested."""
        prompts = [self.prompt() for _ in range(requests)]
        decide: list[float] = []
        cpu, published = 0.0, 0
        for tokens in prompts:
            t = time.process_time()
            t0 = time.thread_time_ns()
            r = self.router.route(self.request, tokens, len(tokens))
            decide.append((time.thread_time_ns() - t0) / 1e3)
            r.decoder.counted(r.decoder.active + 1, r.decoder.queued_tokens)
            if r.prefiller is not None:
                r.prefiller.counted(r.prefiller.active + 1, r.prefiller.queued_tokens + len(tokens))
            self.flight.append((r.decoder, r.prefiller, len(tokens), tokens))
            cpu += time.process_time() - t
            if len(self.flight) > IN_FLIGHT:
                d, p, ntok, done = self.flight.pop(0)
                t = time.process_time()
                d.counted(d.active - 1, d.queued_tokens)
                if p is not None:
                    p.counted(p.active - 1, p.queued_tokens - ntok)
                cpu += time.process_time() - t
                keys = prefix_keys(done, BS)
                for inst in (d,) if p is None else (p, d):
                    for payload in self.engines[inst.id].computed(done, keys):  # the engine's work, not timed
                        s = self.streams[inst.id]
                        t = time.process_time()
                        s.apply((s.last_seq or 0) + 1, payload)
                        cpu += time.process_time() - t
                        published += 1
        return decide, cpu, published

    def close(self) -> None:
        for s in self.streams.values():
            s.close()


def simulate(sizes: tuple[int, ...], requests: int, warm: int, rounds: int) -> list[dict]:
    """Every cluster size, measured in turns (`rounds` rounds of requests/rounds each, after `warm`
    requests): the machine's speed drifts, and each size sees the same drift."""
    clusters = [Cluster(n) for n in sizes]
    try:
        for c in clusters:
            c.run(warm)
        decide: dict[int, list[float]] = {c.n: [] for c in clusters}
        cpu: dict[int, list[float]] = {c.n: [] for c in clusters}
        published = dict.fromkeys(decide, 0)
        per = max(1, requests // rounds)
        for rnd in range(rounds):
            for c in clusters if rnd % 2 == 0 else clusters[::-1]:
                d, t, e = c.run(per)
                decide[c.n] += d
                cpu[c.n].append(t / per)
                published[c.n] += e
        return [{"instances": c.n, "decision_p50_us": round(statistics.median(decide[c.n]), 1),
                 "decision_p99_us": round(q(decide[c.n], 0.99), 1),
                 "proxy_cpu_us_per_request": round(statistics.median(cpu[c.n]) * 1e6, 1),
                 "event_batches_per_request": round(published[c.n] / (per * rounds), 2),
                 "indexed_blocks": sum(len(s.index) for s in c.streams.values()), "requests": per * rounds}
                for c in clusters]
    finally:
        for c in clusters:
            c.close()


def end_to_end(pairs: int, requests: int) -> dict:
    """Proxy CPU per request through kvferry-proxy in front of `pairs` prefiller and decoder stubs."""
    import os
    import subprocess

    import proxy_bench  # this script's folder is first on sys.path

    from kvferry.common.netutil import free_port
    stub = [sys.executable, "-m", "kvferry.testing.stub_engine", "--port"]
    procs: list[subprocess.Popen] = []
    try:
        ports = [free_port() for _ in range(2 * pairs)]
        for p in ports:
            procs.append(proxy_bench.start([*stub, str(p)], f"http://127.0.0.1:{p}/health"))
        px = free_port()
        cmd = [sys.executable, "-m", "kvferry.proxy", "--port", str(px), "--workers", "1", "--policy", "cache",
               "--health-interval", "2"]
        for p in ports[:pairs]:
            cmd += ["--prefiller", f"http://127.0.0.1:{p}"]
        for p in ports[pairs:]:
            cmd += ["--decoder", f"http://127.0.0.1:{p},{free_port()},{free_port()}"]
        proxy = proxy_bench.start(cmd, f"http://127.0.0.1:{px}/metrics")
        procs.append(proxy)
        bodies = [proxy_bench.request_body("completions", 64, 8, i) for i in range(requests)]
        row = proxy_bench.measure(f"http://127.0.0.1:{px}", "/v1/completions", bodies, 8, proxy.pid)
        return {"instances": 2 * pairs, "proxy_cpu_us_per_request": round(row["cpu_ms_per_request"] * 1e3, 1),
                "requests": row["requests"], "errors": row["errors"], "req_per_s": row["req_per_s"]}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 15)
                p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass


def measure(quick: bool) -> dict:
    """The routing curves (scale_bench.py's interface)."""
    requests, warm, rounds = (1600, 400, 8) if quick else (8000, 2000, 20)
    quiet()
    points = simulate(INSTANCES, requests, warm, rounds)
    by = {p["instances"]: p for p in points}
    out: dict = {"method": METHOD, "points": points,
                 "routing_p99_ratio_1024_vs_16": round(by[1024]["decision_p99_us"] / by[16]["decision_p99_us"], 2),
                 "proxy_cpu_ratio_1024_vs_2": round(by[1024]["proxy_cpu_us_per_request"]
                                                     / by[2]["proxy_cpu_us_per_request"], 2)}
    if quick:
        out["end_to_end"] = "skipped with --quick (stub engines take longer to start than CI allows)"
    else:
        runs: dict[int, list[dict]] = {1: [], 4: []}
        for pairs in (1, 4, 4, 1):  # in turns: neither size always runs first
            runs[pairs].append(end_to_end(pairs, 1000))
        out["end_to_end"] = [{**rs[0], "proxy_cpu_us_per_request": round(statistics.mean(
            r["proxy_cpu_us_per_request"] for r in rs), 1), "runs_us": [r["proxy_cpu_us_per_request"] for r in rs]}
            for rs in runs.values()]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(measure(ap.parse_args().quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
