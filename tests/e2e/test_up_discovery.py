"""`kvferry up --discovery etcd` on real vLLM CPU servers, one cluster for the module: a real
Prometheus scraping it under load gets data for every query of the Grafana dashboard; then the
cluster runs through a local etcd, a second proxy started by hand serves the same instances, a
decoder joins with `kvferry join`, a dead decoder leaves both proxies (requests go on), and a
withdrawn one too (the module's last test: it stops the cluster)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest

from kvferry.common.discovery.entries import record_key
from kvferry.common.discovery.etcd import Etcd
from kvferry.common.discovery.target import parse_target
from kvferry.common.netutil import free_port
from kvferry.testing.prometheus import PrometheusServer, dashboard_queries
from tests.polling import alive, until
from tests.up_cluster import stop

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvferry.json"
KV_READY_TIMEOUT = 5.0  # a transfer that never comes is recomputed this soon (the recompute panel's data)


@pytest.fixture(scope="module")
def cluster(kvferry_up, etcd_available, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """1P1D `kvferry up --discovery etcd` (its own etcd), leases of 2 s: the launcher's process, its
    cluster.json and its folder. The module's last test stops it."""
    cfg = tmp_path_factory.mktemp("discovery-config") / "kvferry.yaml"
    cfg.write_text(f"pd_kv_ready_timeout: {KV_READY_TIMEOUT}\n")
    return kvferry_up("discovery", "--num-prefillers", "1", "--num-decoders", "1", "--discovery", "etcd",
                      "--lease-ttl", "2", "--config", str(cfg))


def _listed(proxy: str) -> set[str]:
    return {i["instance_id"] for i in httpx.get(f"{proxy}/health", timeout=5).json()["instances"]
            if "instance_id" in i}


def _second_proxy(state: dict, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """Another proxy on the cluster's discovery (and secret): its process and URL, once it found both roles."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvferry.proxy", "--port", str(port), "--discovery",
                                 state["discovery"], "--cluster-secret-file", state["cluster_secret_file"], *flags],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(f"{url}/health", timeout=1).json()["status"] == "ok"  # both roles found
        except httpx.HTTPError:
            return False
    until(ready, 20, "the second proxy to find the instances")
    return proc, url


def _hostport(url: str) -> str:
    return urlsplit(url).netloc


def _load(proxy: str, n: int) -> None:
    """`n` short requests, 4 at a time: streamed and not, completions and chat, prompts that share a
    prefix (the prefix cache, and cache-aware routing, hit) and some that do not."""
    def one(i: int) -> None:
        prompt = ("The old kingdom by the sea had many stories. " * 8 if i % 3 else f"Request {i}: ") + f"Tell {i}."
        body: dict = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": i % 2 == 0}
        if i % 4 == 3:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        r = httpx.post(f"{proxy}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(n)))


def _overloaded(proxy: str) -> bool:
    """A request refused 503 (overloaded) by a --max-in-flight 1 proxy: sent while a long stream holds it."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{proxy}/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(lines)  # the stream is under way: the proxy's one request in flight
        second = httpx.post(f"{proxy}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                            timeout=60)
        for _ in lines:
            pass
    return second.status_code == 503 and "overloaded" in second.text


def _recompute(decoder: str) -> None:
    """A decode request for a transfer no prefiller sends: the decoder recomputes it after KV_READY_TIMEOUT."""
    r = httpx.post(f"{decoder}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "A prompt whose KV never comes", "max_tokens": 2,
        "kv_transfer_params": {"transfer_id": f"never-{uuid.uuid4().hex}"}})
    assert r.status_code == 200, r.text


async def _put_junk(target: str, delete: bool = False) -> None:
    """A key no kvferry join wrote, under the cluster's discovery prefix: each proxy rejects it (malformed)."""
    t = parse_target(target)
    etcd = Etcd(t.endpoint)
    try:
        key = record_key(t.prefix, "not-an-instance")
        await (etcd.delete(key) if delete else etcd.put(key, b"not msgpack"))
    finally:
        await etcd.close()


@pytest.mark.vllm
def test_dashboard_queries_all_return_data_from_a_kvferry_up_cluster(cluster: SimpleNamespace,
                                                                      prometheus_available) -> None:
    """Prometheus scrapes the cluster's proxy, a second proxy (--max-in-flight 1) and both vLLMs
    every second; under a few dozen requests, with one request refused (overloaded), one recomputed
    and one discovery entry rejected, every query of every dashboard panel returns a number, and
    every alerting rule evaluates on the real series without an error."""
    state = cluster.state
    decoder = next(i["url"] for i in state["instances"] if i["role"] == "decoder")
    second = prom = None
    try:
        second, b = _second_proxy(state, cluster.tmp / "proxy-dashboard.log", "--max-in-flight", "1")
        prom = PrometheusServer({"kvferry-proxy": [_hostport(state["proxy"]["url"]), _hostport(b)],
                                 "kvferry-engines": [_hostport(i["url"]) for i in state["instances"]]},
                                rule_files=[DEPLOY / "prometheus" / "kvferry-alerts.yml"])
        until(lambda: {t["health"] for t in prom.targets()} == {"up"} and len(prom.targets()) == 4, 30,
              lambda: f"Prometheus to scrape every target: {prom.targets()}")
        # The engines' histograms appear with their first transfer: Prometheus must hold them before
        # the load, or their rates would have no earlier sample to move from. A prefiller reports a
        # send with its next engine step, so each look comes after one more request.
        until(lambda: _load(state["proxy"]["url"], 1) or (prom.query("kvferry:pd_transfer_seconds_count")
                                                          and prom.query("kvferry:pd_load_seconds_count")),
              60, "the engines' histograms in Prometheus", every=0.5)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            recomputed = pool.submit(_recompute, decoder)
            asyncio.run(_put_junk(state["discovery"]))
            _load(state["proxy"]["url"], 30)
            until(lambda: _overloaded(b), 60, "a request refused by the --max-in-flight 1 proxy")
            recomputed.result(timeout=120)
        queries = dashboard_queries(DASHBOARD)

        def empty() -> list[str]:  # queries with no number (nothing, or only NaN: no rate to take)
            return [name for name, q in queries.items()
                    if not any(not math.isnan(float(s["value"][1])) for s in prom.query(q))]
        until(lambda: not empty(), 60, lambda: f"every dashboard query to return data; without: {empty()}", every=1)
        rules = until(lambda: (r := prom.rules()) and all(x["health"] != "unknown" for x in r) and r, 30,
                      "every alerting rule evaluated")
        assert all(r["health"] == "ok" for r in rules) and len(rules) >= 10, rules
    finally:
        if prom is not None:
            prom.stop()
        if second is not None:
            second.send_signal(signal.SIGTERM)
            second.wait(15)
        asyncio.run(_put_junk(state["discovery"], delete=True))


@pytest.mark.vllm
def test_up_discovery_etcd_second_proxy_join_and_a_dead_decoder(cluster: SimpleNamespace, tmp_path: Path) -> None:
    proc, state = cluster.proc, cluster.state
    second = joined = None
    try:
        target = state["discovery"]
        assert target.startswith("etcd://127.0.0.1:"), state
        out = (cluster.tmp / "up.out").read_text()
        assert f"kvferry join --discovery {target}" in out and f"kvferry-proxy --discovery {target}" in out
        a = state["proxy"]["url"]
        body = {"model": "tiny", "prompt": "Tell me a story about the king", "max_tokens": 8, "temperature": 0}
        first = httpx.post(f"{a}/v1/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        second, b = _second_proxy(state, tmp_path / "proxy-b.log")
        again = httpx.post(f"{b}/v1/completions", json=body, timeout=120)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        # A decoder joins with `kvferry join`; the first one is then SIGKILLed: requests go on, through
        # both proxies, with the same greedy answer.
        joined = subprocess.Popen([sys.executable, "-m", "kvferry.launcher", "join", "--discovery", target,
                                   "--role", "decoder", "--cluster-secret-file", state["cluster_secret_file"],
                                   "--lease-ttl", "2", "--log-dir", str(tmp_path / "join")],
                                  stdout=open(tmp_path / "join.out", "wb"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        until(lambda: len(_listed(a)) == len(_listed(b)) == 3 or joined.poll() is not None, 300,
              "both proxies to list the joined decoder")
        assert joined.poll() is None, (tmp_path / "join.out").read_text()
        decoder = next(i for i in state["instances"] if i["role"] == "decoder")
        os.killpg(decoder["pid"], signal.SIGKILL)  # vLLM dies; its registrar (kvferry up) withdraws it
        until(lambda: len(_listed(a)) == len(_listed(b)) == 2, 60, "both proxies to drop the dead decoder")
        # Dropped because the registrar withdrew it after its failed /health checks (its lease is renewed
        # on, so nothing else would take it out of etcd): kvferry up's own line says so.
        withdrawn = f"withdrawn: {decoder['url']}/health does not answer /health"
        until(lambda: withdrawn in (cluster.tmp / "up.out").read_text(), 60, f"kvferry up to say {withdrawn!r}")
        for px in (a, b):
            r = httpx.post(f"{px}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        joined.send_signal(signal.SIGTERM)  # withdraws, then stops its vLLM
        until(lambda: len(_listed(a)) == len(_listed(b)) == 1, 5, "both proxies to drop the withdrawn decoder")
        assert joined.wait(30) == 0
    finally:
        if joined is not None and joined.poll() is None:
            os.killpg(joined.pid, signal.SIGKILL)
            joined.wait(10)
        if second is not None and second.poll() is None:
            second.send_signal(signal.SIGTERM)
            second.wait(15)
        assert stop(proc) < 25
    assert not alive(state["launcher_pid"])
