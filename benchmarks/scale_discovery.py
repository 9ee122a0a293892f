"""Discovery at scale: join-to-routed, proxy CPU and etcd writes vs registered instances and proxies.

    python benchmarks/scale_discovery.py [--quick]      # one JSON line

A real etcd (kvferry.launcher.services), 1-10 kvferry proxies (separate processes, ``--workers 1``,
the cluster secret on) watching it, and N registered instances: N ``Registration`` objects in one
registrar child process (the etcd traffic N ``kvferry join`` sidecars make: a lease, the signed
record, and every TTL/3 a keepalive and the record re-written), their URLs pointing at nothing on
loopback. One real stub engine (testing/stub_engine.py) joins and leaves per round; its
join-to-routed runs from its registration's put (acknowledged by etcd) until every proxy lists it
healthy in /admin/instances. scale_bench.py imports `measure`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvferry.common import secret
from kvferry.common.discovery import sources as disc
from kvferry.common.discovery.etcd import EtcdError
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.launcher import services
from kvferry.launcher.vllm_proc import die_with_parent
from kvferry.testing.processes import wait_http

ADMIN_KEY = "scale-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TTL_S = disc.DEFAULT_TTL_S  # kvferry join's default --lease-ttl
BIG_TTL_S = 20  # the lease TTL of instances 101-1,000 (ttl_for)
REGISTRARS = 4  # processes holding the registrations (one Python loop cannot renew 1,000 every TTL/3 here)
POLL_S = 0.05  # /admin/instances polls while timing a join (each lists every instance)


def _record(iid: str, url: str, role: str = "prefiller", ports: int = 0) -> m.InstanceRecord:
    extra: dict[str, Any] = {"init_ports": [ports], "alloc_ports": [ports + 1]} if role == "decoder" else {}
    return m.InstanceRecord(instance_id=iid, role=role, model="stub", url=url,
                            fingerprint=disc.fingerprint("stub"), **extra)


def _fake(i: int) -> m.InstanceRecord:
    """An instance nobody serves: a loopback address whose port 9 refuses at once; every 4th a decoder."""
    url = f"http://127.1.{i // 200}.{i % 200 + 1}:9"
    return _record(f"fake-{i}", url, "decoder" if i % 4 == 3 else "prefiller", 20000)


class _Counted(disc.Registration):
    """A Registration that counts its lost leases (registered again: the registrar fell behind)."""

    lost = 0

    async def register(self) -> None:
        if self.lease:
            _Counted.lost += 1
        await super().register()


async def _registrar(conn, target_text: str, secret_path: str, ttl: int, shard: int, shards: int) -> None:
    target = disc.parse_target(target_text)
    key = secret.from_file(secret_path, "bench")
    loop = asyncio.get_running_loop()
    live: dict[str, tuple[disc.Registration, asyncio.Event, asyncio.Task]] = {}
    grown = 0

    async def add(rec: m.InstanceRecord, stagger: bool, ttl: int = ttl) -> float:
        reg = _Counted(target, rec, key, ttl)  # its own etcd client, as a sidecar has
        for attempt in range(5):
            try:
                await reg.register()
                break
            except EtcdError:
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5)
        at = time.monotonic()
        stop = asyncio.Event()

        async def beat() -> None:
            if stagger:  # registrars in a real cluster are out of phase
                await asyncio.sleep(random.uniform(0, ttl / 3))
            await reg.keep_alive(stop)
        live[rec.instance_id] = (reg, stop, asyncio.ensure_future(beat()))
        return at

    try:
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "grow":  # this shard's fakes up to cmd[1] in all, with lease TTL cmd[2]
                mine = [i for i in range(grown, cmd[1]) if i % shards == shard]
                for lo in range(0, len(mine), 50):
                    await asyncio.gather(*(add(_fake(i), True, cmd[2]) for i in mine[lo:lo + 50]))
                grown = max(grown, cmd[1])
                conn.send(cmd[1])
            elif cmd[0] == "lost":
                conn.send(_Counted.lost)
            elif cmd[0] == "join":
                conn.send(await add(_record(cmd[1], cmd[2]), False))
            elif cmd[0] == "leave":
                reg, stop, task = live.pop(cmd[1])
                stop.set()
                await task
                await reg.withdraw()
                await reg.close()
                conn.send(True)
            else:
                break
    finally:
        for _, stop, task in live.values():
            stop.set()
            task.cancel()
        await asyncio.gather(*(t for _, _, t in live.values()), return_exceptions=True)
        await asyncio.gather(*(reg.close() for reg, _, _ in live.values()), return_exceptions=True)


def registrar_main(conn, target_text: str, secret_path: str, ttl: int, shard: int, shards: int) -> None:
    """One of the registrations' processes (every `shards`-th fake instance, from `shard`)."""
    die_with_parent()
    asyncio.run(_registrar(conn, target_text, secret_path, ttl, shard, shards))


class Registrar:
    """The registrar child, driven over a pipe."""

    def __init__(self, target: str, secret_path: str, ttl: int, shard: int = 0, shards: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=registrar_main, args=(child, target, secret_path, ttl, shard, shards),
                                daemon=True)
        self.proc.start()

    def ask(self, *cmd: Any, timeout: float = 120) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"registrar: no answer to {cmd[0]}")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Procs:
    """Child processes that die with this one; stop_all() ends them (SIGTERM, then SIGKILL)."""

    def __init__(self, work: Path) -> None:
        self.work, self.all = work, []  # type: ignore[var-annotated]

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.work / f"{name}.log", "ab") as out:
            p = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                 preexec_fn=die_with_parent)
        self.all.append(p)
        return p

    def stop(self, procs: list[subprocess.Popen]) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            if p in self.all:
                self.all.remove(p)

    def stop_all(self) -> None:
        self.stop(list(reversed(self.all)))


def etcd_counters(port: int) -> dict[str, float]:
    """etcd's own write counters: mvcc puts (plain and in transactions) and raft proposals committed."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    want = ("etcd_mvcc_put_total", "etcd_debugging_mvcc_put_total", "etcd_mvcc_txn_total",
            "etcd_server_proposals_committed_total")
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[name] = float(value)
    return out


def cpu_seconds(pids: list[int]) -> list[float]:
    """user + system CPU seconds of each process and its descendants (/proc/PID/stat via psutil)."""
    out = []
    for pid in pids:
        p = psutil.Process(pid)
        total = 0.0
        for q in [p, *p.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = q.cpu_times()
                total += t.user + t.system
        out.append(total)
    return out


async def _until_all(urls: list[str], pred, timeout: float) -> float:
    """Poll each proxy's /admin/instances until `pred(listing)` holds on every one; the time it held
    on the last."""
    last = 0.0
    async with httpx.AsyncClient(timeout=30, headers=ADMIN) as client:
        async def one(url: str) -> None:
            nonlocal last
            deadline = time.monotonic() + timeout
            while True:
                r = await client.get(f"{url}/admin/instances")
                now = time.monotonic()
                if pred({i["instance_id"]: i for i in r.json()["instances"] if "instance_id" in i}):
                    last = max(last, now)
                    return
                if now > deadline:
                    raise TimeoutError(f"{url}: condition not met within {timeout:g}s")
                await asyncio.sleep(POLL_S)
        await asyncio.gather(*(one(u) for u in urls))
    return last


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def point(procs: Procs, regs: list[Registrar], etcd_port: int, etcd_pid: int, target: str, secret_path: Path,
          stub: str, n: int, n_proxies: int, rounds: int, window: float) -> dict:
    """One (instances, proxies) point: start the proxies, measure CPU and etcd writes over `window`
    seconds, then `rounds` joins of the stub; the proxies are stopped after."""
    ports = [free_port() for _ in range(n_proxies)]
    pxs = [procs.start(f"proxy-{n}-{n_proxies}-{i}",
                       ["-m", "kvferry.proxy", "--port", str(port), "--discovery", target, "--cluster-secret-file",
                        str(secret_path), "--admin-key", ADMIN_KEY, "--workers", "1", "--health-interval", "3600",
                        "--load-interval", "0"]) for i, port in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for p, url, proc in zip(ports, urls, pxs, strict=True):
            wait_http(f"{url}/metrics", proc, 60, procs.work / f"proxy-{n}-{n_proxies}-{ports.index(p)}.log")
        asyncio.run(_until_all(urls, lambda seen: sum(k.startswith("fake-") for k in seen) >= n, 120))
        time.sleep(1.0)  # the initial listing and first probes done
        pids = [p.pid for p in pxs]
        lost0 = sum(r.ask("lost") for r in regs)
        reg = regs[0]
        c0, e0, t0 = cpu_seconds(pids + [etcd_pid]), etcd_counters(etcd_port), time.monotonic()
        time.sleep(window)
        c1, e1, t1 = cpu_seconds(pids + [etcd_pid]), etcd_counters(etcd_port), time.monotonic()
        cpu = [(b - a) / (t1 - t0) for a, b in zip(c0, c1, strict=True)]
        etcd_cpu = cpu.pop()
        rates = {k: (e1[k] - e0.get(k, 0.0)) / (t1 - t0) / n for k in e1}
        joins = []
        for k in range(rounds):
            iid = f"stub-{k}"
            t_put = reg.ask("join", iid, stub)
            t_seen = asyncio.run(_until_all(urls, lambda seen, iid=iid: seen.get(iid, {}).get("healthy", False), 30))
            joins.append(t_seen - t_put)
            reg.ask("leave", iid)
            asyncio.run(_until_all(urls, lambda seen, iid=iid: iid not in seen, 30))
        lost = sum(r.ask("lost") for r in regs) - lost0
    finally:
        procs.stop(pxs)
    puts = rates.get("etcd_mvcc_put_total", rates.get("etcd_debugging_mvcc_put_total", 0.0))
    return {"instances": n, "proxies": n_proxies, "join_to_routed_p50_s": round(statistics.median(joins), 3),
            "join_to_routed_p99_s": round(_pct(joins, 0.99), 3), "join_to_routed_max_s": round(max(joins), 3),
            "rounds": rounds, "proxy_cpu_cores_mean": round(statistics.mean(cpu), 4),
            "proxy_cpu_cores_max": round(max(cpu), 4),
            "proxy_cpu_cores": [round(c, 4) for c in cpu], "cpu_window_s": round(t1 - t0, 2),
            "etcd_puts_per_instance_per_s": round(puts, 3), "leases_lost": lost,
            "etcd_cpu_cores": round(etcd_cpu, 3),
            "etcd_proposals_per_instance_per_s": round(rates.get("etcd_server_proposals_committed_total", 0.0), 3)}


def ttl_for(n: int, quick: bool) -> int:
    """The lease TTL of the instances added to reach `n`: kvferry join's default, but longer past 100
    in the full run (this VM's etcd, on a share of 2 cores beside 10 proxies, cannot take 1,000
    keepalives and re-writes every 1.67 s through its JSON gateway: leases expire and re-register)."""
    return TTL_S if quick or n <= 100 else BIG_TTL_S


def measure(quick: bool) -> dict:
    """Every point, its checks, and the headline keys (the 1,000 x 10 ones from a full run only)."""
    sizes, proxies = ([10, 100], [1, 2]) if quick else ([10, 100, 1000], [1, 10])
    rounds, window = (3, 2.0) if quick else (10, 10.0)
    # etcd's data on tmpfs where there is one: its fsyncs on this VM's disk would be what is measured
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="kvferry-scale-discovery-", dir=shm if shm.is_dir() else None))
    procs = Procs(work)
    etcd = services.start_etcd(work)
    regs: list[Registrar] = []
    points = []
    try:
        secret_path = work / "cluster.secret"
        secret.write_file(str(secret_path), secret.generate())
        target = f"etcd://127.0.0.1:{etcd.port}/scale"
        sport = free_port()
        stub = procs.start("stub", ["-m", "kvferry.testing.stub_engine", "--port", str(sport)])
        wait_http(f"http://127.0.0.1:{sport}/health", stub, 30, work / "stub.log")
        shards = 1 if quick else REGISTRARS
        regs = [Registrar(target, str(secret_path), TTL_S, i, shards) for i in range(shards)]
        for n in sizes:
            for r in regs:
                r.conn.send(("grow", n, ttl_for(n, quick)))
            for r in regs:
                if not r.conn.poll(300):
                    raise TimeoutError("registrar: grow")
                r.conn.recv()
            for p in proxies:
                try:
                    points.append(point(procs, regs, etcd.port, etcd.proc.pid, target, secret_path,
                                        f"http://127.0.0.1:{sport}", n, p, rounds, window))
                except (TimeoutError, httpx.HTTPError, RuntimeError) as e:  # overloaded: said, not fatal
                    points.append({"instances": n, "proxies": p, "error": repr(e)[:300]})
                print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    finally:
        for r in regs:
            r.stop()
        procs.stop_all()
        etcd.stop()
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    done = [p for p in points if "error" not in p]
    top = max(done, key=lambda p: (p["instances"], p["proxies"])) if done else {}
    full = next((p for p in done if (p["instances"], p["proxies"]) == (1000, 10)), {})
    checks = [{"name": "every_point_measured", "ok": len(done) == len(points),
               "detail": "; ".join(f"{p['instances']} x {p['proxies']}: {p['error']}" for p in points
                                   if "error" in p) or f"{len(points)} points"}]
    if not quick:  # on a loaded CI machine a starved registrar may miss a renewal: the shape still holds
        checks.append({"name": "no_lease_lost", "ok": all(p["leases_lost"] == 0 for p in done),
                       "detail": ", ".join(f"{p['instances']} x {p['proxies']}: {p['leases_lost']}" for p in done)})
    return {
        "method": (
            f"One real etcd, 1-{max(proxies)} kvferry proxies (--workers 1, cluster secret, --health-interval 3600 "
            "and --load-interval 0 so probes and scrapes of the unreachable instances do not dominate) and N "
            f"instances registered by Registration objects in {shards} registrar process(es) (lease TTL {TTL_S}s: a "
            f"keepalive and a re-signed record every {TTL_S / 3:.2f}s each, phases spread; in the full run instances "
            f"101-1,000 have TTL {BIG_TTL_S}s, as this VM's etcd could not renew 1,000 every {TTL_S / 3:.2f}s "
            "beside 10 proxies: etcd_cpu_cores shows its share). Join-to-routed: from "
            "etcd acknowledging a stub engine's registration until every proxy lists it healthy in "
            f"/admin/instances (polled every {POLL_S * 1000:.0f} ms), {rounds} rounds per point. Proxy CPU: user+"
            f"system seconds per second of each proxy process over {window:g}s with the N instances renewing; "
            "etcd writes: etcd's own /metrics counters (mvcc puts, raft proposals) over the same window, divided "
            "by N; leases_lost: registrations whose lease ran out because renewals fell behind (this machine's "
            "CPU). etcd's data is on tmpfs (/dev/shm) where there is one. "
            "On a 2-core VM shared with other work: "
            "noisy."),
        "points": points,
        "checks": checks,
        # 1,000 instances and 10 proxies (absent with --quick, whose largest point is smaller)
        **({"join_to_routed_p50_s_1000": full["join_to_routed_p50_s"],
            "join_to_routed_p99_s_1000": full["join_to_routed_p99_s"]} if full else {}),
        "join_to_routed_largest": {k: top.get(k) for k in ("instances", "proxies", "join_to_routed_p50_s",
                                                           "join_to_routed_p99_s")},
        # at kvferry join's default TTL (the largest such point)
        "etcd_writes_per_instance_per_s": max((p for p in done if p["instances"] <= 100),
                                              key=lambda p: (p["instances"], p["proxies"]),
                                              default={}).get("etcd_puts_per_instance_per_s"),
        "etcd_writes_expected_per_instance_per_s": round(3 / TTL_S, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(measure(ap.parse_args().quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
