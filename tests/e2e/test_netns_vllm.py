"""A disaggregated cluster across Linux network namespaces, discovered through etcd: etcd,
two proxies, one prefiller and two decoders, each in a namespace of its own with its own address
on a bridge (tests/netns.py), every instance started by `kvferry join` and registered with a
lease, NIXL on TCP over the veths (`UCX_TLS=tcp`), the cluster secret on. Real vLLM CPU servers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.common.discovery import sources as disc
from kvferry.common.discovery.etcd import Etcd
from kvferry.common.wire import messages as m
from tests.netns import NetnsCluster, ours, pid_running, unavailable_reason
from tests.netns_pd import (
    NsJoin,
    NsProxy,
    kv_bytes_per_token,
    metric,
    pages_all_free,
    start_etcd_in,
)
from tests.pd_helpers import plain, source_tokens
from tests.polling import until, until_async

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

ETCD, PROXY_A, PROXY_B, PREFILLER, DEC1, DEC2, DEC3 = range(7)
PREFIX = "/kvferry-netns"
TTL_S = 3  # the registrations' etcd lease


def prompt(n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def routable(px: NsProxy, url: str) -> bool:
    """`px` lists the instance at `url` as healthy (what it routes to)."""
    inst = px.instances().get(url)
    return bool(inst and inst["healthy"] and not inst["draining"])


def rejected(px: NsProxy) -> dict[str, float]:
    text = httpx.get(px.url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvferry_proxy_discovery_rejected_total{"):
            out[line.split('reason="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, log_dir: Path, etcd_available: None,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("netns")
    secret = secrets.token_urlsafe(32)
    net = NetnsCluster(7).up()
    c: dict = {"net": net, "secret": secret, "log_dir": log_dir, "joins": [], "proxies": []}
    try:
        _, etcd = start_etcd_in(net, ETCD, tmp / "etcd")
        c["etcd"], c["target"] = etcd, f"etcd://{etcd}{PREFIX}"
        c["p"] = NsJoin(net, PREFILLER, c["target"], "prefiller", log_dir, secret, "0", TTL_S, "p1")
        c["d1"] = NsJoin(net, DEC1, c["target"], "decoder", log_dir, secret, "1", TTL_S, "d1")
        c["d2"] = NsJoin(net, DEC2, c["target"], "decoder", log_dir, secret, "0", TTL_S, "d2")
        c["joins"] += [c["p"], c["d1"], c["d2"]]
        c["plain"] = request.getfixturevalue("plain_vllm")  # loads while ours do
        for j in c["joins"]:
            j.wait_ready()
        c["proxies"] = [NsProxy(net, i, log_dir / f"netns-proxy-{i}.log", [], [], secret,
                                ["--discovery", c["target"]]) for i in (PROXY_A, PROXY_B)]
        for px in c["proxies"]:
            px.wait_ready()
            until(lambda px=px: all(routable(px, j.url) for j in c["joins"]), timeout=10,
                  what=f"{px.url} to route to every registered instance")
        yield c
    finally:
        for px in c["proxies"]:
            px.stop()
        for j in c["joins"]:
            j.stop(timeout=5)
        net.close()


def test_netns_discovery_etcd_two_proxies_1p2d_same_tokens_lease_expiry_join_and_forged_entry(
        cluster, tiny_model_path: Path) -> None:
    net = cluster["net"]
    d1, d2 = cluster["d1"], cluster["d2"]
    pa, pb = cluster["proxies"]
    plain_vllm = cluster["plain"]

    # 1. Through both proxies: the plain instance's greedy tokens; the decoders compute no prompt
    #    (each decoder request is the prompt + the prefiller's first token: that one token is computed).
    prompts = [prompt(40 + 9 * k, seed=30_000 + k) for k in range(4)]
    wants = [plain(plain_vllm, pr, 6)[0] for pr in prompts]
    before = {d.url: source_tokens(d) for d in (d1, d2)}
    link_before = net.veth_bytes(DEC1)[0] + net.veth_bytes(DEC2)[0]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent: both decoders get some
        futs = [pool.submit((pa, pb)[k % 2].complete, pr, 6) for k, pr in enumerate(prompts)]
        got = [f.result(timeout=300)["choices"][0]["token_ids"] for f in futs]
    assert got == wants
    after = {d.url: source_tokens(d) for d in (d1, d2)}
    delta = {src: sum(after[u].get(src, 0) - before[u].get(src, 0) for u in after)
             for src in ("external_kv_transfer", "local_compute")}
    assert delta == {"external_kv_transfer": sum(map(len, prompts)), "local_compute": len(prompts)}, (before, after)
    # the KV crossed the decoders' links: at least the prompts' KV bytes (every layer's K and V, bf16)
    kv_bytes = sum(map(len, prompts)) * kv_bytes_per_token(tiny_model_path)
    assert net.veth_bytes(DEC1)[0] + net.veth_bytes(DEC2)[0] - link_before >= kv_bytes

    # 2. An entry written without the secret is ignored by both proxies and counted.
    async def forge() -> None:
        etcd = Etcd(f"http://{cluster['etcd']}")
        try:
            lease = await etcd.grant(60)
            k = disc.record_key(PREFIX, "evil")
            rec = m.InstanceRecord(instance_id="evil", role="decoder", model="tiny", url=f"http://{net.bridge_addr}:9",
                                   init_ports=[9], alloc_ports=[9], fingerprint=disc.fingerprint("tiny"), lease=lease)
            await etcd.put(k, disc.sign(None, k, rec), lease=lease)
        finally:
            await etcd.close()
    asyncio.run(forge())
    for px in (pa, pb):
        until(lambda px=px: rejected(px).get("unsigned") == 1, timeout=5, what=f"{px.url} to count the forged entry")
        assert f"http://{net.bridge_addr}:9" not in px.instances()

    # 3. Decoder 1's machine dies (every process in its namespace SIGKILLed: vLLM and its sidecar):
    #    both proxies stop routing to it and forget it when its lease ends, and no request after that
    #    fails. How soon is timed in benchmarks/ (scale_bench discovery); the bound here only keeps a
    #    broken watch from hanging the test on a loaded machine.
    net.kill_all(DEC1)
    for px in (pa, pb):
        until(lambda px=px: not routable(px, d1.url), timeout=TTL_S + 15, what=f"{px.url} to drop decoder 1")
    until(lambda: all(d1.url not in px.instances() for px in (pa, pb)), timeout=TTL_S + 15,
          what="the lease to end and both proxies to forget decoder 1")
    for k in range(4):
        pr = prompt(30 + k, seed=31_000 + k)
        assert (pa, pb)[k % 2].complete(pr, 4)["choices"][0]["token_ids"] == plain(plain_vllm, pr, 4)[0]

    # 4. A new decoder joins: both proxies route to it within 2 s of its registration (their part:
    #    the etcd watch and the first health check), and then each sends it requests. How fast a
    #    request reaches it depends on this machine's vLLM latency, so that wait is bounded, not timed
    #    (join-to-routed is timed in benchmarks/discovery_bench.py and scale_bench.py).
    d3 = NsJoin(net, DEC3, cluster["target"], "decoder", cluster["log_dir"], cluster["secret"], "1", TTL_S, "d3")
    cluster["joins"].append(d3)

    async def registered() -> float:
        etcd = Etcd(f"http://{cluster['etcd']}")
        try:
            await until_async(lambda: etcd.get(disc.record_key(PREFIX, "d3")), 400, "decoder 3 to register",
                              every=0.02)
            return time.monotonic()
        finally:
            await etcd.close()
    at = asyncio.run(registered())
    until(lambda: all(routable(px, d3.url) for px in (pa, pb)), 2.0 - (time.monotonic() - at),
          lambda: f"both proxies to route to the new decoder within 2 s of its registration: "
                  f"{[px.instances().get(d3.url) for px in (pa, pb)]}", every=0.02)
    k = 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:

        def routed() -> bool:
            nonlocal k
            futs = [pool.submit(px.complete, prompt(12, seed=32_000 + k + n), 2) for n, px in enumerate((pa, pb) * 2)]
            k += 4
            for f in futs:
                f.result(timeout=60)
            return all(px.instances().get(d3.url, {}).get("served", 0) > 0 for px in (pa, pb))
        until(routed, 60, lambda: f"each proxy to send the new decoder a request: "
              f"{[px.instances() for px in (pa, pb)]}", every=0)
    d3.wait_ready(timeout=5)

    # 5. Proxy A SIGKILLed: proxy B keeps serving.
    pa.kill()
    with pytest.raises(httpx.HTTPError):
        httpx.get(pa.url + "/health", timeout=1)
    pr = prompt(33, seed=33_000)
    assert pb.complete(pr, 5)["choices"][0]["token_ids"] == plain(plain_vllm, pr, 5)[0]

    # 6. Every pd_buffer page free on the live decoders; none recomputed a prompt it was sent.
    for d in (d2, d3):
        assert pages_all_free(d), f"{d.url}: pd_buffer pages still held"
        assert metric(d, "kvferry:pd_recomputed_requests_total") == 0


def test_netns_discovery_cluster_left_nothing_behind(cluster) -> None:
    """After the cluster test in this module: tears the cluster down and checks the host."""
    net: NetnsCluster = cluster["net"]
    pids = [pid for i in range(net.n) for pid in net.pids(i)]
    assert pids
    for px in cluster["proxies"]:
        px.stop()
    for j in cluster["joins"]:
        j.stop(timeout=10)  # a join withdraws its entry and stops its vLLM
    net.close()
    assert ours(net.pid) == ([], [])
    until(lambda: not any(map(pid_running, pids)), timeout=10, what="every namespace process to exit")
