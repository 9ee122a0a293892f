"""Discovery: how fast two proxies follow etcd, and how evenly they share two prefillers.

    python benchmarks/discovery_bench.py --json [--rounds 5] [--requests 400] [--concurrency 8]

A real etcd, two kvferry proxies (separate processes, `--discovery etcd://...`, the cluster secret
on), stub engines (testing/stub_engine.py) registered by `kvferry join --attach` sidecars (lease
TTL 2 s). Per round a third prefiller joins and its sidecar is then SIGKILLed:

- ``join_to_routed_p50_s``: from the registration's etcd event until both proxies list it as
  usable (the next request may go there); target <= 2.
- ``expiry_to_unrouted_p50_s``: from the lease's expiry (etcd's delete event) until neither proxy
  lists it; ``kill_to_unrouted_p50_s`` adds the lease TTL.
- ``balance_max_over_min``: both proxies send `--requests` completions each, `--concurrency` at a
  time, to two prefillers that compute one request at a time (``--max-running 1``, 20 ms each):
  the most requests one prefiller got over the fewest; target <= 1.3. The same load with the
  proxies' /metrics scrapes off (each sees only its own requests) is ``balance_no_scrape``.
- ``pinned_balance_*``: the same, but the first proxy's requests all go to one prefiller (one
  affinity key: what cache hits on one instance do); the second proxy, seeing the engines' queues,
  should send its requests to the other one. With scrapes off it cannot know.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvferry.common import secret
from kvferry.common.discovery import sources as disc
from kvferry.common.discovery.etcd import Etcd
from kvferry.common.netutil import free_port
from kvferry.launcher import services
from kvferry.testing.processes import wait_http

ADMIN = {"Authorization": "Bearer bench-admin-key"}


class Procs:
    def __init__(self, work: Path) -> None:
        self.work, self.all = work, []

    def start(self, name: str, args: list[str], probe: str | None = None) -> subprocess.Popen:
        with open(self.work / f"{name}.log", "ab") as out:
            p = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.all.append(p)
        if probe is not None:
            wait_http(probe, p, 30, self.work / f"{name}.log")
        return p

    def stop_all(self) -> None:
        for p in reversed(self.all):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.all:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def instances(proxy: str) -> dict[str, dict]:
    r = httpx.get(f"{proxy}/admin/instances", headers=ADMIN, timeout=5)
    return {i["instance_id"]: i for i in r.json()["instances"] if "instance_id" in i}


def until(pred, timeout: float, every: float = 0.01) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not met")
        time.sleep(every)
    return time.monotonic()


class Watch:
    """etcd events under the prefix, with the time each arrived (the benchmark's clock for
    "registered" and "expired")."""

    def __init__(self, endpoint: str, prefix: str) -> None:
        import threading
        self.events: list[tuple[float, str, bytes]] = []
        self._stop = False

        async def run() -> None:
            etcd = Etcd(endpoint)
            _, rev = await etcd.get_prefix(prefix.encode())
            try:
                async for evs in etcd.watch(prefix.encode() + b"/", rev + 1, 3600):
                    now = time.monotonic()
                    self.events += [(now, e.kind, e.kv.key) for e in evs]
                    if self._stop:
                        return
            finally:
                await etcd.close()
        self.thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
        self.thread.start()

    def when(self, kind: str, key: bytes, after: float, timeout: float = 15) -> float:
        until(lambda: any(t >= after and k == kind and kk == key for t, k, kk in self.events), timeout)
        return next(t for t, k, kk in self.events if t >= after and k == kind and kk == key)


async def send_load(proxies: list[str], requests: int, concurrency: int, pinned: bool) -> int:
    """`pinned`: the first proxy's requests all carry one affinity key (one prefiller takes them
    all, as cache hits on one instance would); the second proxy's are routed by load."""
    errors = 0
    async with httpx.AsyncClient(timeout=30) as client:
        async def worker(proxy: str, n: int, headers: dict) -> None:
            nonlocal errors
            for _ in range(n):
                r = await client.post(f"{proxy}/v1/completions", headers=headers,
                                      json={"model": "stub", "prompt": "balance", "max_tokens": 2})
                errors += r.status_code != 200
        per = requests // concurrency
        await asyncio.gather(*(worker(px, per, {"x-session": "one"} if pinned and i == 0 else {})
                               for i, px in enumerate(proxies) for _ in range(concurrency)))
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400, help="completions per proxy for the balance")
    ap.add_argument("--concurrency", type=int, default=8, help="in flight per proxy")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvferry-discovery-bench-"))
    procs = Procs(work)
    etcd = services.start_etcd(work)
    try:
        secret_file = work / "cluster.secret"
        secret.write_file(str(secret_file), secret.generate())
        prefix = "/bench"
        target = f"etcd://127.0.0.1:{etcd.port}{prefix}"
        watch = Watch(f"http://127.0.0.1:{etcd.port}", prefix)
        stubs = {}
        for name in ("p1", "p2", "p3", "d1"):
            port = free_port()
            extra = ["--prompt-delay", "0.02", "--max-running", "1"] if name in ("p1", "p2") else []
            procs.start(name, ["-m", "kvferry.testing.stub_engine", "--port", str(port), *extra],
                        f"http://127.0.0.1:{port}/health")
            stubs[name] = f"http://127.0.0.1:{port}"

        def join(name: str, role: str) -> subprocess.Popen:
            args = ["-m", "kvferry.launcher", "join", "--discovery", target, "--role", role, "--attach", stubs[name],
                    "--model", "stub", "--instance-id", name, "--lease-ttl", "2",
                    "--cluster-secret-file", str(secret_file)]
            if role == "decoder":
                args += ["--init-ports", str(free_port()), "--alloc-ports", str(free_port())]
            return procs.start(f"join-{name}", args)

        def proxies(tag: str, *extra: str) -> list[str]:
            out = []
            for i in range(2):
                port = free_port()
                procs.start(f"proxy-{tag}-{i}", ["-m", "kvferry.proxy", "--port", str(port), "--discovery", target,
                                                 "--cluster-secret-file", str(secret_file), "--admin-key",
                                                 "bench-admin-key", *extra], f"http://127.0.0.1:{port}/metrics")
                out.append(f"http://127.0.0.1:{port}")
            return out

        for name, role in (("p1", "prefiller"), ("p2", "prefiller"), ("d1", "decoder")):
            join(name, role)
        pxs = proxies("main", "--affinity-header", "x-session")
        until(lambda: all({"p1", "p2", "d1"} <= set(instances(p)) for p in pxs), 15)

        join_s, expiry_s, kill_s = [], [], []
        key = disc.record_key(prefix, "p3")
        for _ in range(a.rounds):
            t0 = time.monotonic()
            j = join("p3", "prefiller")
            t_reg = watch.when("put", key, t0)
            t_seen = until(lambda: all("p3" in instances(p) and instances(p)["p3"]["healthy"] for p in pxs), 15)
            join_s.append(t_seen - t_reg)
            time.sleep(0.5)
            os.killpg(j.pid, signal.SIGKILL)
            j.wait(5)
            t_kill = time.monotonic()
            t_exp = watch.when("delete", key, t_kill)
            t_gone = until(lambda: not any("p3" in instances(p) for p in pxs), 15)
            expiry_s.append(t_gone - t_exp)
            kill_s.append(t_gone - t_kill)

        def balance(pxs: list[str], pinned: bool = False) -> tuple[float, dict, int]:
            for s in ("p1", "p2"):
                httpx.post(f"{stubs[s]}/stub/reset", timeout=5)
            errors = asyncio.run(send_load(pxs, a.requests, a.concurrency, pinned))
            counts = {s: len(httpx.get(f"{stubs[s]}/stub/log", timeout=5).json()["requests"]) for s in ("p1", "p2")}
            return max(counts.values()) / max(1, min(counts.values())), counts, errors

        bal, counts, errors = balance(pxs)
        pin, pin_counts, e2 = balance(pxs, pinned=True)
        blind = proxies("blind", "--load-interval", "0", "--affinity-header", "x-session")
        until(lambda: all({"p1", "p2", "d1"} <= set(instances(p)) for p in blind), 15)
        bal0, counts0, e3 = balance(blind)
        pin0, pin_counts0, e4 = balance(blind, pinned=True)
        errors += e2 + e3 + e4
        watch._stop = True
        result = {
            "join_to_routed_p50_s": round(statistics.median(join_s), 3),
            "join_to_routed_max_s": round(max(join_s), 3),
            "expiry_to_unrouted_p50_s": round(statistics.median(expiry_s), 3),
            "kill_to_unrouted_p50_s": round(statistics.median(kill_s), 3),
            "lease_ttl_s": 2,
            "balance_max_over_min": round(bal, 3),
            "balance_requests": counts,
            "balance_no_scrape": round(bal0, 3),
            "balance_no_scrape_requests": counts0,
            "pinned_balance_max_over_min": round(pin, 3),
            "pinned_balance_requests": pin_counts,
            "pinned_balance_no_scrape": round(pin0, 3),
            "pinned_balance_no_scrape_requests": pin_counts0,
            "errors": errors,
            "rounds": a.rounds,
            "requests_per_proxy": a.requests,
            "concurrency_per_proxy": a.concurrency,
        }
    finally:
        procs.stop_all()
        etcd.stop()
    print(json.dumps(result, indent=None if a.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
