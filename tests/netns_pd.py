"""A disaggregated kvferry cluster spread over network namespaces (tests/netns.py): vLLM servers and
proxies each in a namespace of their own, listening on that namespace's address, with NIXL's bytes
on TCP over the veths (`UCX_TLS=tcp`). Used by tests/e2e/test_netns_vllm.py and
benchmarks/netns_bench.py.

A server's `url` is its namespace's own address (what the test process reads /metrics from);
`advertised(...)` is where the other instances reach it: the same, or with `delayed=True` its
namespace's delay address, where a `tests/delay_relay.py` process forwards each of its ports after
the relay's delay."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvferry.common.netutil import free_port
from kvferry.launcher.pd_instances import Decoder
from kvferry.launcher.vllm_proc import VLLMServer, die_with_parent
from tests.netns import NS_VETH, NetnsCluster
from tests.polling import TimedOut, answers, until

ADMIN_KEY = "netns-admin-key-0123456789"


def ns_env(secret: str) -> dict[str, str]:
    """What every kvferry process in a namespace runs with: the cluster secret, NIXL over TCP on the
    namespace's veth (between namespaces of one kernel UCX would otherwise move the bytes through
    shared memory, and they would cross no link), no Hub look-ups."""
    return {"KVFERRY_CLUSTER_SECRET": secret, "UCX_TLS": "tcp", "UCX_NET_DEVICES": NS_VETH,
            "HF_HUB_OFFLINE": "1"}


def place(server: VLLMServer, net: NetnsCluster, i: int) -> VLLMServer:
    """Make `server` (not started yet) run in namespace i on that namespace's address."""
    args = list(server.args)
    args[args.index("--host") + 1] = net.addr(i)
    server.args = net.wrap(i, args)
    server.url = f"http://{net.addr(i)}:{server.port}"
    server.ns = i  # type: ignore[attr-defined]
    return server


def ports(server: VLLMServer) -> list[int]:
    """Every TCP port other instances open to `server` (HTTP, and a decoder's receiver ports)."""
    out = [server.port]
    if isinstance(server, Decoder):
        out += [server.init_port, server.alloc_port]
    return out


def host_of(net: NetnsCluster, i: int, delayed: bool) -> str:
    return net.delay_addr(i) if delayed else net.addr(i)


def prefiller_url(net: NetnsCluster, p: VLLMServer, delayed: bool = False) -> str:
    return f"http://{host_of(net, p.ns, delayed)}:{p.port}"  # type: ignore[attr-defined]


def decoder_flag(net: NetnsCluster, d: Decoder, delayed: bool = False) -> str:
    """`--decoder URL,INIT,ALLOC` as a proxy reaches it (the prefiller dials the URL's host)."""
    return f"http://{host_of(net, d.ns, delayed)}:{d.port},{d.init_port},{d.alloc_port}"  # type: ignore[attr-defined]


class NsProxy:
    """kvferry-proxy in namespace i with static instance flags."""

    def __init__(self, net: NetnsCluster, i: int, log: Path, prefillers: Sequence[str], decoders: Sequence[str],
                 secret: str, extra: Sequence[str] = ()) -> None:
        self.net, self.ns, self.port = net, i, free_port()
        self.url = f"http://{net.addr(i)}:{self.port}"
        argv = [sys.executable, "-m", "kvferry.proxy", "--host", net.addr(i), "--port", str(self.port),
                "--health-interval", "0.5", "--admin-key", ADMIN_KEY, "--require-cluster-secret", *extra]
        for p in prefillers:
            argv += ["--prefiller", p]
        for d in decoders:
            argv += ["--decoder", d]
        import os
        env = {**os.environ, **ns_env(secret)}
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(net.wrap(i, argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        net.procs.append(self.proc)
        self.log = log

    def wait_ready(self, timeout: float = 60) -> NsProxy:
        until(answers(self.url + "/health", self.proc, lambda: self.log.read_text()[-3000:]), timeout,
              lambda: f"proxy {self.url} to be healthy: {self.log.read_text()[-3000:]}", every=0.2)
        return self

    def instances(self) -> dict[str, dict]:
        """/health's instances by URL."""
        r = httpx.get(self.url + "/health", timeout=5)
        return {i["url"]: i for i in r.json()["instances"]}

    def add_decoder(self, flag: str) -> dict:
        url, init, alloc = flag.split(",")
        r = httpx.post(self.url + "/admin/instances", timeout=5, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                       json={"role": "decoder", "url": url, "init_port": int(init), "alloc_port": int(alloc)})
        assert r.status_code == 201, r.text
        return r.json()

    def complete(self, prompt: list[int], max_tokens: int, client: httpx.Client | None = None,
                 timeout: float = 120) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        r = (client or httpx).post(self.url + "/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, f"{self.url}: {r.status_code} {r.text}"
        return r.json()

    def kill(self) -> None:
        import os
        import signal
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        from kvferry.launcher.vllm_proc import stop_group
        if self.proc.poll() is None:
            stop_group(self.proc, 10)


def kv_bytes_per_token(model: Path) -> int:
    """Every layer's K and V of one token (bf16), as the KV crosses the link."""
    import json
    c = json.loads((model / "config.json").read_text())
    return c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2 * 2


def relay_pairs(net: NetnsCluster, i: int, tcp_ports: Sequence[int]) -> list[tuple[str, int, str, int]]:
    """delay_relay pairs: namespace i's ports on its delay address -> its own address."""
    return [(net.delay_addr(i), p, net.addr(i), p) for p in tcp_ports]


def metric(server: VLLMServer | NsJoin, name: str) -> float:
    """The sum of a metric's samples on the server's /metrics (0 when absent)."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def pages_all_free(d: VLLMServer | NsJoin, timeout: float = 30) -> bool:
    """The decoder's kvferry:pd_buffer_free_pages gauge equals its page count (bounded wait)."""
    def all_free() -> bool:
        total, free = metric(d, "kvferry:pd_buffer_pages"), metric(d, "kvferry:pd_buffer_free_pages")
        return total > 0 and free == total
    try:
        return until(all_free, timeout, every=0.5)
    except TimedOut:
        return False


def start_etcd_in(net: NetnsCluster, i: int, work: Path) -> tuple[subprocess.Popen, str]:
    """A one-member etcd in namespace i, its client port on the namespace's address (its peer port on
    the namespace's loopback); returns the process and `HOST:PORT`."""
    from kvferry.launcher.services import etcd_binary
    exe = etcd_binary()
    assert exe is not None, "etcd not installed: run `make etcd`"
    port, peer = free_port(), free_port()
    client, peer_url = f"http://{net.addr(i)}:{port}", f"http://127.0.0.1:{peer}"
    work.mkdir(parents=True, exist_ok=True)
    argv = [exe, "--name", "netns", "--data-dir", str(work / f"etcd-{port}"), "--listen-client-urls", client,
            "--advertise-client-urls", client, "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls",
            peer_url, "--initial-cluster", f"netns={peer_url}", "--logger", "zap", "--log-level", "warn"]
    with open(work / f"etcd-{port}.log", "ab") as out:
        proc = subprocess.Popen(net.wrap(i, argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
    net.procs.append(proc)
    until(answers(f"{client}/health", proc, lambda: (work / f"etcd-{port}.log").read_text()[-2000:]), 30,
          "etcd to answer /health", every=0.2)
    return proc, f"{net.addr(i)}:{port}"


def start_stub_in(net: NetnsCluster, i: int, log: Path) -> int:
    """kvferry's stub engine (testing/stub_engine.py) in namespace i; returns its port once it answers."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(net.wrap(i, [sys.executable, "-m", "kvferry.testing.stub_engine", "--host", net.addr(i),
                                             "--port", str(port)]),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
    net.procs.append(proc)
    until(answers(f"http://{net.addr(i)}:{port}/health", proc, lambda: log.read_text()[-2000:]), 30,
          f"the stub engine in namespace {i} to answer", every=0.1)
    return port


class NsJoin:
    """`kvferry join` in namespace i: one vLLM with the connector (the tiny model), listening on and
    advertising that namespace's address, registered in `discovery` with a `ttl`-second lease; with
    `attach_port`, the server already listening on that port of the namespace's address instead."""

    def __init__(self, net: NetnsCluster, i: int, discovery: str, role: str, log_dir: Path, secret: str,
                 cores: str, ttl: int, instance_id: str, attach_port: int | None = None) -> None:
        import os
        self.net, self.ns, self.role, self.instance_id = net, i, role, instance_id
        self.port = attach_port or free_port()
        self.url = f"http://{net.addr(i)}:{self.port}"
        self.log_dir = log_dir / f"join-{instance_id}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "kvferry.launcher", "join", "--discovery", discovery, "--role", role,
                "--port", str(self.port), "--bind-host", net.addr(i), "--advertise-host", net.addr(i),
                "--instance-id", instance_id, "--lease-ttl", str(ttl), "--log-dir", str(self.log_dir)]
        if attach_port:  # register a server already running there (a stub engine) instead of starting vLLM
            argv = [a for a in argv if a not in ("--port", str(self.port))]
            argv += ["--attach", self.url, "--model", "stub"]
            if role == "decoder":
                argv += ["--init-ports", str(free_port()), "--alloc-ports", str(free_port())]
        env = {**os.environ, **ns_env(secret), "VLLM_CPU_OMP_THREADS_BIND": cores}
        with open(self.log_dir / "join.log", "ab") as out:
            self.proc = subprocess.Popen(net.wrap(i, argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        net.procs.append(self.proc)

    def wait_ready(self, timeout: float = 400) -> NsJoin:
        until(answers(self.url + "/health", self.proc, lambda: f"kvferry join {self.instance_id}: "
                      + (self.log_dir / "join.log").read_text()[-3000:]), timeout,
              f"{self.instance_id} ({self.url}) to be healthy; logs in {self.log_dir}", every=0.5)
        return self

    def stop(self, timeout: float = 15) -> None:
        from kvferry.launcher.vllm_proc import stop_group
        if self.proc.poll() is None:
            stop_group(self.proc, timeout)
