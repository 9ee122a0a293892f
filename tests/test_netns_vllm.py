"""A disaggregated cluster across Linux network namespaces (issue 30): two proxies, one prefiller and
two decoders, each in a namespace of its own with its own address on a bridge, NIXL on TCP over the
veths, the cluster secret on. Real vLLM CPU servers."""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.launcher.pd_instances import Decoder, Prefiller
from tests.netns import NetnsCluster, ours, pid_running, unavailable_reason
from tests.netns_pd import (
    NsProxy,
    decoder_flag,
    metric,
    ns_env,
    pages_all_free,
    place,
    prefiller_url,
)
from tests.pd_helpers import plain, source_tokens
from tests.polling import until

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

DECODER_KEYS = {"pd_kv_ready_timeout": 6.0, "pd_lease_seconds": 15.0, "pd_alloc_timeout": 3.0}
PROXY_A, PROXY_B, PREFILLER, DEC1, DEC2, DEC3 = range(6)
EJECT_WITHIN_S = 5.0  # the discovery lease TTL the issue asks for ("a few seconds")


def prompt(n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def _server(cls: type, model: str, log_dir: Path, tmp: Path, cores: str, net: NetnsCluster, i: int, secret: str,
            **keys: object):
    if cls is Decoder:
        keys = {**DECODER_KEYS, "host": net.addr(i), **keys}
    s = cls(model, log_dir, cores, tmp, server={"env": ns_env(secret), "die_with_parent": True}, **keys)
    return place(s, net, i)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tiny_model_path: Path, log_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("netns")
    secret = secrets.token_urlsafe(32)
    net = NetnsCluster(6).up()
    servers = []
    try:
        p = _server(Prefiller, str(tiny_model_path), log_dir, tmp, "0", net, PREFILLER, secret)
        d1 = _server(Decoder, str(tiny_model_path), log_dir, tmp, "1", net, DEC1, secret)
        d2 = _server(Decoder, str(tiny_model_path), log_dir, tmp, "0", net, DEC2, secret)
        servers = [p, d1, d2]
        for s in servers:
            s.start()
        plain_vllm = request.getfixturevalue("plain_vllm")  # loads while ours do
        for s in servers:
            s.wait_ready(timeout=400)
        decoders = [decoder_flag(net, d) for d in (d1, d2)]
        proxies = [NsProxy(net, i, log_dir / f"netns-proxy-{i}.log", [prefiller_url(net, p)], decoders, secret)
                   for i in (PROXY_A, PROXY_B)]
        for px in proxies:
            px.wait_ready()
        yield {"net": net, "p": p, "d1": d1, "d2": d2, "proxies": proxies, "plain": plain_vllm, "secret": secret,
               "servers": servers, "model": str(tiny_model_path), "log_dir": log_dir, "tmp": tmp}
    finally:
        for s in servers:
            s.stop(timeout=5)
        net.close()


def test_netns_two_proxies_1p2d_across_namespaces_same_tokens_failover_join_and_cleanup(cluster) -> None:
    net, d1, d2 = cluster["net"], cluster["d1"], cluster["d2"]
    pa, pb = cluster["proxies"]
    plain_vllm = cluster["plain"]

    # 1. Through both proxies: the plain instance's greedy tokens; the decoders compute no prompt.
    prompts = [prompt(40 + 9 * k, seed=30_000 + k) for k in range(4)]
    wants = [plain(plain_vllm, pr, 6)[0] for pr in prompts]
    before = {d.url: source_tokens(d) for d in (d1, d2)}
    link_before = net.veth_bytes(DEC1)[0] + net.veth_bytes(DEC2)[0]
    for k, pr in enumerate(prompts):
        px = (pa, pb)[k % 2]
        got = px.complete(pr, 6)["choices"][0]["token_ids"]
        assert got == wants[k], f"prompt {k} through {px.url}: tokens differ"
    after = {d.url: source_tokens(d) for d in (d1, d2)}
    loaded = sum(after[u].get("external_kv_transfer", 0) - before[u].get("external_kv_transfer", 0) for u in after)
    computed = sum(after[u].get("local_compute", 0) - before[u].get("local_compute", 0) for u in after)
    # each decoder request is prompt + the prefiller's first token: that one token is computed
    assert loaded == sum(map(len, prompts)) and computed == len(prompts), (before, after)
    served = {u: sum(px.instances()[u]["served"] for px in (pa, pb)) for u in (d1.url, d2.url)}
    assert all(v > 0 for v in served.values()), served  # both decoders, through both proxies
    # the KV crossed the decoders' links (UCX_TLS=tcp): at least the prompts' KV bytes
    assert net.veth_bytes(DEC1)[0] + net.veth_bytes(DEC2)[0] - link_before > 0

    # 2. Decoder 1 SIGKILLed: both proxies stop routing to it, and no request after that fails.
    d1_url = d1.url
    killed_at = time.monotonic()
    os.killpg(d1.proc.pid, signal.SIGKILL)  # the API server and its engine core
    for px in (pa, pb):
        until(lambda px=px: not px.instances()[d1_url]["healthy"], timeout=EJECT_WITHIN_S,
              what=f"{px.url} to drop the killed decoder")
    ejected_s = time.monotonic() - killed_at
    assert ejected_s < EJECT_WITHIN_S
    d2_served = {px.url: px.instances()[d2.url]["served"] for px in (pa, pb)}
    for k in range(4):
        pr = prompt(30 + k, seed=31_000 + k)
        px = (pa, pb)[k % 2]
        assert px.complete(pr, 4)["choices"][0]["token_ids"] == plain(plain_vllm, pr, 4)[0]
    for px in (pa, pb):
        assert px.instances()[d2.url]["served"] - d2_served[px.url] == 2
    d1.stop(timeout=1)

    # 3. A new decoder joins: it gets requests within 2 s of being registered.
    d3 = _server(Decoder, cluster["model"], cluster["log_dir"], cluster["tmp"], "1", net, DEC3, cluster["secret"])
    cluster["servers"].append(d3)
    d3.start().wait_ready(timeout=400)
    for px in (pa, pb):
        registered = time.monotonic()
        px.add_decoder(decoder_flag(net, d3))
        k = 0
        while px.instances()[d3.url]["served"] == 0:
            assert time.monotonic() - registered < 2.0, f"{px.url} sent the new decoder nothing within 2 s"
            pr = prompt(20 + k, seed=32_000 + k)
            k += 1
            px.complete(pr, 2)

    # 4. Proxy A SIGKILLed: proxy B keeps serving.
    pa.kill()
    with pytest.raises(httpx.HTTPError):
        httpx.get(pa.url + "/health", timeout=1)
    pr = prompt(33, seed=33_000)
    assert pb.complete(pr, 5)["choices"][0]["token_ids"] == plain(plain_vllm, pr, 5)[0]

    # 5. Every pd_buffer page free on the live decoders; no decoder computed a prompt it was sent.
    for d in (d2, d3):
        assert pages_all_free(d), f"{d.url}: pd_buffer pages still held"
        assert metric(d, "kvferry:pd_recomputed_requests_total") == 0


def test_netns_cluster_left_nothing_behind(cluster) -> None:
    """Runs after the cluster test in this module: tears the cluster down and checks the host."""
    net: NetnsCluster = cluster["net"]
    pids = [pid for i in range(net.n) for pid in net.pids(i)]
    for s in cluster["servers"]:
        s.stop(timeout=5)
    for px in cluster["proxies"]:
        px.stop()
    net.close()
    assert ours(net.pid) == ([], [])
    until(lambda: not any(map(pid_running, pids)), timeout=10, what="every namespace process to exit")
