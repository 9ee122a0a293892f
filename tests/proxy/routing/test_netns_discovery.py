"""Discovery through etcd across Linux network namespaces, fast (stub engines, no vLLM): etcd, two
proxies, a prefiller and two decoders each in a namespace of its own, registered by `kvferry join
--attach` with a lease. The same story as tests/e2e/test_netns_vllm.py, which runs it on real vLLM
servers with the KV crossing the links; this one runs in every `make test` in seconds."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import httpx
import pytest

from kvferry.common.discovery import sources as disc
from kvferry.common.discovery.etcd import Etcd
from kvferry.common.wire import messages as m
from tests.netns import NetnsCluster, ours, pid_running, unavailable_reason
from tests.netns_pd import NsJoin, NsProxy, start_etcd_in, start_stub_in
from tests.polling import until, until_async

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

ETCD, PROXY_A, PROXY_B, PREFILLER, DEC1, DEC2, DEC3 = range(7)
PREFIX = "/kvferry-netns-stub"
TTL_S = 2


def routable(px: NsProxy, url: str) -> bool:
    inst = px.instances().get(url)
    return bool(inst and inst["healthy"] and not inst["draining"])


def served(px: NsProxy, url: str) -> int:
    return px.instances().get(url, {}).get("served", 0)


def rejected(px: NsProxy) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(px.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvferry_proxy_discovery_rejected_total{"):
            out[line.split('reason="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _complete(px: NsProxy) -> None:
    r = httpx.post(px.url + "/v1/completions", json={"model": "stub", "prompt": "hello there", "max_tokens": 3},
                   timeout=10)
    assert r.status_code == 200, f"{px.url}: {r.status_code} {r.text}"


def test_netns_discovery_etcd_stub_two_proxies_expiry_join_forged_entry_and_cleanup(
        etcd_available: None, tmp_path: Path) -> None:
    secret = secrets.token_urlsafe(32)
    with NetnsCluster(7) as net:
        _, etcd = start_etcd_in(net, ETCD, tmp_path / "etcd")
        target = f"etcd://{etcd}{PREFIX}"
        joins = {}
        for i, role, iid in ((PREFILLER, "prefiller", "p1"), (DEC1, "decoder", "d1"), (DEC2, "decoder", "d2")):
            port = start_stub_in(net, i, tmp_path / f"stub-{iid}.log")
            joins[iid] = NsJoin(net, i, target, role, tmp_path, secret, "0", TTL_S, iid, attach_port=port)
        proxies = [NsProxy(net, i, tmp_path / f"proxy-{i}.log", [], [], secret,
                           ["--discovery", target, "--policy", "round_robin"]) for i in (PROXY_A, PROXY_B)]
        pa, pb = proxies
        for px in proxies:
            px.wait_ready(timeout=30)
            until(lambda px=px: all(routable(px, j.url) for j in joins.values()), timeout=10,
                  what=f"{px.url} to route to every registered instance")
        for _ in range(2):
            for px in proxies:
                _complete(px)
        assert all(served(px, joins[d].url) > 0 for px in proxies for d in ("d1", "d2"))

        # A decoder registered without the secret: ignored by both proxies, counted.
        async def forge() -> None:
            client = Etcd(f"http://{etcd}")
            try:
                lease = await client.grant(60)
                k = disc.record_key(PREFIX, "evil")
                rec = m.InstanceRecord(instance_id="evil", role="decoder", model="stub",
                                       url=f"http://{net.bridge_addr}:9", init_ports=[9], alloc_ports=[9],
                                       fingerprint=disc.fingerprint("stub"), lease=lease)
                await client.put(k, disc.sign(None, k, rec), lease=lease)
            finally:
                await client.close()
        asyncio.run(forge())
        for px in proxies:
            until(lambda px=px: rejected(px).get("unsigned") == 1, timeout=5, what=f"{px.url} to count it")
            assert f"http://{net.bridge_addr}:9" not in px.instances()

        # Decoder 1's machine dies (stub and sidecar SIGKILLed): both proxies take it out of rotation
        # and forget it once its lease ends. How soon is timed in benchmarks/ (scale_bench discovery);
        # here the bound only keeps a broken watch from hanging the test on a loaded machine.
        net.kill_all(DEC1)
        for px in proxies:
            until(lambda px=px: not routable(px, joins["d1"].url), timeout=TTL_S + 15, what=f"{px.url} to drop d1")
        until(lambda: all(joins["d1"].url not in px.instances() for px in proxies), timeout=TTL_S + 15,
              what="the lease to end")
        for _ in range(3):
            for px in proxies:
                _complete(px)  # none fails

        # A new decoder: both proxies route to it within 2 s of its registration.
        port = start_stub_in(net, DEC3, tmp_path / "stub-d3.log")
        joins["d3"] = NsJoin(net, DEC3, target, "decoder", tmp_path, secret, "0", TTL_S, "d3", attach_port=port)

        async def registered() -> float:
            client = Etcd(f"http://{etcd}")
            try:
                await until_async(lambda: client.get(disc.record_key(PREFIX, "d3")), 60, "d3 to register", every=0.01)
                return time.monotonic()
            finally:
                await client.close()
        at = asyncio.run(registered())

        # The proxies' part (etcd watch, first health check) within 2 s; the requests that follow run
        # at whatever speed this machine has, so they get a bound of their own.
        until(lambda: all(routable(px, joins["d3"].url) for px in proxies), 2.0 - (time.monotonic() - at),
              "every proxy to route to the new decoder within 2 s of its registration", every=0.01)

        def routed() -> bool:
            if all(served(px, joins["d3"].url) for px in proxies):
                return True
            for px in proxies:
                _complete(px)
            return all(served(px, joins["d3"].url) for px in proxies)
        until(routed, 30, "every proxy to send the new decoder something", every=0)

        # Proxy A SIGKILLed: B keeps serving.
        pa.kill()
        with pytest.raises(httpx.HTTPError):
            httpx.get(pa.url + "/health", timeout=1)
        for _ in range(3):
            _complete(pb)
        pids = [pid for i in range(net.n) for pid in net.pids(i)]
        pb.stop()
        for j in joins.values():
            j.stop(timeout=5)
    assert ours(net.pid) == ([], [])
    until(lambda: not any(map(pid_running, pids)), timeout=10, what="every namespace process to exit")
