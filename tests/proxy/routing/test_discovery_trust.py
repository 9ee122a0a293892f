"""What a stranger with etcd access can no longer do to discovery (docs/deploy.md "Trust"), against
a real etcd and a real proxy process: a record written back after its instance withdrew (under a
lease re-granted with the same ID), or over a newer registration of the same id, routes nothing;
a dead registrar's lease kept alive by someone else routes nothing once the record's signed
expiry passes; a drain mark written back after an undrain drains nothing; a live key deleted is
written back within a third of the TTL; thousands of junk keys cost bounded log lines and memory
and leave the proxy routing. And etcd's own security: a user with a password (its token renewed
when etcd forgets it) and client-certificate TLS, each end to end (a registration a proxy
routes), each wrong setting a clear error."""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from kvferry.common import secret
from kvferry.common.discovery import entries as disc_entries
from kvferry.common.discovery import sources as disc
from kvferry.common.discovery import watch as discovery_watch
from kvferry.common.discovery.etcd import KV, Etcd, EtcdAccessError, prefix_end
from kvferry.common.netutil import free_port, machine_address
from kvferry.common.wire import messages as m
from kvferry.launcher import services
from kvferry.launcher.join import JoinedInstance, Registrar
from kvferry.testing.processes import wait_http
from tests.logged_proc import Proc, complete, served
from tests.polling import until
from tests.tls_certs import _signed, make_certs

TTL = 2
ADMIN = {"Authorization": "Bearer admin-key-for-trust-tests"}
_IDS = itertools.count()


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def stranger(endpoint: str, path: str, body: dict, token: str = "") -> dict:
    """A plain etcd client with write access and no cluster secret (or an admin, with a token)."""
    r = httpx.post(f"{endpoint}{path}", json=body, headers={"Authorization": token} if token else {}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


class Loop:
    """An event loop in a thread: in-process registrations and watches live on across test steps."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 15) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, coro: Coroutine[Any, Any, Any]):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Cluster:
    work: Path
    etcd: str  # http://127.0.0.1:PORT
    prefix: str
    target: disc.Target
    secret_file: Path
    key: secret.ClusterSecret
    victim: str  # a stub prefiller the replayed entries point at
    proxy: str
    proxy_log: Path
    bg: Loop
    client: Etcd  # on bg


def _stub(procs: list[Proc], work: Path, name: str) -> str:
    port = free_port()
    p = Proc(["-m", "kvferry.testing.stub_engine", "--port", str(port)], work / f"{name}.log")
    procs.append(p)
    wait_http(f"http://127.0.0.1:{port}/health", p.proc, log=p.log)
    return f"http://127.0.0.1:{port}"


def _proxy(procs: list[Proc], work: Path, name: str, target: str, secret_file: Path) -> tuple[str, Path]:
    port = free_port()
    p = Proc(["-m", "kvferry.proxy", "--port", str(port), "--discovery", target, "--cluster-secret-file",
              str(secret_file), "--policy", "round_robin", "--admin-key", ADMIN["Authorization"].split()[1]],
             work / f"{name}.log")
    procs.append(p)
    wait_http(f"http://127.0.0.1:{port}/metrics", p.proc, log=p.log)
    return f"http://127.0.0.1:{port}", p.log


def _record(iid: str, url: str, role: str = "prefiller") -> m.InstanceRecord:
    ports = {"init_ports": [free_port()], "alloc_ports": [free_port()]} if role == "decoder" else {}
    return m.InstanceRecord(instance_id=iid, role=role, model="stub", url=url, fingerprint=disc.fingerprint("stub"),
                            **ports)


def _instances(proxy: str) -> dict[str, dict]:
    r = httpx.get(f"{proxy}/admin/instances", headers=ADMIN, timeout=5)
    return {i["instance_id"]: i for i in r.json()["instances"] if "instance_id" in i}


def _rejected(proxy: str, reason: str) -> float:
    text = httpx.get(f"{proxy}/metrics", timeout=5).text
    found = re.search(rf'kvferry_proxy_discovery_rejected_total\{{reason="{reason}"\}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One proxy watching a prefix where a prefiller and a decoder stay registered (a Registrar
    thread, TTL 2 s); each test registers (and replays) one more instance there."""
    work = tmp_path_factory.mktemp("trust")
    secret_file = work / "cluster.secret"
    secret.write_file(str(secret_file), secret.generate())
    key = secret.from_file(str(secret_file), "test")
    prefix = f"/trust-{os.getpid()}"
    etcd = f"http://127.0.0.1:{etcd_server.port}"
    target = disc.parse_target(f"etcd://127.0.0.1:{etcd_server.port}{prefix}")
    procs: list[Proc] = []
    bg = Loop()
    registrar = Registrar(target, key, TTL)
    try:
        live_p, live_d, victim = (_stub(procs, work, n) for n in ("live-p", "live-d", "victim"))
        registrar.start_thread([JoinedInstance(_record("p-live", live_p), f"{live_p}/health"),
                                JoinedInstance(_record("d-live", live_d, "decoder"), f"{live_d}/health")])
        proxy, log = _proxy(procs, work, "proxy", f"etcd://127.0.0.1:{etcd_server.port}{prefix}", secret_file)
        until(lambda: {"p-live", "d-live"} <= set(_instances(proxy)), 60, "the proxy to list the live instances")
        client = Etcd(etcd)
        yield Cluster(work, etcd, prefix, target, secret_file, key, victim, proxy, log, bg, client)
        bg.run(client.close())
    finally:
        registrar.stop()
        for p in reversed(procs):
            p.stop()
        bg.close()


def _register(c: Cluster, iid: str, url: str, ttl: int = TTL) -> tuple[disc.Registration, Any, asyncio.Event]:
    """An instance registered in-process and kept alive (its beat: the returned future)."""
    reg = disc.Registration(c.target, _record(iid, url), c.key, ttl=ttl)

    async def start() -> asyncio.Event:
        await reg.register()
        return asyncio.Event()
    stop = c.bg.run(start())
    beat = c.bg.start(reg.keep_alive(stop))
    until(lambda: iid in _instances(c.proxy), 60, f"the proxy to list {iid}")
    return reg, beat, stop


def _end(c: Cluster, reg: disc.Registration, beat: Any, stop: asyncio.Event) -> None:
    c.bg.loop.call_soon_threadsafe(stop.set)
    beat.result(60)
    c.bg.run(reg.withdraw())
    c.bg.run(reg.close())


def test_trust_replayed_record_routes_nothing(cluster: Cluster) -> None:
    """The signed bytes of a withdrawn instance, put back under its lease ID granted again, are
    refused (its key was created anew); so are they over a newer registration of the same id
    (a restart with a fixed --instance-id), which its registrar writes back within TTL/3."""
    c, iid = cluster, f"p-replay-{next(_IDS)}"
    reg, beat, stop = _register(c, iid, c.victim)
    stolen = c.bg.run(c.client.get(reg.key))
    assert stolen is not None and stolen.lease == reg.lease
    _end(c, reg, beat, stop)
    until(lambda: iid not in _instances(c.proxy), 60, f"the proxy to drop {iid}")

    replayed = _rejected(c.proxy, "replayed")
    stranger(c.etcd, "/v3/lease/grant", {"TTL": "60", "ID": str(stolen.lease)})  # etcd lets anyone choose the ID
    stranger(c.etcd, "/v3/kv/put", {"key": b64(stolen.key), "value": b64(stolen.value), "lease": str(stolen.lease)})
    until(lambda: _rejected(c.proxy, "replayed") > replayed, 60, "the proxy to refuse the replayed record")
    assert iid not in _instances(c.proxy)
    before = served(c.victim)
    complete(c.proxy, 4)
    assert served(c.victim) == before

    # The same instance restarts elsewhere (a new URL) with the same id; the stranger writes the
    # old record over the new one (the key keeps its new create revision).
    stranger(c.etcd, "/v3/kv/deleterange", {"key": b64(stolen.key)})
    new_url = f"http://127.0.0.1:{free_port()}"
    reg, beat, stop = _register(c, iid, new_url)
    replayed = _rejected(c.proxy, "replayed")
    stranger(c.etcd, "/v3/kv/put", {"key": b64(stolen.key), "value": b64(stolen.value), "lease": str(stolen.lease)})
    until(lambda: _rejected(c.proxy, "replayed") > replayed, 60, "the proxy to refuse the record over the new one")
    assert _instances(c.proxy).get(iid, {}).get("url") != c.victim
    until(lambda: _instances(c.proxy).get(iid, {}).get("url") == new_url, 60,
          "the registrar to write its record back")
    _end(c, reg, beat, stop)
    stranger(c.etcd, "/v3/lease/revoke", {"ID": str(stolen.lease)})


def test_trust_kept_alive_dead_lease_routes_nothing_after_the_signed_expiry(cluster: Cluster) -> None:
    """The registrar dies (its beats stop, nothing is withdrawn) and a stranger keeps its lease
    alive: the key stays in etcd, but every proxy drops the record when its signed expiry
    (last renewal + TTL) plus the clock allowance passes."""
    c, iid = cluster, f"p-kept-{next(_IDS)}"
    reg, beat, stop = _register(c, iid, c.victim)
    alive = threading.Event()

    def keep() -> None:  # the stranger's keepalives, from before the registrar's last beat on
        while not alive.wait(0.3):
            stranger(c.etcd, "/v3/lease/keepalive", {"ID": str(reg.lease)})
    t = threading.Thread(target=keep, daemon=True)
    t.start()
    try:
        beat.cancel()  # the registrar is gone
        until(beat.done, 60, "the beat to stop")
        last = c.bg.run(c.client.get(reg.key))
        assert last is not None, "the stranger's keepalives hold the key"
        expires = m.decode(last.value, m.SignedEntry).expires
        expired = _rejected(c.proxy, "expired")
        until(lambda: iid not in _instances(c.proxy), max(0.0, expires - time.time()) + c.target.clock_skew + 60,
              f"the proxy to drop {iid} at its signed expiry")
        assert time.time() >= expires  # not earlier: it was the expiry, not the lease
        assert c.bg.run(c.client.get(reg.key)) is not None  # the lease, kept alive, still holds the key
        assert _rejected(c.proxy, "expired") == expired + 1
        before = served(c.victim)
        complete(c.proxy, 4)
        assert served(c.victim) == before
    finally:
        alive.set()
        t.join(5)
        c.bg.run(reg.withdraw())
        c.bg.run(reg.close())


def test_trust_replayed_drain_mark_drains_nothing(cluster: Cluster) -> None:
    """A drain mark copied while it drained, put back (under the live instance's lease) after the
    undrain, is refused: the instance keeps serving."""
    c, iid = cluster, f"p-drain-{next(_IDS)}"
    reg, beat, stop = _register(c, iid, c.victim)
    try:
        c.bg.run(disc.set_drain(c.target, c.key, iid, True))
        until(lambda: _instances(c.proxy)[iid]["draining"], 60, "the drain")
        mark = c.bg.run(c.client.get(disc.drain_key(c.prefix, iid)))
        assert mark is not None and mark.lease == reg.lease
        c.bg.run(disc.set_drain(c.target, c.key, iid, False))
        until(lambda: not _instances(c.proxy)[iid]["draining"], 60, "the undrain")

        replayed = _rejected(c.proxy, "replayed")
        stranger(c.etcd, "/v3/kv/put", {"key": b64(mark.key), "value": b64(mark.value), "lease": str(mark.lease)})
        until(lambda: _rejected(c.proxy, "replayed") > replayed, 60, "the proxy to refuse the replayed mark")
        assert not _instances(c.proxy)[iid]["draining"]
        before = served(c.victim)
        complete(c.proxy, 4)  # round robin over p-live and this one
        assert served(c.victim) == before + 2
    finally:
        _end(c, reg, beat, stop)


def test_trust_deleted_live_key_is_written_back_by_its_registrars_next_beat(cluster: Cluster) -> None:
    """A stranger deletes a live instance's key: its registrar's next beat (every TTL/3) finds the
    key gone and claims and writes it again."""
    c, iid, ttl = cluster, f"p-del-{next(_IDS)}", 3
    reg, beat, stop = _register(c, iid, c.victim, ttl=ttl)
    try:
        def counts() -> bool:
            kv = c.bg.run(c.client.get(reg.key))
            if kv is None or not kv.value:
                return False
            return disc.verify(c.key, kv, c.prefix).inner == reg.record
        assert stranger(c.etcd, "/v3/kv/deleterange", {"key": b64(reg.key)})["deleted"] == "1"
        # Only the registrar writes this record (the stranger deleted it); its next beat, at most
        # TTL/3 away, finds the key gone (how soon on a loaded machine is not this test's claim).
        until(counts, 60, f"{iid}'s record back in etcd", every=0.02)
        until(lambda: iid in _instances(c.proxy), 60, "the proxy to list it again")
    finally:
        _end(c, reg, beat, stop)


def test_trust_garbage_keys_cost_bounded_logs_and_memory(cluster: Cluster,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """3,000 junk keys, a 1 MB value and a 100 kB key under the prefix: the proxy keeps routing,
    logs at most MAX_LOGGED of them (and one line saying it stops), counts every one; a watch
    verifies each once, forgets them as they go, and tracks at most MAX_ENTRIES keys."""
    c = cluster
    junk = f"{c.prefix}/instances/junk-".encode()
    logged_before = c.proxy_log.read_text().count("discovery: ignoring")
    rejected = _rejected(c.proxy, "malformed") + _rejected(c.proxy, "key")
    views: list[disc.Snapshot] = []
    reasons: list[str] = []
    watch = disc.EtcdWatch(c.target, c.key, views.append, reasons.append)
    task = c.bg.start(watch.run())
    try:
        until(lambda: views and {"p-live", "d-live"} <= set(views[-1].records), 60, "the watch's first view")
        for start in range(0, 3000, 100):
            ops = [{"request_put": {"key": b64(junk + b"%05d" % i), "value": b64(b"junk")}}
                   for i in range(start, start + 100)]
            stranger(c.etcd, "/v3/kv/txn", {"success": ops})
        stranger(c.etcd, "/v3/kv/put", {"key": b64(junk + b"big"), "value": b64(os.urandom(1 << 20))})
        stranger(c.etcd, "/v3/kv/put", {"key": b64(junk + b"x" * 100_000), "value": b64(b"junk")})
        until(lambda: _rejected(c.proxy, "malformed") + _rejected(c.proxy, "key") >= rejected + 3002, 60,
              "the proxy to count every junk key")
        until(lambda: len(watch._held) >= 3001 + 2, 60, "the watch to see the junk")
        assert len(watch._logged) <= discovery_watch.MAX_LOGGED
        assert len(watch._held) <= 3001 + 5  # the long key is not kept
        counted = len(reasons)
        c.bg.run(watch.sync())  # a full listing verifies nothing again (each key once per revision)
        assert len(reasons) == counted + 1  # the long key, not kept, is counted again
        text = c.proxy_log.read_text()
        assert text.count("discovery: ignoring") - logged_before <= discovery_watch.MAX_LOGGED
        assert text.count("logging no more of them") == 1
        assert max(map(len, text.splitlines())) < 2000  # the long key is shown cut
        assert {"p-live", "d-live"} <= set(_instances(c.proxy))
        complete(c.proxy, 2)

        stranger(c.etcd, "/v3/kv/deleterange", {"key": b64(junk), "range_end": b64(prefix_end(junk))})
        until(lambda: not watch._logged and len(watch._held) <= 5, 60, "the watch to forget the junk")
    finally:
        task.cancel()
        c.bg.run(watch.close())
    # A prefix with more keys than a proxy tracks: the rest are ignored, said once.
    monkeypatch.setattr(discovery_watch, "MAX_ENTRIES", 50)
    for start in range(0, 200, 100):
        stranger(c.etcd, "/v3/kv/txn", {"success": [{"request_put": {"key": b64(junk + b"%05d" % i),
                                                                     "value": b64(b"junk")}}
                                                    for i in range(start, start + 100)]})
    small = disc.EtcdWatch(c.target, c.key, views.append, lambda r: None)
    try:
        c.bg.run(small.sync())
        assert len(small._held) <= 50 and small._full
    finally:
        c.bg.run(small.close())
        stranger(c.etcd, "/v3/kv/deleterange", {"key": b64(junk), "range_end": b64(prefix_end(junk))})


# ---- etcd's own security: users and client certificates ----

def _etcd(work: Path, scheme: str = "http", *extra: str) -> services.Proc:
    port, peer = free_port(), free_port()
    client, peer_url = f"{scheme}://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    d = work / f"etcd-{port}"
    d.mkdir()
    exe = services.etcd_binary()
    assert exe
    return services.Proc("etcd", [exe, "--name", "t", "--data-dir", str(d / "data"), "--listen-client-urls", client,
                                "--advertise-client-urls", client, "--listen-peer-urls", peer_url,
                                "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"t={peer_url}",
                                "--logger", "zap", "--log-level", "warn", *extra], port, d / "etcd.log")


def _join(work: Path, name: str, target: str, url: str, secret_file: Path) -> Proc:
    return Proc(["-m", "kvferry.launcher", "join", "--discovery", target, "--role", "prefiller", "--attach", url,
                 "--model", "stub", "--instance-id", name, "--lease-ttl", str(TTL), "--cluster-secret-file",
                 str(secret_file)], work / f"join-{name}.log")


def _join_error(target: str, secret_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvferry.launcher", "join", "--discovery", target, "--role",
                           "prefiller", "--attach", "http://127.0.0.1:1", "--model", "stub",
                           "--cluster-secret-file", str(secret_file)], capture_output=True, text=True, timeout=60)


@pytest.fixture
def started() -> Iterator[list[Proc | services.Proc]]:
    """What a test starts (processes, an etcd), stopped in reverse order after it, pass or fail."""
    things: list[Proc | services.Proc] = []
    yield things
    for t in reversed(things):
        t.stop()


def test_trust_etcd_user_and_password(etcd_available, cluster: Cluster, tmp_path: Path,
                                      started: list) -> None:
    """etcd with auth on (a root user, a `kvferry` role with readwrite on the prefix, one user of
    it): a registrar and a proxy that log in register and route, a drain goes through; a token
    etcd forgot is fetched again; a wrong password or no user is one line naming the fix."""
    c = cluster
    etcd = _etcd(tmp_path)
    started.append(etcd)
    ep = f"http://127.0.0.1:{etcd.port}"
    for path, body in (("role/add", {"name": "root"}), ("user/add", {"name": "root", "password": "root-pw"}),
                       ("user/grant", {"user": "root", "role": "root"}), ("role/add", {"name": "kvferry"}),
                       ("role/grant", {"name": "kvferry", "perm": {"permType": "READWRITE", "key": b64(b"/auth/"),
                                                                  "range_end": b64(prefix_end(b"/auth/"))}}),
                       ("user/add", {"name": "node1", "password": "node1-pw"}),
                       ("user/grant", {"user": "node1", "role": "kvferry"}), ("enable", {})):
        stranger(ep, f"/v3/auth/{path}", body)
    pw = tmp_path / "etcd.password"
    pw.write_text("node1-pw\n")
    pw.chmod(0o600)
    target = f"etcd://127.0.0.1:{etcd.port}/auth?user=node1&password_file={pw}"
    started.append(_join(tmp_path, "p-auth", target, c.victim, c.secret_file))
    proxy, _ = _proxy(started, tmp_path, "proxy-auth", target, c.secret_file)
    until(lambda: "p-auth" in _instances(proxy), 60, "the proxy to list p-auth through etcd's auth")
    local = _instances(proxy)["p-auth"]["id"]
    r = httpx.post(f"{proxy}/admin/instances/{local}/drain", headers=ADMIN, timeout=5)
    assert r.status_code == 200 and r.json()["draining"], r.text

    async def relogin() -> int:
        e = Etcd(ep, user="node1", password="node1-pw")
        try:
            await e.get(b"/auth/x")
            root = stranger(ep, "/v3/auth/authenticate", {"name": "root", "password": "root-pw"})["token"]
            stranger(ep, "/v3/auth/disable", {}, root)  # drops every token etcd gave out
            stranger(ep, "/v3/auth/enable", {})
            return len((await e.get_prefix(b"/auth/"))[0])
        finally:
            await e.close()
    assert c.bg.run(relogin()) >= 1  # the record, read with a new token

    bad = tmp_path / "wrong.password"
    bad.write_text("not-the-password\n")
    bad.chmod(0o600)
    r = _join_error(f"etcd://127.0.0.1:{etcd.port}/auth?user=node1&password_file={bad}", c.secret_file)
    assert r.returncode == 2 and "authentication failed" in r.stderr and "password_file" in r.stderr, r.stderr
    assert "not-the-password" not in r.stderr
    r = _join_error(f"etcd://127.0.0.1:{etcd.port}/auth", c.secret_file)
    assert r.returncode == 2 and "auth enabled" in r.stderr and "user=" in r.stderr, r.stderr
    with pytest.raises(disc.DiscoveryError, match="password_file"):
        disc.parse_target(f"etcd://node1:node1-pw@127.0.0.1:{etcd.port}/auth")
    with pytest.raises(disc.DiscoveryError, match="password_file"):
        disc.parse_target(f"etcd://127.0.0.1:{etcd.port}/auth?user=node1&password=node1-pw")


def test_trust_etcd_client_certificate_tls(etcd_available, cluster: Cluster, tmp_path: Path,
                                           started: list) -> None:
    """etcd serving TLS and checking client certificates (--client-cert-auth): a registrar and a
    proxy with the CA and a client certificate register and route; without the certificate, one
    line naming cert= and key=."""
    c = cluster
    certs = make_certs(tmp_path / "certs")
    # etcd 3.4's gateway dials its own gRPC port with the server certificate: it must be a client's too.
    _signed(tmp_path / "certs", "etcd", "/CN=127.0.0.1", "ca",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    d = tmp_path / "certs"
    etcd = _etcd(tmp_path, "https", "--cert-file", str(d / "etcd.crt"), "--key-file", str(d / "etcd.key"),
                 "--client-cert-auth", "--trusted-ca-file", str(certs.ca))
    started.append(etcd)
    base = f"etcds://127.0.0.1:{etcd.port}/tls?cacert={certs.ca}"
    target = f"{base}&cert={certs.client_cert}&key={certs.client_key}"
    started.append(_join(tmp_path, "p-tls", target, c.victim, c.secret_file))
    proxy, _ = _proxy(started, tmp_path, "proxy-tls", target, c.secret_file)
    until(lambda: "p-tls" in _instances(proxy), 60, "the proxy to list p-tls through TLS")
    r = _join_error(base, c.secret_file)
    assert r.returncode == 2 and "TLS" in r.stderr and "cert=" in r.stderr, r.stderr
    with pytest.raises(disc.DiscoveryError, match="etcds://"):
        disc.parse_target(f"etcd://127.0.0.1:{etcd.port}/tls?cacert={certs.ca}")
    with pytest.raises(disc.DiscoveryError, match="go together"):
        disc.parse_target(f"{base}&cert={certs.client_cert}")
    with pytest.raises(EtcdAccessError, match="TLS"):
        c.bg.run(disc.check_access(disc.parse_target(base)))


def test_trust_entries_versioned_for_a_rolling_upgrade() -> None:
    """A new entry still carries the (key, body) signature older proxies check, so registrars can be
    upgraded first; an entry an older registrar wrote (no seal, no revision) is refused as `version`
    with the fix named, and a seal that does not cover its revision as `bad_signature`."""
    sk, prefix = secret.from_text("a cluster secret for the version test", "test"), "/versions"
    key = disc.record_key(prefix, "p-v")
    rec = m.InstanceRecord(instance_id="p-v", role="prefiller", model="stub", url="http://127.0.0.1:1", lease=7)
    new = m.decode(disc.sign(sk, key, rec, revision=5, expires=time.time() + 9), m.SignedEntry)
    assert sk.verify(disc_entries.PURPOSE, new.sig, key, new.body)
    assert disc.verify(sk, KV(key, m.encode(new), mod_revision=6, lease=7, create_revision=5), prefix).inner == rec
    old = m.encode(m.SignedEntry(body=new.body, sig=new.sig))
    with pytest.raises(disc.Rejected, match="upgrade kvferry join") as e:
        disc.verify(sk, KV(key, old, 6, 7, 5), prefix)
    assert e.value.reason == "version"
    moved = m.encode(msgspec.structs.replace(new, revision=9))
    with pytest.raises(disc.Rejected) as e:
        disc.verify(sk, KV(key, moved, 10, 7, 9), prefix)
    assert e.value.reason == "bad_signature"


def test_trust_join_advertises_this_machine_for_a_wildcard_bind(tmp_path: Path) -> None:
    """`kvferry join --bind-host 0.0.0.0` advertises this machine's address (netutil's choice), not
    its host name (which Debian resolves to 127.0.1.1): seen in the refusal naming what it would
    advertise beyond loopback without a cluster secret."""
    addr = machine_address()
    if addr is None:
        pytest.skip("this machine has no address beyond loopback")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_CLUSTER_SECRET")}
    r = subprocess.run([sys.executable, "-m", "kvferry.launcher", "join", "--discovery", f"file://{tmp_path}/c.yaml",
                        "--role", "prefiller", "--bind-host", "0.0.0.0", "--attach", "http://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and f"{addr} is beyond loopback" in r.stderr, r.stderr
