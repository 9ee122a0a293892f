"""Discovery from the Kubernetes API (``--discovery k8s://``): the official client library against a
protocol-faithful fake API server (kvferry.testing.fake_kube), in process and behind real proxies
(separate processes, ``--workers 2``) with stub engines. docs/testing.md says what the fake does
not prove."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from kvferry.common.discovery import sources as disc
from kvferry.common.discovery.kube import KubeWatch
from kvferry.common.discovery.pods import MAX_TP
from kvferry.common.netutil import free_port
from kvferry.testing.fake_kube import FakeKube, selector_matches
from tests.logged_proc import Proc, complete, served
from tests.polling import until, until_async

SELECT = {"app.kubernetes.io/part-of": "kvferry"}
ADMIN = {"Authorization": "Bearer admin-key-for-tests"}


def _prefill(fk: FakeKube, name: str, url: str, ready: bool = True, role_label: str = "kvferry.io/role") -> None:
    fk.add(name, {**SELECT, role_label: "prefill"},
           {"kvferry.io/model": "stub", "kvferry.io/port": url.rsplit(":")[-1]}, ready=ready)


def _decode(fk: FakeKube, name: str, url: str, ready: bool = True) -> None:
    """A decoder whose ports are named container ports (a prefiller's come from an annotation)."""
    fk.add(name, {**SELECT, "llm-d.ai/role": "decode"}, {"kvferry.io/model": "stub"}, ready=ready,
           ports={"http": int(url.rsplit(":")[-1]), "kvf-init-0": free_port(), "kvf-alloc-0": free_port()})


class Watched:
    """A KubeWatch run on this test's loop: its latest view and its rejections."""

    def __init__(self, target: disc.Target) -> None:
        self.views: list[disc.Snapshot] = []
        self.rejected: list[str] = []
        self.watch = KubeWatch(target, self.views.append, self.rejected.append)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.watch.run())

    @property
    def view(self) -> dict[str, bool]:
        """instance id -> drained."""
        if not self.views:
            return {}
        v = self.views[-1]
        return {i: i in v.drained for i in v.records}

    async def until(self, want: dict[str, bool], timeout: float = 10) -> None:
        def there() -> bool:
            if self.task is not None and self.task.done():
                self.task.result()  # the watch failed: its error, not a timeout
            return self.view == want
        if not self.views:  # the first list imports the client library (seconds on a loaded machine)
            timeout = max(timeout, 60)
        await until_async(there, timeout, lambda: f"view {want}, got {self.view}")

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def _target(fk: FakeKube, tmp: Path, token: str = "test-token", resync: int = 30) -> disc.Target:
    return disc.parse_target(f"k8s://kvferry?kubeconfig={fk.kubeconfig(tmp / f'kc-{token}', token)}&resync={resync}")


def test_k8s_target_parses_and_refuses_clearly(tmp_path: Path) -> None:
    t = disc.parse_target("k8s://team-a?selector=app%3Dllm,tier+in+(gpu)&resync=5")
    assert (t.scheme, t.namespace, t.selector, t.resync) == ("k8s", "team-a", "app=llm,tier in (gpu)", 5)
    assert disc.parse_target("k8s://ns").selector == "app.kubernetes.io/part-of=kvferry"
    for bad, says in (("k8s://Bad_NS", "namespace"), ("k8s://ns?resync=0", "resync"), ("k8s://ns?x=1", "?x="),
                      ("k8s://ns?context=a", "kubeconfig=FILE"), ("k8s://ns?selector=", "selector"),
                      (f"k8s://ns?kubeconfig={tmp_path}/none", "cannot be read")):
        with pytest.raises(disc.DiscoveryError, match=re.escape(says)):
            disc.parse_target(bad)
    # Pods are registered by Kubernetes: kvferry join and the admin API's drain say what to do instead.
    with pytest.raises(disc.DiscoveryError, match="labels and annotations"):
        disc.check_registrable(t, "kvferry join")
    with pytest.raises(disc.DiscoveryError, match="kubectl annotate pod d0 -n team-a kvferry.io/drain=true"):
        asyncio.run(disc.set_drain(t, None, "d0", True))


def test_k8s_fake_selector_grammar() -> None:
    labels = {"app": "llm", "tier": "gpu"}
    assert selector_matches("app=llm,tier in (gpu, cpu)", labels)
    assert selector_matches("app==llm,!missing,tier", labels)
    assert not selector_matches("app!=llm", labels)
    assert not selector_matches("tier notin (gpu)", labels)


def test_k8s_watch_follows_every_pod_state(tmp_path: Path) -> None:
    """Added, made ready, unready, annotated drained, terminating, deleted, force-deleted,
    relabelled out of the selector, relabelled without a role, and a pod that cannot be used."""
    async def run() -> None:
        with FakeKube() as fk:
            _prefill(fk, "p0", "http://x:8100")
            fk.add("other", {"app.kubernetes.io/part-of": "else", "kvferry.io/role": "prefill"},
                   {"kvferry.io/model": "stub"})
            w = Watched(_target(fk, tmp_path))
            w.start()
            await w.until({"p0": False})
            rec = w.views[-1].records["p0"]
            assert (rec.role, rec.url, rec.model) == ("prefiller", "http://127.0.0.1:8100", "stub")
            _decode(fk, "d0", "http://x:8200")
            await w.until({"p0": False, "d0": False})
            d0 = w.views[-1].records["d0"]
            assert d0.role == "decoder" and d0.receiver_host == "127.0.0.1" and len(d0.init_ports) == 1
            fk.add("d1", {**SELECT, "kvferry.io/role": "decoder"}, {
                "kvferry.io/model": "stub", "kvferry.io/port": "8300", "kvferry.io/init-ports": "7001, 7002",
                "kvferry.io/alloc-ports": "7101,7102"}, ip="10.1.2.3", ready=False)  # not ready: out of rotation
            await w.until({"p0": False, "d0": False, "d1": True})
            d1 = w.views[-1].records["d1"]
            assert (d1.init_ports, d1.alloc_ports, d1.tp_size, d1.url) == ([7001, 7002], [7101, 7102], 2,
                                                                           "http://10.1.2.3:8300")
            fk.ready("d1", True)
            await w.until({"p0": False, "d0": False, "d1": False})
            fk.annotate("d1", {"kvferry.io/drain": "true"})
            await w.until({"p0": False, "d0": False, "d1": True})
            fk.terminate("d0")  # graceful: drained first (its streams finish), then gone
            await w.until({"p0": False, "d0": True, "d1": True})
            fk.delete("d0")
            await w.until({"p0": False, "d1": True})
            fk.delete("d1")  # force: no deletionTimestamp ever seen
            await w.until({"p0": False})
            _prefill(fk, "p1", "http://x:8101")
            await w.until({"p0": False, "p1": False})
            fk.relabel("p1", {"app.kubernetes.io/part-of": "else", "kvferry.io/role": "prefill"})
            await w.until({"p0": False})
            fk.relabel("p0", SELECT)  # still selected, no role: not an instance
            await w.until({})
            # A decoder without its receiver's ports cannot be used: counted and logged once, not routed.
            fk.add("d2", {**SELECT, "kvferry.io/role": "decode"}, {"kvferry.io/model": "stub"})
            fk.add("d3", {**SELECT, "kvferry.io/role": "decode"}, {"kvferry.io/model": "stub",
                                                                    "kvferry.io/init-ports": "1," * MAX_TP + "1"})
            await until_async(lambda: w.rejected.count("malformed") >= 2, 60, "d2 and d3 rejected")
            assert w.view == {} and w.watch.lists == 1  # one list: everything since came by the watch
            await w.stop()
    asyncio.run(run())


def test_k8s_watch_relists_after_a_lost_delete_410_a_dropped_and_a_silent_watch(tmp_path: Path) -> None:
    async def run() -> None:
        with FakeKube(bookmark_s=0.2) as fk:
            for i in range(3):
                _prefill(fk, f"p{i}", f"http://x:{8100 + i}")
            w = Watched(_target(fk, tmp_path, resync=2))
            w.watch.quiet_s = 1
            w.start()
            await w.until({"p0": False, "p1": False, "p2": False})
            # A delete no watch event reports (a stale watch): the periodic list (every 2 s) catches it.
            fk.lose("p0")
            await w.until({"p1": False, "p2": False}, timeout=2 + 3)
            # The watch drops and a pod goes meanwhile: the watch is not resumed, the pods are listed.
            lists = fk.count("list")
            fk.disconnect()
            fk.lose("p1")
            await w.until({"p2": False}, timeout=3)
            assert fk.count("list") > lists
            # 410 Gone on the next watch: listed again, and what changed is seen.
            fk.gone_next_watch()
            _prefill(fk, "p3", "http://x:8103")
            await w.until({"p2": False, "p3": False}, timeout=5)
            # A watch that goes silent (no event, no bookmark, never ends): dropped and listed again.
            await until_async(lambda: fk.count("watch") > 0, 60, "a watch")
            lists = fk.count("list")
            fk.silence()
            fk.lose("p2")
            await until_async(lambda: fk.count("list") > lists, 2 + 1 + 3, "a list after the silent watch")
            await w.until({"p3": False}, timeout=3)
            fk.silence(False)
            watches = [q for k, q in fk.requests if k == "watch"]
            assert all(q["allowWatchBookmarks"] == "true" and q["resourceVersion"] not in ("", "0") for q in watches)
            await w.stop()
    asyncio.run(run())


def test_k8s_rbac_403_and_401_name_the_fix(tmp_path: Path) -> None:
    async def failure(fk: FakeKube, token: str) -> str:
        w = KubeWatch(_target(fk, tmp_path, token), lambda s: None, lambda r: None)
        with pytest.raises(disc.DiscoveryError) as e:
            await asyncio.wait_for(w.run(), 30)
        return str(e.value)

    async def run() -> None:
        with FakeKube(tokens={"list-only": {"list"}, "nothing": set()}) as fk:
            _prefill(fk, "p0", "http://x:8100")
            for token, verb in (("nothing", "list"), ("list-only", "watch")):
                msg = await failure(fk, token)
                assert f"refused to {verb} pods in namespace kvferry (403" in msg, msg
                assert "get, list and watch on pods in kvferry" in msg and "RoleBinding" in msg, msg
                assert f'cannot {verb} resource "pods"' in msg, msg  # the API server's own words
            msg = await failure(fk, "stolen")
            assert "did not accept this proxy's credentials (401" in msg, msg
    asyncio.run(run())


def test_k8s_in_cluster_service_account_over_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pod: the ServiceAccount's token and CA, the API server at KUBERNETES_SERVICE_HOST (https)."""
    from tests.tls_certs import make_certs
    certs = make_certs(tmp_path)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("pod-token")
    (sa / "ca.crt").write_bytes(certs.ca.read_bytes())

    async def run() -> None:
        with FakeKube(tokens={"pod-token": None}, tls=(certs.server_cert, certs.server_key)) as fk:
            _prefill(fk, "p0", "http://x:8100")
            monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
            monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(fk.port))
            w = Watched(disc.parse_target(f"k8s://kvferry?serviceaccount={sa}"))
            w.start()
            await w.until({"p0": False})
            await w.stop()
    asyncio.run(run())


def test_k8s_1000_pods_churned_leave_no_stale_instance_and_bounded_state(tmp_path: Path) -> None:
    """1,000 pods added, then made unready, deleted, force-deleted, lost, relabelled and some added
    again, while a watch runs: the view ends equal to the API server's pods, and nothing is kept
    for a pod that went."""
    async def run() -> None:
        with FakeKube() as fk:
            w = Watched(_target(fk, tmp_path, resync=2))
            w.start()
            await until_async(lambda: w.watch.lists > 0, 30, "the first list")
            for i in range(1000):
                _prefill(fk, f"p{i}", f"http://x:{10000 + i}")
            await w.until({f"p{i}": False for i in range(1000)}, timeout=60)
            for i in range(1000):
                match i % 5:
                    case 0:
                        fk.terminate(f"p{i}")
                        fk.delete(f"p{i}")
                    case 1:
                        fk.delete(f"p{i}")
                    case 2:
                        fk.lose(f"p{i}")
                    case 3:
                        fk.relabel(f"p{i}", {"app.kubernetes.io/part-of": "else", "kvferry.io/role": "prefill"})
            for i in range(0, 1000, 10):
                _prefill(fk, f"p{i}", f"http://x:{10000 + i}", ready=False)  # back, not ready yet
            want = {f"p{i}": i % 10 == 0 for i in range(1000) if i % 5 == 4 or i % 10 == 0}
            await w.until(want, timeout=60)
            assert len(w.watch.pods) == len(want)  # nothing kept for what went
            assert not w.watch._logged
            await w.stop()
    asyncio.run(run())


# ---- real proxies ----

def _start(procs: list[Proc], tmp: Path, name: str, args: list[str], probe: str) -> Proc:
    p = Proc(args, tmp / f"{name}.log")
    procs.append(p)

    def up() -> bool:
        try:
            return httpx.get(probe, timeout=1).status_code < 500 or p.proc.poll() is not None
        except httpx.HTTPError:
            return p.proc.poll() is not None
    until(up, 60, f"{name} at {probe}")
    assert p.proc.poll() is None, (tmp / f"{name}.log").read_text()
    return p


def _views(px: str, n: int = 6) -> set[frozenset]:
    """What /admin/instances says, asked `n` times on new connections (any of the workers answers)."""
    out = set()
    for _ in range(n):
        insts = httpx.get(f"{px}/admin/instances", headers=ADMIN, timeout=5).json()["instances"]
        out.add(frozenset((i["instance_id"], i["draining"]) for i in insts if "instance_id" in i))
    return out


def test_k8s_two_proxies_with_workers_follow_the_pods(tmp_path: Path, procs: list[Proc]) -> None:
    """Two proxies (2 workers each) watch the fake API server; stub engines are the pods: requests
    flow, an unready decoder gets no new requests, a deleted one is unrouted on both, and a pod
    deleted while no watch hears of it is unrouted within the resync period."""
    stubs = []
    for name in ("p0", "p1", "d0", "d1"):
        port = free_port()
        _start(procs, tmp_path, name, ["-m", "kvferry.testing.stub_engine", "--port", str(port)],
               f"http://127.0.0.1:{port}/health")
        stubs.append(f"http://127.0.0.1:{port}")
    p0, p1, d0, d1 = stubs
    with FakeKube() as fk:
        kc = fk.kubeconfig(tmp_path / "kubeconfig")
        _prefill(fk, "p0", p0)
        _decode(fk, "d0", d0)
        proxies = []
        for name in ("a", "b"):
            port = free_port()
            _start(procs, tmp_path, f"proxy-{name}", [
                "-m", "kvferry.proxy", "--port", str(port), "--workers", "2", "--policy", "round_robin",
                "--discovery", f"k8s://kvferry?kubeconfig={kc}&resync=2", "--admin-key", "admin-key-for-tests",
                "--health-interval", "0.5"], f"http://127.0.0.1:{port}/metrics")
            proxies.append(f"http://127.0.0.1:{port}")

        def agree(want: set[tuple[str, bool]]) -> None:
            until(lambda: all(_views(px) == {frozenset(want)} for px in proxies), 15,
                  lambda: f"both proxies' workers at {want}: {[_views(px) for px in proxies]}")
        agree({("p0", False), ("d0", False)})
        for px in proxies:
            complete(px, 2)
        assert served(p0) == 4 and served(d0) == 4
        _prefill(fk, "p1", p1, role_label="llm-d.ai/role")
        _decode(fk, "d1", d1)
        agree({("p0", False), ("d0", False), ("p1", False), ("d1", False)})
        # The admin API does not write to Kubernetes: it names the command; the annotation drains on both.
        d1_id = next(i["id"] for i in httpx.get(f"{proxies[0]}/admin/instances", headers=ADMIN, timeout=5).json()[
            "instances"] if i.get("instance_id") == "d1")
        r = httpx.post(f"{proxies[0]}/admin/instances/{d1_id}/drain", headers=ADMIN, timeout=5)
        assert r.status_code == 409 and "kubectl annotate pod d1 -n kvferry kvferry.io/drain=true" in r.text, r.text
        fk.annotate("d1", {"kvferry.io/drain": "true"})
        agree({("p0", False), ("d0", False), ("p1", False), ("d1", True)})
        fk.annotate("d1", {"kvferry.io/drain": "false"})
        fk.ready("d0", False)  # out of rotation: no new requests
        agree({("p0", False), ("d0", True), ("p1", False), ("d1", False)})
        before = served(d0)
        for px in proxies:
            complete(px, 4)
        assert served(d0) == before and served(p0) + served(p1) >= 12
        fk.delete("d0")
        fk.relabel("p1", {"app.kubernetes.io/part-of": "else", "llm-d.ai/role": "prefill"})
        agree({("p0", False), ("d1", False)})
        fk.lose("p0")  # no watch event says so: the list every 2 s does
        agree({("d1", False)})
        before = served(p0)
        for px in proxies:
            complete(px, 2)  # the decoder serves them whole
        assert served(p0) == before
        text = httpx.get(f"{proxies[0]}/metrics", timeout=5).text
        assert re.search(r'kvferry_proxy_discovery_healthy\{source="k8s"\} 1', text), text[-2000:]


def test_in_cluster_credentials_are_bounded_and_a_failed_reread_keeps_the_token(tmp_path, monkeypatch) -> None:
    """The ServiceAccount folder is a file from outside the process: an oversized token is refused
    at start; a token that cannot be read again later (mid-rotation) leaves the last one in use."""
    from kubernetes import client, config

    from kvferry.common.discovery import kube
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "token").write_text("x" * (kube.MAX_TOKEN_BYTES + 1))
    with pytest.raises(config.ConfigException, match="over"):
        kube.in_cluster(client.Configuration(), str(tmp_path))
    (tmp_path / "token").write_text("first\n")
    cfg = client.Configuration()
    kube.in_cluster(cfg, str(tmp_path))
    assert cfg.host == "https://[fd00::1]:6443" and cfg.api_key["BearerToken"] == "bearer first"
    monkeypatch.setattr(kube, "TOKEN_REREAD_S", 0.0)  # the next request re-reads the file
    (tmp_path / "token").unlink()
    cfg.refresh_api_key_hook(cfg)
    assert cfg.api_key["BearerToken"] == "bearer first"
    (tmp_path / "token").write_text("second")
    cfg.refresh_api_key_hook(cfg)
    assert cfg.api_key["BearerToken"] == "bearer second"
