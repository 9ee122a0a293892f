"""State kept per instance goes with the instance (docs/security.md "Bounded state"): register and
withdraw churn through a real etcd leaves a real proxy's open descriptors and /metrics series
where they were (abort sockets, KV-event streams, metric label sets, caches), a `--workers 2`
proxy keeps adding instances past its load board's rows, and the admin-change log the workers
share stays bounded, replays current state only and survives a bad line."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from kvferry.common.discovery import sources as disc
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.launcher.vllm_proc import stop_group
from kvferry.proxy import metrics as metrics_mod
from kvferry.proxy.multiproc import admin_log as peers_mod
from kvferry.proxy.multiproc import board as board_mod
from kvferry.proxy.multiproc.admin_log import Peers
from kvferry.proxy.multiproc.board import BoardFull, LoadBoard
from kvferry.testing.processes import wait_http
from tests.polling import until
from tests.stub_procs import (
    stub,
)

EOS_FIRST = {"model": "stub", "prompt": "<eos-first> churn", "max_tokens": 4}  # a prefill that ends the request


class Proxy:
    """A kvferry-proxy process whose log goes to a file (churn logs more than a pipe holds)."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.url, self.log = f"http://127.0.0.1:{port}", tmp / f"proxy-{port}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvferry.proxy", "--port", str(port), *args],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **(env or {})})
        wait_http(self.url + "/metrics", self.proc, 60, self.log)

    def stop(self) -> None:
        stop_group(self.proc, 10)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def series(self) -> int:
        return sum(1 for ln in self.metrics().splitlines() if ln and not ln.startswith("#"))

    def discovered(self) -> int:
        return round(sum(float(v) for v in re.findall(r"^kvferry_proxy_discovery_instances\{[^}]*\} (\S+)$",
                                                       self.metrics(), re.M)))


@pytest.fixture
def proxies() -> Iterator[list[Proxy]]:
    started: list[Proxy] = []
    yield started
    for p in started:
        p.stop()


def _record(iid: str, role: str, url: str, kv_events: list[str] | None = None, port: int = 9) -> m.InstanceRecord:
    """A decoder's receiver is on loopback at `port` (where the proxy sends its aborts)."""
    ports = {"init_ports": [9], "alloc_ports": [port], "receiver_host": "127.0.0.1"} if role == "decoder" else {}
    return m.InstanceRecord(instance_id=iid, role=role, model="stub", url=url, fingerprint=disc.fingerprint("stub"),
                            kv_events=kv_events or [], **ports)


# ---- 2,000 register/withdraw cycles through etcd against one proxy process ----

BATCH, BATCHES = 100, 20  # 2,000 cycles, a batch at a time
DECODERS = 90  # of a batch; the rest prefillers, with KV-event endpoints
ABORTS = 20  # requests per batch: each ends at its prefill and aborts its transfer on a distinct decoder


class AllocPort:
    """Where every churned decoder's abort socket connects (its alloc port): counts the
    connections made and those still open (a plain TCP listener: no ZMTP answer is needed)."""

    def __init__(self) -> None:
        self.made = self.open = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.made += 1
        self.open += 1
        try:
            while await reader.read(4096):
                pass
        finally:
            self.open -= 1
            writer.close()


def test_security_instance_churn_leaves_fds_and_series_at_baseline(etcd_server, cluster_secret, tmp_path: Path,
                                                                   proxies: list[Proxy]) -> None:
    """Decoders whose aborts reach a listener here and prefillers at closed ports with KV-event
    streams: after 2,000 of them came and went, no abort socket is left connected, and the proxy's
    descriptors and series are back where they were after the first batch."""
    secret_file, key = cluster_secret
    prefix = f"/kvferry-churn-{os.getpid()}"
    target = disc.parse_target(f"etcd://127.0.0.1:{etcd_server.port}{prefix}")
    p0 = stub()
    px = Proxy(tmp_path, "--discovery", str(target), "--cluster-secret-file", str(secret_file), "--prefiller", p0.url,
               "--policy", "round_robin", "--health-interval", "3", "--log-level", "warning")
    proxies.append(px)

    async def churn() -> tuple[AllocPort, int, int, float]:
        alloc = AllocPort()
        port = await alloc.start()
        # One registration (one etcd client) per slot, reused: each batch registers new records.
        regs = [disc.Registration(target, _record("x", "prefiller", "http://127.0.0.1:9"), key, ttl=60)
                for _ in range(BATCH)]
        fds, series, t0 = 0, 0, 0.0
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                for b in range(BATCHES + 1):  # batch 0 warms up: lazily made sockets and threads
                    for i, reg in enumerate(regs):
                        if i < DECODERS:
                            reg.record = _record(f"c{b}-{i}", "decoder", f"http://127.1.{b}.{i + 1}:9", port=port)
                        else:
                            reg.record = _record(f"c{b}-{i}", "prefiller", f"http://127.2.{b}.{i + 1}:9",
                                                 [f"ipc://{tmp_path}/ev-{b}-{i}.sock"])
                    await asyncio.gather(*(r.register() for r in regs))
                    await asyncio.to_thread(until, lambda: px.discovered() == BATCH, 20.0, f"batch {b} in the proxy")
                    made = alloc.made
                    await asyncio.gather(*(client.post(px.url + "/v1/completions", json=EOS_FIRST)
                                           for _ in range(ABORTS)))
                    await asyncio.to_thread(until, lambda made=made: alloc.made - made >= ABORTS // 2, 20.0,
                                            f"batch {b}'s aborts at their decoders")
                    # Half withdrawn (deleted, then the lease revoked), half by their lease ending.
                    await asyncio.gather(*(r.withdraw() if i % 2 else r.etcd.revoke(r.lease)
                                           for i, r in enumerate(regs)))
                    await asyncio.to_thread(until, lambda: px.discovered() == 0, 20.0, f"batch {b} gone from the proxy")
                    await asyncio.to_thread(until, lambda: alloc.open == 0, 20.0, f"batch {b}'s abort sockets closed")
                    if b == 0:
                        fds, series, t0 = px.fds(), px.series(), time.monotonic()
        finally:
            await asyncio.gather(*(r.close() for r in regs))
            alloc.server.close()
        return alloc, fds, series, time.monotonic() - t0

    alloc, fds, series, took = asyncio.run(churn())
    assert alloc.made >= BATCHES * ABORTS // 2  # (each batch waited for half its aborts, at least)
    until(lambda: px.fds() <= fds * 1.05, 60, f"open descriptors back near {fds} (now {px.fds()})")
    until(lambda: px.series() <= series * 1.05, 60, f"/metrics series back near {series} (now {px.series()})")
    assert set(re.findall(r'instance="([^"]+)"', px.metrics())) <= {"p0", "proxy"}  # no churned one's left
    print(f"{BATCH * BATCHES} register/withdraw cycles in {took:.1f} s, {alloc.made} abort sockets; "
          f"descriptors {fds}, series {series}")


# ---- --workers 2: more instances over the proxy's life than the load board has rows ----

def test_security_workers_route_past_the_board_rows(tmp_path: Path, proxies: list[Proxy]) -> None:
    """1,025 distinct instances come and go (a watched discovery file, in waves) through a
    --workers 2 proxy: discovery keeps running, the 1,025th is routed by every worker, and /metrics
    shows no series of the instances gone. A bad line in the admin-change log fails no request."""
    p_last, d0 = stub(), stub()
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"instances": [], "drain": []}))
    px = Proxy(tmp_path, "--workers", "2", "--discovery", f"file://{path}", "--decoder",
               f"{d0.url},{free_port()},{free_port()}", "--health-interval", "1", "--log-level", "warning",
               "--admin-key", ADMIN_KEY, env={"TMPDIR": str(tmp_path)})
    proxies.append(px)
    series = _series(px.metrics())
    rows = board_mod.ROWS
    waves = [range(i, i + 256) for i in range(0, rows, 256)] + [range(rows, rows + 1)]
    for n, wave in enumerate(waves):
        recs = [_record(f"w{i}", "prefiller", f"http://127.3.{i // 250}.{i % 250 + 1}:9") for i in wave]
        if n == len(waves) - 1:
            recs = [_record(f"w{rows}", "prefiller", p_last.url)]  # the 1,025th: a live engine
        path.write_text(json.dumps({"instances": [msgspec.to_builtins(r) for r in recs], "drain": []}))
        until(lambda recs=recs: px.discovered() == len(recs), 20, f"wave {n} in the proxy")
    last = f"w{rows}"
    until(lambda: all([i.get("instance_id") for i in h["instances"]] == [None, last] for h in _health_all(px)), 10,
          "every worker to list only the static decoder and the 1,025th")
    health = _health_all(px)
    assert all(h["background"]["discovery"]["ok"] for h in health), health
    assert len({_id_of(h, last) for h in health}) == 1  # the workers agree on its id
    for i in range(8):  # new connections: both workers answer some, each routes to the only prefiller
        with httpx.Client() as c:
            r = c.post(px.url + "/v1/completions", json={"model": "stub", "prompt": f"last {i}", "max_tokens": 2},
                       timeout=30)
            assert r.status_code == 200, r.text
    assert len(httpx.get(p_last.url + "/stub/log").json()["requests"]) == 8
    text = px.metrics()
    d_id = next(i["id"] for i in health[0]["instances"] if i["url"] == d0.url)
    assert set(re.findall(r'instance="([^"]+)"', text)) <= {"proxy", d_id, _id_of(health[0], last)}
    # What the start did not have names no instance (asserted above) or no url: the first answers'
    # counters and the two live instances' gauges. 1,024 instances gone that left a series each would
    # leave hundreds; which counters the answers touch (a retry, a routing reason) is the machine's.
    new = _series(text) - series
    assert not [s for s in new if "url=" in s and p_last.url not in s], new
    assert len(new) < 32, sorted(new)
    assert _value(text, "kvferry_proxy_board_full_total") == 0

    # A bad line in the workers' admin-change log: requests go on, and the next change still applies.
    log = next(tmp_path.glob("kvferry-proxy-*/admin-changes.jsonl"))
    with open(log, "ab") as f:
        f.write(b'{"pid": 1, "op": "drain", "url": \n{"op": "add", "url": "http://127.0.0.1:1"}\n')
    r = httpx.post(f"{px.url}/admin/instances/{d_id}/drain", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    for _ in range(6):
        with httpx.Client() as c:
            r = c.post(px.url + "/v1/completions", json={"model": "stub", "prompt": "x", "max_tokens": 2}, timeout=30)
            assert r.status_code == 503 and "no healthy decoder" in r.text, r.text  # drained on both workers


ADMIN_KEY = "admin-key-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _series(text: str) -> set[str]:
    """Each sample's name and labels, without its value."""
    return {ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln and not ln.startswith("#")}


def _value(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def _health_all(px: Proxy, n: int = 6) -> list[dict]:
    """/health from new connections (the kernel spreads them over the workers)."""
    out = []
    for _ in range(n):
        with httpx.Client() as c:
            out.append(c.get(px.url + "/health", timeout=10).json())
    return out


def _id_of(health: dict, discovery_id: str) -> str:
    return next(i["id"] for i in health["instances"] if i.get("instance_id") == discovery_id)


# ---- the load board, in-process: rows reused, a full board an error the registry absorbs ----

def test_security_board_rows_are_reused_and_agreed(tmp_path: Path) -> None:
    b = LoadBoard(2, str(tmp_path / "board.lock"))
    row, n = b.claim("http://a")
    b.put(row, 3, 100)
    b.worker = 1
    assert b.claim("http://a") == (row, n)  # the other worker: the same row and id
    b.put(row, 1, 0)
    assert b.total(row) == (4, 100)
    b.worker = 0
    b.release(row)
    assert b.total(row) == (1, 0)  # worker 1 still holds it: its load stays, the row is not free
    rows = {b.claim(f"http://f{i}")[0] for i in range(board_mod.ROWS - 1)}
    assert row not in rows
    with pytest.raises(BoardFull):
        b.claim("http://one-too-many")
    b.worker = 1
    b.release(row)
    row2, n2 = b.claim("http://new")  # the freed row, zeroed, under a new id
    assert row2 == row and n2 != n and b.total(row2) == (0, 0) and b.done(row2) == (0, 0)
    b.clear_worker(0)  # a dead worker holds nothing: its rows free up
    assert b.held_rows() == 1


def test_security_full_board_still_registers(tmp_path: Path) -> None:
    from kvferry.proxy.instance_flags import InstanceSpec, parse_url
    from kvferry.proxy.metrics import ProxyMetrics
    from kvferry.proxy.options import parse
    from kvferry.proxy.routing.router import Router
    from kvferry.proxy.upstream_client import UpstreamClient
    b = LoadBoard(2, str(tmp_path / "board.lock"))
    for i in range(board_mod.ROWS):
        b.claim(f"http://f{i}")
    opts = parse(["--discovery", "file:///none"])
    metrics = ProxyMetrics()
    router = Router(opts, metrics, UpstreamClient(opts), b)
    inst = router.register(InstanceSpec("prefiller", parse_url("url", "http://127.0.0.1:7")))
    assert inst.board is None and router.registry.instances[inst.id] is inst
    assert metrics.board_full.get() == 1
    router.remove(inst)
    assert inst.removed and inst.id not in router.registry.instances


def test_security_worker_metric_files_drop_gone_instances(tmp_path: Path) -> None:
    """A worker's multiprocess files (what /metrics sums) lose a gone instance's series and stay
    small under churn; a request that ends after its instance went writes nothing back."""
    def worker() -> list[dict]:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client import multiprocess as mp_metrics

        from kvferry.proxy import metrics
        metrics.multiprocess(str(tmp_path))  # as a worker of --workers N does
        m = metrics.ProxyMetrics()
        m.healthy.labels("p-live", "prefiller", "http://live").set(1)
        for i in range(5000):
            iid, url = f"d{i}", f"http://127.5.{i // 250}.{i % 250 + 1}:9"
            m.healthy.labels(iid, "decoder", url).set(1)
            m.errors.labels("timeout", iid).inc()
            g = m.in_flight.labels(iid, "decoder")
            g.inc()
            m.forget_instance(iid)
            g.dec()  # its request ends after the instance went
        reg = CollectorRegistry()
        mp_metrics.MultiProcessCollector(reg, str(tmp_path))
        labels = sorted(set(re.findall(r'instance="([^"]+)"', generate_latest(reg).decode())))
        return [{"bytes": sum(f.stat().st_size for f in tmp_path.iterdir()), "instances": labels}]
    out = _forked(worker)[0]
    # Dropped series wait for the file's next rewrite (the page shows only live instances meanwhile).
    assert "p-live" in out["instances"] and len(out["instances"]) <= metrics_mod.COMPACT_AFTER + 1
    assert out["bytes"] <= 1 << 20, out["bytes"]  # 15,000 series written: ~3 MB were they all kept


# ---- the admin-change log the workers share ----

def _forked(fn) -> list[dict]:
    """Run `fn()` in a forked child (another worker: another pid); what it returns, through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            os.write(w, json.dumps(fn()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(out)


def test_security_admin_log_bounded_and_replays_current_state_only(tmp_path: Path, kvf_logs) -> None:
    path = str(tmp_path / "admin-changes.jsonl")
    open(path, "wb").close()
    p, d = "http://127.0.0.1:11", "http://127.0.0.1:12"
    peers = Peers(path, 3, [p, d])
    applied: list[dict] = []

    def apply(change: dict) -> None:
        if change["op"] == "add":
            change["role"]  # noqa: B018 - a change without a role fails, as the admin API's apply does
        applied.append(change)
    peers.sync(apply)  # this process: a worker running throughout

    def churn() -> list[dict]:
        peers.worker = 1
        biggest = 0
        for i in range(3000):  # adds and removes of distinct instances, each ejected once
            url = f"http://127.4.{i // 250}.{i % 250 + 1}:9"
            peers.publish({"op": "add", "role": "prefiller", "url": url, "init_port": None, "alloc_port": None})
            peers.publish({"op": "eject", "url": url})
            peers.publish({"op": "remove", "url": url})
            biggest = max(biggest, os.path.getsize(path))
        peers.publish({"op": "add", "role": "decoder", "url": "http://127.0.0.1:13", "init_port": 5, "alloc_port": 6})
        peers.publish({"op": "drain", "url": "http://127.0.0.1:13"})
        peers.publish({"op": "drain", "url": p})
        peers.publish({"op": "remove", "url": d})
        peers.publish({"op": "drain", "url": "http://127.9.9.9:9"})  # a discovered instance: not state
        return [{"biggest": biggest}]
    biggest = _forked(churn)[0]["biggest"]
    assert biggest <= peers_mod.COMPACT_BYTES + 200  # compacted as it grew
    peers.sync(apply)  # the file was rewritten meanwhile: the difference is applied
    want = [{"op": "add", "role": "decoder", "url": "http://127.0.0.1:13", "init_port": 5, "alloc_port": 6},
            {"op": "drain", "url": "http://127.0.0.1:13"}, {"op": "drain", "url": p}, {"op": "remove", "url": d}]
    assert sorted(applied, key=json.dumps) == sorted(want, key=json.dumps)

    # p is ejected on worker 1 while this worker runs (applied here), then recovers; a replacement
    # worker started later replays current state, not the ejection.
    _forked(lambda: [peers.publish({"op": "eject", "url": p}) or {}])
    applied.clear()
    peers.sync(apply)
    assert applied == [{"op": "eject", "url": p}]

    def replacement() -> list[dict]:
        peers.worker = 2
        seen: list[dict] = []
        peers.sync(seen.append)
        return seen
    assert sorted(_forked(replacement), key=json.dumps) == sorted(want, key=json.dumps)

    # A bad line (and a change that cannot be applied) is logged and skipped; a file error is
    # logged and the read tried again at the next call; neither raises.
    with open(path, "ab") as f:
        f.write(b'{"pid": 1, "op": "drain", "url": \n{"pid": 1, "op": "add", "url": "http://127.0.0.1:14"}\n')
    _forked(lambda: [peers.publish({"op": "undrain", "url": p}) or {}])
    os.rename(path, path + ".away")
    applied.clear()
    peers.sync(apply)
    assert applied == []
    os.rename(path + ".away", path)
    peers.sync(apply)
    assert applied == [{"op": "undrain", "url": p}]
    text = kvf_logs.text
    assert "skipped a bad line" in text and "cannot apply" in text and "cannot read" in text


def test_security_static_instance_removed_takes_its_kv_event_loop(tmp_path: Path) -> None:
    """A --prefiller with --kv-events removed through the admin API: its event loop stops and its
    /health entry goes (nothing publishes on the endpoint: the loop runs, stale)."""
    p, d = stub(), stub()
    key = {"Authorization": "Bearer admin-key-for-tests"}
    px = Proxy(tmp_path, "--prefiller", p.url, "--decoder", f"{d.url},{free_port()},{free_port()}",
               "--kv-events", f"{p.url}=ipc://{tmp_path}/p-events.sock", "--admin-key", "admin-key-for-tests",
               "--workers", "1")
    try:
        iid = next(i["id"] for i in httpx.get(px.url + "/admin/instances", headers=key).json()["instances"]
                   if i["url"] == p.url)
        assert f"kv_events_{iid}" in httpx.get(px.url + "/health", headers=key).json()["background"]
        assert httpx.delete(f"{px.url}/admin/instances/{iid}", headers=key).status_code == 200
        assert f"kv_events_{iid}" not in httpx.get(px.url + "/health", headers=key).json()["background"]
    finally:
        px.stop()
