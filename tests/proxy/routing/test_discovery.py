"""Discovery (docs/deploy.md "Discovery") against a real etcd: the JSON-gateway client, leased
registrations that appear and expire, forged entries ignored and counted, the watched file, and
two proxies (separate processes) that route to a joining stub instance as its registration is
written (the watch, not the re-list a quiet watch makes every WATCH_IDLE_S), stop routing to one
whose registrar was killed (its 2 s lease), and drain together through etcd."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvferry.common import secret
from kvferry.common.discovery import sources as disc
from kvferry.common.discovery.etcd import Etcd
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from tests.logged_proc import Proc, complete, served
from tests.polling import until, until_async

_PREFIXES = itertools.count()


def _prefix() -> str:
    return f"/kvferry-test-{os.getpid()}-{next(_PREFIXES)}"


def _target(etcd_server, prefix: str) -> disc.Target:
    return disc.parse_target(f"etcd://127.0.0.1:{etcd_server.port}{prefix}")


def _record(iid: str, role: str = "prefiller", url: str = "http://127.0.0.1:1", **kw) -> m.InstanceRecord:
    if role == "decoder":
        kw.setdefault("init_ports", [free_port()])
        kw.setdefault("alloc_ports", [free_port()])
    return m.InstanceRecord(instance_id=iid, role=role, model="stub", url=url,
                            fingerprint=disc.fingerprint("stub"), **kw)


# ---- the etcd client and the registration itself (in-process, real etcd) ----

def test_discovery_etcd_client_put_range_watch_lease(etcd_server) -> None:
    async def body() -> None:
        etcd, prefix = Etcd(f"http://127.0.0.1:{etcd_server.port}"), _prefix().encode()
        try:
            lease = await etcd.grant(2)
            await etcd.put(prefix + b"/a", b"\x00\xffbytes", lease=lease)
            kvs, rev = await etcd.get_prefix(prefix + b"/")
            assert [(kv.key, kv.value, kv.lease) for kv in kvs] == [(prefix + b"/a", b"\x00\xffbytes", lease)]
            seen: list = []

            started = asyncio.Event()

            async def watch() -> None:
                async for evs in etcd.watch(prefix + b"/", rev + 1, 10):
                    started.set()  # the first batch is etcd's "created" notice: the watch is live
                    seen.extend((e.kind, e.kv.key) for e in evs)
                    if len(seen) >= 2:
                        return
            w = asyncio.ensure_future(watch())
            await asyncio.wait_for(started.wait(), 60)
            await etcd.put(prefix + b"/b", b"x")
            await etcd.revoke(lease)  # takes /a with it
            await asyncio.wait_for(w, 60)
            assert seen == [("put", prefix + b"/b"), ("delete", prefix + b"/a")]
            assert await etcd.keepalive(lease) == 0  # gone
            assert await etcd.delete(prefix + b"/b") == 1
        finally:
            await etcd.close()
    asyncio.run(body())



def test_discovery_etcd_client_bounds_on_the_one_http_client(etcd_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's bounds, on common/http/client.py: an Etcd built outside any loop works in one;
    a range page past its byte bound is asked again with fewer keys (every key still comes); a
    watch line past MAX_WATCH_LINE is refused; a quiet watch ends as WatchIdle after its idle
    timeout; an endpoint nobody serves is an EtcdError naming it, not a hang."""
    from kvferry.common.discovery import etcd as etcd_mod
    from kvferry.common.discovery.etcd import EtcdError, WatchIdle
    etcd, prefix = Etcd(f"http://127.0.0.1:{etcd_server.port}"), _prefix().encode()  # no loop runs yet

    async def body() -> None:
        try:
            for i in range(12):
                await etcd.put(prefix + b"/k%02d" % i, b"v" * 400)
            monkeypatch.setattr(etcd_mod, "MAX_PAGE_BYTES", 3000)  # a page of 256 keys (~6 KB) is too large
            kvs, rev = await etcd.get_prefix(prefix + b"/")
            assert [kv.key for kv in kvs] == [prefix + b"/k%02d" % i for i in range(12)]
            monkeypatch.setattr(etcd_mod, "MAX_WATCH_LINE", 1000)
            put = asyncio.ensure_future(etcd.put(prefix + b"/big", b"x" * 3000))
            with pytest.raises(EtcdError, match="a response of more than 1000 bytes"):
                async for _ in etcd.watch(prefix + b"/", rev + 1, 5):
                    pass
            await put
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(WatchIdle, match="nothing received for 0.5s"):
                async for _ in etcd.watch(prefix + b"/", rev + 100, 0.5):
                    pass
            # Nothing ever comes at rev + 100: only the 0.5 s idle timeout ends this watch.
            assert 0.45 <= loop.time() - t0 < 30.0
        finally:
            await etcd.close()
        nobody = Etcd(f"http://127.0.0.1:{free_port()}", timeout=1.0)
        try:
            with pytest.raises(EtcdError, match="is etcd running there") as e:
                await nobody.get(b"/x")
            assert not isinstance(e.value, WatchIdle)
        finally:
            await nobody.close()
    asyncio.run(body())


def test_discovery_etcd_registration_appears_withdraws_and_expires(etcd_server, cluster_secret) -> None:
    """A registration shows in a watcher at once, goes when withdrawn, and goes within the TTL when
    its keeper stops renewing (a killed instance)."""
    _, key = cluster_secret

    async def body() -> None:
        target = _target(etcd_server, _prefix())
        views: list[disc.Snapshot] = []
        watch = disc.EtcdWatch(target, key, views.append, lambda r: None)
        task = asyncio.ensure_future(watch.run())

        async def seconds_until(pred, what: str, timeout: float = 60.0) -> float:
            """Seconds until the latest view meets `pred`."""
            t0 = time.monotonic()
            await until_async(lambda: views and pred(views[-1]), timeout, what, every=0.02)
            return time.monotonic() - t0
        try:
            reg = disc.Registration(target, _record("p-1"), key, ttl=2)
            await reg.register()
            # Seen by the watch's event, not by the re-list a quiet watch makes after WATCH_IDLE_S (60 s).
            assert await seconds_until(lambda v: "p-1" in v.records, "the registration") < 30
            assert views[-1].records["p-1"].lease == reg.lease != 0
            await reg.withdraw()
            await seconds_until(lambda v: "p-1" not in v.records, "the withdrawal")
            # Killed: registered, renewed for a while, then no more renewals.
            stop = asyncio.Event()
            await reg.register()
            beat = asyncio.ensure_future(reg.keep_alive(stop))
            await seconds_until(lambda v: "p-1" in v.records, "the second registration")
            await asyncio.sleep(3.0)  # a sleep (window): longer than the TTL, the renewals keep it
            assert "p-1" in views[-1].records
            stop.set()
            await beat
            # Ended by the 2 s TTL (etcd's lease, or the record's signed expiry: the watch's timer);
            # nothing else would ever drop it (its key stays in etcd, a re-list finds it again).
            gone = await seconds_until(lambda v: "p-1" not in v.records, "the lease to expire")
            assert gone < 30, gone
            await reg.close()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await watch.close()
    asyncio.run(body())


def test_discovery_etcd_forged_entries_are_ignored_and_counted(etcd_server, cluster_secret) -> None:
    """Unsigned, wrongly signed, replayed under another lease, or stored under another id's key:
    none counts, each reason is counted once per key."""
    _, key = cluster_secret
    other = secret.from_text("another secret, not the cluster's", "test")

    async def body() -> None:
        target = _target(etcd_server, _prefix())
        etcd = Etcd(target.endpoint)
        reasons: list[str] = []
        views: list[disc.Snapshot] = []
        watch = disc.EtcdWatch(target, key, views.append, reasons.append)
        try:
            lease = await etcd.grant(30)
            good = _record("good", lease=lease)
            k = disc.record_key(target.prefix, "good")
            await etcd.put(k, disc.sign(key, k, good), lease=lease)
            for iid, signer in (("unsigned", None), ("forged", other)):
                rk = disc.record_key(target.prefix, iid)
                await etcd.put(rk, disc.sign(signer, rk, _record(iid, lease=lease)), lease=lease)
            # The good record, copied (signature and all) under another lease and another key.
            lease2 = await etcd.grant(30)
            await etcd.put(k, disc.sign(key, k, good), lease=lease2)  # replaces good: wrong lease now
            k3 = disc.record_key(target.prefix, "copy")
            await etcd.put(k3, disc.sign(key, k, good), lease=lease)
            await etcd.put(disc.record_key(target.prefix, "junk"), b"not msgpack")
            await watch.sync()
            await watch.sync()  # a second listing counts nothing again
            assert views[-1].records == {}
            assert sorted(reasons) == ["bad_signature", "bad_signature", "lease", "malformed", "unsigned"]
            await disc.write_entry(etcd, key, k, good, time.time() + 30)  # the real one, bound to its key
            await watch.sync()
            assert list(views[-1].records) == ["good"]
        finally:
            await watch.close()
            await etcd.close()
    asyncio.run(body())


def test_discovery_file_reload(tmp_path: Path) -> None:
    """A discovery file is read when it changes (an atomic rewrite, or in place), a bad one keeps
    the last good view and says which entry is wrong."""
    path = tmp_path / "cluster.yaml"
    views: list[disc.Snapshot] = []
    fw = disc.FileWatch(disc.parse_target(f"file://{path}"), views.append)
    assert fw.poll() is False and views == []  # no file yet: nothing changed
    path.write_text("instances:\n  - {instance_id: p1, role: prefiller, model: stub, url: 'http://127.0.0.1:1'}\n")
    assert fw.poll() and list(views[-1].records) == ["p1"]
    assert fw.poll() is False
    disc.edit_file(str(path), lambda d: d["drain"].append("p1"))
    assert fw.poll() and views[-1].drained == {"p1"} and list(views[-1].records) == ["p1"]
    path.write_text("instances:\n  - {instance_id: p2, role: cook, model: stub, url: 'http://127.0.0.1:1'}\n")
    with pytest.raises(disc.DiscoveryError, match=r"instances\[0\].*role"):
        fw.poll()
    assert list(views[-1].records) == ["p1"]
    with pytest.raises(disc.DiscoveryError, match="etcd://HOST:PORT"):
        disc.parse_target("etcd://nohost")
    # `kvferry join --discovery file://` adds and removes its own entry (under the file's lock).
    path.write_text("instances: []\n")
    reg = disc.Registration(disc.parse_target(f"file://{path}"), _record("p9", "decoder"), None)
    asyncio.run(reg.register())
    assert fw.poll() and list(views[-1].records) == ["p9"] and views[-1].records["p9"].init_ports
    asyncio.run(reg.withdraw())
    assert fw.poll() and views[-1].records == {}


# ---- proxies in their own processes, stub engines, `kvferry join --attach` registrars ----

def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def _start(procs: list[Proc], tmp: Path, name: str, args: list[str], probe: str | None = None) -> Proc:
    p = Proc(args, tmp / f"{name}.log")
    procs.append(p)
    if probe is not None:
        until(lambda: _http_ok(probe) or p.proc.poll() is not None, 30, f"{name} at {probe}")
        assert p.proc.poll() is None, (tmp / f"{name}.log").read_text()
    return p


def _stub(procs, tmp, name: str) -> str:
    port = free_port()
    _start(procs, tmp, name, ["-m", "kvferry.testing.stub_engine", "--port", str(port)],
           f"http://127.0.0.1:{port}/health")
    return f"http://127.0.0.1:{port}"


def _join(procs, tmp, name: str, target: str, role: str, url: str, secret_file: Path) -> Proc:
    args = ["-m", "kvferry.launcher", "join", "--discovery", target, "--role", role, "--attach", url,
            "--model", "stub", "--instance-id", name, "--lease-ttl", "2", "--cluster-secret-file", str(secret_file)]
    if role == "decoder":
        args += ["--init-ports", str(free_port()), "--alloc-ports", str(free_port())]
    return _start(procs, tmp, f"join-{name}", args)


def _proxy(procs, tmp, name: str, target: str, secret_file: Path) -> str:
    port = free_port()
    _start(procs, tmp, name, ["-m", "kvferry.proxy", "--port", str(port), "--discovery", target,
                              "--cluster-secret-file", str(secret_file), "--policy", "round_robin",
                              "--health-interval", "0.5", "--admin-key", "admin-key-for-tests"],
           f"http://127.0.0.1:{port}/metrics")
    return f"http://127.0.0.1:{port}"


ADMIN = {"Authorization": "Bearer admin-key-for-tests"}


def _instances(proxy: str) -> dict[str, dict]:
    r = httpx.get(f"{proxy}/admin/instances", headers=ADMIN, timeout=5)
    return {i["instance_id"]: i for i in r.json()["instances"] if "instance_id" in i}


def _rejected(proxy: str) -> dict[str, float]:
    text = httpx.get(f"{proxy}/metrics", timeout=5).text
    return {k: float(v) for k, v in re.findall(r'kvferry_proxy_discovery_rejected_total\{reason="(\w+)"\} (\S+)', text)}


def test_discovery_etcd_two_proxies_join_expire_drain(etcd_server, cluster_secret, tmp_path: Path,
                                                     procs: list[Proc]) -> None:
    secret_file, key = cluster_secret
    prefix = _prefix()
    target = f"etcd://127.0.0.1:{etcd_server.port}{prefix}"
    p1, p2, d1 = (_stub(procs, tmp_path, n) for n in ("p1", "p2", "d1"))
    _join(procs, tmp_path, "p1", target, "prefiller", p1, secret_file)
    _join(procs, tmp_path, "d1", target, "decoder", d1, secret_file)
    a, b = (_proxy(procs, tmp_path, n, target, secret_file) for n in ("proxy-a", "proxy-b"))
    for px in (a, b):
        until(lambda px=px: {"p1", "d1"} <= set(_instances(px)), 60, f"{px} to see p1 and d1")
    complete(a, 2)
    complete(b, 2)
    assert served(p1) == 4

    # A forged decoder (unsigned, and signed with another secret) is used by neither proxy.
    async def forge() -> None:
        etcd = Etcd(f"http://127.0.0.1:{etcd_server.port}")
        other = secret.from_text("not the cluster secret at all", "test")
        for iid, signer in (("evil1", None), ("evil2", other)):
            lease = await etcd.grant(60)
            k = disc.record_key(prefix, iid)
            await etcd.put(k, disc.sign(signer, k, _record(iid, "decoder", "http://127.0.0.1:9", lease=lease)),
                           lease=lease)
        await etcd.close()
    asyncio.run(forge())
    for px in (a, b):
        until(lambda px=px: _rejected(px).get("unsigned") == 1 and _rejected(px).get("bad_signature") == 1, 60,
              f"{px} to count the forged entries")
        assert not {"evil1", "evil2"} & set(_instances(px))

    # A new prefiller: both proxies route to it as its registration is written (the watch's event;
    # the re-list a quiet watch makes, every WATCH_IDLE_S = 60 s, would be the slow alternative).
    etcd_key = disc.record_key(prefix, "p2")

    async def registered() -> bool:
        etcd = Etcd(f"http://127.0.0.1:{etcd_server.port}")
        try:
            return await etcd.get(etcd_key) is not None
        finally:
            await etcd.close()
    joiner = _join(procs, tmp_path, "p2", target, "prefiller", p2, secret_file)
    until(lambda: asyncio.run(registered()), 60, "p2's registration")
    t_reg = time.monotonic()
    for px in (a, b):
        until(lambda px=px: "p2" in _instances(px), 60, f"{px} to route to p2")
    assert time.monotonic() - t_reg < 30
    before = served(p2)
    complete(a, 4)
    complete(b, 4)
    assert served(p2) - before == 4  # round robin over p1 and p2, on each proxy

    # Drain p2 through proxy a's admin API: proxy b drains it too.
    local = _instances(a)["p2"]["id"]
    r = httpx.post(f"{a}/admin/instances/{local}/drain", headers=ADMIN, timeout=5)
    assert r.status_code == 200 and r.json()["draining"]
    until(lambda: _instances(b)["p2"]["draining"], 60, "proxy b to drain p2")
    before = served(p2)
    complete(b, 3)
    complete(a, 3)
    assert served(p2) == before
    local_b = _instances(b)["p2"]["id"]
    assert httpx.post(f"{b}/admin/instances/{local_b}/undrain", headers=ADMIN, timeout=5).status_code == 200
    until(lambda: not _instances(a)["p2"]["draining"], 60, "proxy a to undrain p2")
    r = httpx.delete(f"{a}/admin/instances/{local}", headers=ADMIN, timeout=5)
    assert r.status_code == 409 and "kvferry join" in r.text  # discovery owns it

    # p2's registrar is killed (SIGKILL: no withdrawal): both proxies drop p2 by its 2 s lease (etcd
    # deletes the key, or the record's signed expiry passes), and no request fails or reaches it
    # afterwards. Nothing else would drop it: p2's engine still answers the proxies' health checks.
    joiner.kill()
    t_kill = time.monotonic()
    for px in (a, b):
        until(lambda px=px: "p2" not in _instances(px), 60, f"{px} to drop p2")
    assert time.monotonic() - t_kill < 30
    before = served(p2)
    complete(a, 3)
    complete(b, 3)
    assert served(p2) == before


def test_discovery_file_proxy_follows_the_file(tmp_path: Path, procs: list[Proc]) -> None:
    """kvferry-proxy --discovery file://: instances added, drained and removed by editing the file."""
    p1, d1 = (_stub(procs, tmp_path, n) for n in ("p1", "d1"))
    path = tmp_path / "cluster.json"
    events = [f"ipc://{tmp_path}/p1-events.sock", f"ipc://{tmp_path}/p1-replay.sock"]
    rec = {"instances": [msgspec.to_builtins(_record("p1", url=p1, kv_events=events)),
                         msgspec.to_builtins(_record("d1", "decoder", d1)),
                         {"instance_id": "x1", "role": "prefiller", "model": "other", "url": "http://127.0.0.1:2"},
                         {**msgspec.to_builtins(_record("x2", url="http://127.0.0.1:3")), "fingerprint": "ffff"}],
           "drain": []}
    path.write_text(json.dumps(rec))
    port = free_port()
    px = f"http://127.0.0.1:{port}"
    _start(procs, tmp_path, "proxy", ["-m", "kvferry.proxy", "--port", str(port), "--discovery", f"file://{path}",
                                      "--admin-key", "admin-key-for-tests"], f"{px}/metrics")
    until(lambda: _http_ok(f"{px}/health") and httpx.get(f"{px}/health").json()["status"] == "ok", 60,
          "the proxy ready")
    complete(px, 2)
    assert served(p1) == 2
    assert set(_instances(px)) == {"p1", "d1"}  # another model, another KV layout: not used
    assert _rejected(px) == {"model": 1, "fingerprint": 1}
    disc.edit_file(str(path), lambda d: d["drain"].append("p1"))
    until(lambda: _instances(px)["p1"]["draining"], 60, "p1 drained")
    # Its only prefiller drained: the decoder serves requests whole, and p1 gets none.
    assert httpx.post(f"{px}/v1/completions", json={"model": "stub", "prompt": "x", "max_tokens": 2},
                      timeout=10).status_code == 200
    assert served(p1) == 2 and httpx.get(f"{px}/health").json()["status"] == "degraded"
    local = _instances(px)["p1"]["id"]  # its KV-event subscription runs (nothing publishes: it is stale)
    health = httpx.get(f"{px}/health", headers=ADMIN).json()
    assert f"kv_events_{local}" in health["background"]
    assert next(i for i in health["instances"] if i["id"] == local)["kv_events"]["endpoint"] == events[0]
    disc.edit_file(str(path), lambda d: d.update(instances=[i for i in d["instances"] if i["instance_id"] != "p1"]))
    until(lambda: "p1" not in _instances(px), 60, "p1 removed")
    assert f"kv_events_{local}" not in httpx.get(f"{px}/health", headers=ADMIN).json()["background"]
    # A broken file keeps the last good view and shows on /health; the fixed one is read again.
    path.write_text("instances: [{instance_id: p1, role: cook}]")
    until(lambda: not httpx.get(f"{px}/health", headers=ADMIN).json()["background"]["discovery"]["ok"], 60,
          "the bad file on /health")
    assert "role" in httpx.get(f"{px}/health", headers=ADMIN).json()["background"]["discovery"]["last_error"]
    assert "d1" in _instances(px)
    path.write_text(json.dumps(rec))
    until(lambda: "p1" in _instances(px), 60, "p1 back")


def test_discovery_join_help_and_errors() -> None:
    """`kvferry join --help` works; a missing secret beyond loopback is one line naming the fix."""
    kv = [sys.executable, "-m", "kvferry.launcher", "join"]
    r = subprocess.run([*kv, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--discovery" in r.stdout and "--attach" in r.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_CLUSTER_SECRET")}
    r = subprocess.run([*kv, "--discovery", "etcd://10.1.2.3:2379/x", "--role", "decoder", "--attach",
                        "http://127.0.0.1:1"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "cluster secret" in r.stderr and "--cluster-secret-file" in r.stderr
    r = subprocess.run([*kv, "--discovery", "zk://h:1", "--role", "decoder"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2 and "etcd://HOST:PORT/PREFIX, file://PATH or k8s://NAMESPACE" in r.stderr


def test_discovery_needs_the_secret_beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.proxy.app import Proxy
    from kvferry.proxy.instance_flags import OptionError
    from kvferry.proxy.options import parse
    monkeypatch.delenv("KVFERRY_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_CLUSTER_SECRET_FILE", raising=False)
    for argv in (["--discovery", "etcd://10.1.2.3:2379/k"],
                 ["--discovery", "etcd://127.0.0.1:2379/k", "--host", "0.0.0.0", "--admin-key", "k" * 20]):
        with pytest.raises(OptionError, match="needs the cluster secret.*--cluster-secret-file"):
            Proxy(parse(argv))
    Proxy(parse(["--discovery", "etcd://10.1.2.3:2379/k", "--insecure-discovery"]))
    with pytest.raises(OptionError, match="--load-interval"):
        parse(["--discovery", "file:///x", "--load-interval", "-1"])


def test_discovery_load_every_proxy_sees(tmp_path: Path, procs: list[Proc]) -> None:
    """Requests a proxy did not send (another proxy's, here sent to the engine directly) count in its
    routing load: the engine's running + waiting, scraped from /metrics."""
    port = free_port()
    stub = f"http://127.0.0.1:{port}"
    _start(procs, tmp_path, "p1", ["-m", "kvferry.testing.stub_engine", "--port", str(port), "--max-running", "1",
                                   "--prompt-delay", "1"], f"{stub}/health")
    d1 = _stub(procs, tmp_path, "d1")
    px_port = free_port()
    px = f"http://127.0.0.1:{px_port}"
    _start(procs, tmp_path, "proxy", ["-m", "kvferry.proxy", "--port", str(px_port), "--prefiller", stub,
                                      "--decoder", f"{d1},{free_port()},{free_port()}", "--load-interval", "0.1",
                                      "--admin-key", "admin-key-for-tests"], f"{px}/metrics")

    async def others() -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            await asyncio.gather(*(c.post(f"{stub}/v1/completions", json={"prompt": "x", "max_tokens": 1})
                                   for _ in range(3)))
    import threading
    t = threading.Thread(target=lambda: asyncio.run(others()))
    t.start()
    try:
        def load() -> int | None:
            insts = httpx.get(f"{px}/admin/instances", headers=ADMIN, timeout=5).json()["instances"]
            return next(i for i in insts if i["role"] == "prefiller").get("engine_load")
        until(lambda: load() == 3, 60, "the proxy to see 1 running + 2 waiting on the prefiller")
    finally:
        t.join(30)


def test_discovery_etcd_outage_keeps_serving_and_recovers(etcd_available, cluster_secret, tmp_path: Path,
                                                          procs: list[Proc]) -> None:
    """etcd dies: the proxy keeps its instances (and says so on /health and /metrics, where the
    alerts read it); a new etcd on the same address: the sidecars register again (their lease is
    unknown there) and the proxy lists it."""
    from kvferry.launcher import services
    secret_file, _ = cluster_secret
    etcd = services.start_etcd(tmp_path / "e1")
    try:
        target = f"etcd://127.0.0.1:{etcd.port}/outage"
        p1, d1 = (_stub(procs, tmp_path, n) for n in ("p1", "d1"))
        _join(procs, tmp_path, "p1", target, "prefiller", p1, secret_file)
        _join(procs, tmp_path, "d1", target, "decoder", d1, secret_file)
        px = _proxy(procs, tmp_path, "proxy", target, secret_file)
        until(lambda: {"p1", "d1"} <= set(_instances(px)), 60, "the proxy to see p1 and d1")

        def metric(name: str) -> float | None:
            for line in httpx.get(f"{px}/metrics", timeout=5).text.splitlines():
                if line.startswith(f'{name}{{source="etcd"}} '):
                    return float(line.rsplit(" ", 1)[1])
            return None
        assert metric("kvferry_proxy_discovery_healthy") == 1
        assert metric("kvferry_proxy_discovery_errors_total") is None  # no error yet: no series
        etcd.kill()

        def discovery_ok() -> bool:
            return httpx.get(f"{px}/health", headers=ADMIN, timeout=5).json()["background"]["discovery"]["ok"]
        until(lambda: not discovery_ok(), 60, "the outage on /health")
        assert metric("kvferry_proxy_discovery_healthy") == 0 and (metric("kvferry_proxy_discovery_errors_total")
                                                                    or 0) >= 1
        complete(px, 2)  # still serving what it knew
        assert {"p1", "d1"} <= set(_instances(px))
        etcd = services.start_etcd(tmp_path / "e2", port=etcd.port)

        async def keys() -> int:
            e = Etcd(f"http://127.0.0.1:{etcd.port}")
            try:
                return len((await e.get_prefix(b"/outage/"))[0])
            finally:
                await e.close()
        until(lambda: asyncio.run(keys()) == 2, 60, "the sidecars to register in the new etcd")
        until(discovery_ok, 60, "the proxy to list the new etcd")
        assert metric("kvferry_proxy_discovery_healthy") == 1
        assert {"p1", "d1"} <= set(_instances(px))
        complete(px, 2)
    finally:
        etcd.stop()
