"""`kvferry up`: a local xPyD cluster (N prefillers, M decoders, the proxy) in one command.

Picks free ports, writes each instance's LMCache-style config, splits the CPU cores (or GPUs)
between the instances, starts them and the proxy, shows progress while they load, and stops
everything, children first, on Ctrl-C or SIGTERM. Every child gets PR_SET_PDEATHSIG, so a
launcher that dies on its own leaves no orphan behind. The cluster gets a new cluster secret
(a file only its owner can read, named by every config: docs/security.md) unless one is given,
and a proxy beyond loopback gets a new admin key (`admin_key_file`: the proxy refuses to serve
its admin API beyond loopback without one), passed in its environment, never on its command line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvferry.common import secret
from kvferry.common.config import ConfigError, load_config
from kvferry.common.netutil import advertised, http_url, is_loopback, local_host, port_is_free
from kvferry.launcher import services
from kvferry.launcher.local_node import UpError, gpu_count, model_of
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.reaper import Reaper
from kvferry.launcher.restarts import Restarts
from kvferry.launcher.vllm_proc import (
    VLLMServer,
    die_with_parent,
    log_tail,
    signal_group,
    stop_group,
)

if TYPE_CHECKING:
    from kvferry.launcher.join import Registrar

STOP_SECONDS = 15.0
ADMIN_KEY_ENV = "KVFERRY_ADMIN_KEY"


def admin_key_file(log_dir: Path) -> Path:
    """A new admin key for the proxy, in `admin.key` beside cluster.secret, readable by its owner
    only. Only its path is ever printed or written to cluster.json."""
    path = log_dir / "admin.key"
    secret.write_file(str(path), secret.generate())
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prefillers", type=int, default=1)
    p.add_argument("--num-decoders", type=int, default=1)
    p.add_argument("--model", default=None, help="model path or name (default: the tiny test model)")
    p.add_argument("--port", type=int, default=9000, help="the proxy's port")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address every port binds: vLLM, receivers, the proxy (default 127.0.0.1; 0.0.0.0 or :: "
                        "for every interface)")
    p.add_argument("--advertise-host", default=None,
                   help="the address peers dial for those ports (default: --host; for 0.0.0.0 or ::, this "
                        "machine's address, logged)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every instance (GPU only)")
    p.add_argument("--pd-buffer-size", type=int, default=None, help="bytes of pd_buffer per instance")
    p.add_argument("--config", default=None, help="a kvferry/LMCache config file merged into every instance's")
    p.add_argument("--log-dir", default=None, help="where logs and configs go (default: a new temp folder)")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per instance (CPU)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the instances")
    p.add_argument("--remote", choices=["mooncake"], default=None,
                   help="start a store for every instance's remote tier: mooncake (a mooncake_master, "
                        "docs/mooncake.md)")
    p.add_argument("--cluster-secret-file", default=None,
                   help="the cluster secret for every port (default: a new one in the log folder)")
    p.add_argument("--policy", choices=("cache", "load", "round_robin"), default="cache",
                   help="the proxy's routing policy (docs/proxy.md \"Routing\")")
    p.add_argument("--discovery", default=None, metavar="etcd|etcd://HOST:PORT/PREFIX|file://PATH",
                   help="register the instances in discovery and have the proxy watch it (etcd: start a local "
                        "etcd); more proxies and `kvferry join` instances can then join (docs/deploy.md)")
    p.add_argument("--lease-ttl", type=int, default=5, help="with --discovery: seconds a killed instance stays "
                                                            "registered (default 5)")
    p.add_argument("--first-token", choices=("prefiller", "decoder"), default="prefiller",
                   help="who computes the answer's first token: the prefiller (sent at once) or the decoder "
                        "(docs/proxy.md \"First token\")")
    p.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="the decoder prefills a prompt itself when at most this many tokens are uncached there")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="trace every request (docs/observability.md \"Traces\"): the proxy, each vLLM "
                        "(--otlp-traces-endpoint) and the connector send spans to this OTLP collector (gRPC, e.g. "
                        "http://127.0.0.1:4317; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for http)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="an instance that dies is started again, with back-off, at most this many times (0: never)")
    p.add_argument("--vllm-args", default="", metavar="'FLAGS'",
                   help="more vLLM flags for every instance, as one shell-quoted string (e.g. "
                        "'--max-num-batched-tokens 8192 --dtype float32'); not the ones kvferry up sets itself")


# vLLM flags kvferry up sets for every instance: --vllm-args may not change them.
OWN_VLLM_FLAGS = ("--model", "--served-model-name", "--host", "--port", "--kv-transfer-config", "--kv-events-config",
                  "--tensor-parallel-size", "-tp", "--otlp-traces-endpoint")


def vllm_args(text: str) -> list[str]:
    """--vllm-args, split as a shell would; UpError for a flag kvferry up sets itself."""
    try:
        out = shlex.split(text)
    except ValueError as e:
        raise UpError(f"--vllm-args {text!r}: {e}: quote it as one shell string") from None
    for a in out:
        name = a.split("=", 1)[0]
        if name in OWN_VLLM_FLAGS:
            fix = {"--model": "--model", "--port": "--port", "--host": "--host", "--tensor-parallel-size": "--tp",
                   "-tp": "--tp", "--otlp-traces-endpoint": "--otlp-traces-endpoint"}.get(name)
            raise UpError(f"--vllm-args: {name} is set by kvferry up itself" +
                          (f": use kvferry up's {fix}" if fix else ""))
    return out


def plan(args: argparse.Namespace) -> dict:
    """Check everything that can be checked before anything starts."""
    if args.num_prefillers < 1 or args.num_decoders < 1:
        raise UpError("--num-prefillers and --num-decoders must each be at least 1")
    if importlib.util.find_spec("vllm") is None:
        raise UpError("vLLM is not installed: pip install 'kvferry[cpu]' on a CPU host (vLLM's CPU build, after "
                      "torch==2.13.0) or 'kvferry[cuda]' on a GPU host")
    if not port_is_free(args.port, local_host(args.host)):
        raise UpError(f"--port {args.port}: the port is in use; pick another (--port N)")
    if getattr(args, "discovery", None) is not None:
        if args.discovery == "etcd":
            if services.etcd_binary() is None:
                raise UpError("--discovery etcd: etcd not found: apt-get install etcd-server (`make etcd`), or "
                              "give a running one: --discovery etcd://HOST:PORT/PREFIX")
        else:
            from kvferry.common.discovery.sources import DiscoveryError, check_registrable, parse_target
            try:
                check_registrable(parse_target(args.discovery), "kvferry up")
            except DiscoveryError as e:
                raise UpError(str(e)) from None
        if args.lease_ttl < 2:
            raise UpError(f"--lease-ttl {args.lease_ttl}: at least 2 seconds")
    vllm_args(getattr(args, "vllm_args", "") or "")
    if args.local_prefill_tokens < 0:
        raise UpError(f"--local-prefill-tokens must be 0 or more, got {args.local_prefill_tokens}")
    keys: dict = {}
    if args.config:
        if not Path(args.config).is_file():
            raise UpError(f"--config {args.config}: no such file")
        try:
            cfg = load_config(path=args.config, env={})
        except ConfigError as e:
            raise UpError(f"--config {args.config}: {e}") from None
        if args.remote and cfg.remote_url:
            raise UpError(f"--remote {args.remote} and remote_url in --config {args.config}: keep one")
        keys = {k: getattr(cfg, k) for k in ("pd_buffer_size", "pd_buffer_device", "chunk_size", "pd_chunk_format",
                                             "pd_handshake_timeout", "pd_alloc_timeout", "pd_lease_seconds",
                                             "pd_kv_ready_timeout", "pd_kv_timeout_action")
                if getattr(cfg, k) is not None}
    if args.remote == "mooncake" and services.mooncake_master_binary() is None:
        raise UpError("--remote mooncake: mooncake_master not found: pip install 'kvferry[cpu]' (or 'kvferry[cuda]')")
    if args.cluster_secret_file is not None:
        try:
            secret.from_file(args.cluster_secret_file, "--cluster-secret-file")
        except secret.SecretError as e:
            raise UpError(str(e)) from None
    if args.pd_buffer_size is not None:
        if args.pd_buffer_size <= 0:
            raise UpError(f"--pd-buffer-size must be a positive number of bytes, got {args.pd_buffer_size}")
        keys["pd_buffer_size"] = args.pd_buffer_size
    model, served, max_len = model_of(args.model)
    n = args.num_prefillers + args.num_decoders
    gpus = gpu_count()
    if gpus:
        need = n * args.tp
        if need > gpus:
            raise UpError(f"{args.num_prefillers} prefillers + {args.num_decoders} decoders with --tp {args.tp} need "
                          f"{need} GPUs; this machine has {gpus}")
        placement = [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(str(i * args.tp + j) for j in range(args.tp))}}
                     for i in range(n)]
        keys.setdefault("pd_buffer_device", "cuda")
        cores: list[str | None] = [None] * n
    else:
        if args.tp != 1:
            raise UpError("--tp > 1 needs GPUs; none found (nvidia-smi)")
        avail = sorted(os.sched_getaffinity(0))
        per = max(1, len(avail) // n)
        # Each instance its own cores where there are enough; otherwise they take turns on them.
        cores = [",".join(str(c) for c in (avail[i * per:(i + 1) * per] if len(avail) >= n
                                            else [avail[i % len(avail)]])) for i in range(n)]
        placement = [{"kv_cache_gb": args.kv_cache_gb} for _ in range(n)]
    return {"model": model, "served": served, "max_len": max_len, "keys": keys, "cores": cores,
            "placement": placement, "gpus": gpus}


class Cluster:
    def __init__(self, args: argparse.Namespace, p: dict) -> None:
        self.args, self.p = args, p
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-up-")).resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.instances: list[Prefiller | Decoder] = []
        self.proxy: subprocess.Popen | None = None
        self.proxy_log = self.log_dir / "proxy.log"
        self.stopping = threading.Event()
        self.restarts: dict[int, int] = {}  # id(instance) -> times started again (restarts.py)
        self.reaper = Reaper()  # stops what is left if this process dies unstopped (launcher/reaper.py)
        self.secret_file = args.cluster_secret_file
        if self.secret_file is None:  # a new secret per cluster, readable by its owner only
            self.secret_file = str(self.log_dir / "cluster.secret")
            secret.write_file(self.secret_file, secret.generate())
        keys = {**p["keys"], "cluster_secret_file": str(Path(self.secret_file).resolve())}
        # The proxy's admin API beyond loopback needs a key: a new one unless the environment gives it.
        self.admin_key_file: Path | None = None
        if not is_loopback(args.host) and not os.environ.get(ADMIN_KEY_ENV):
            self.admin_key_file = admin_key_file(self.log_dir)
        self.store: services.MooncakeMaster | None = None
        self.etcd: services.Proc | None = None
        self.registrar: Registrar | None = None  # with --discovery
        self.discovery: str | None = getattr(args, "discovery", None)
        if self.discovery == "etcd":  # a local one-member etcd for this cluster
            self.etcd = services.start_etcd(self.log_dir)
            self.discovery = f"etcd://127.0.0.1:{self.etcd.port}/kvferry"
        if args.remote == "mooncake":  # prefillers share computed prompts through it
            self.store = services.MooncakeMaster(self.log_dir)
            keys.update(remote_url=self.store.url, extra_config=self.store.extra_config())
        n = args.num_prefillers + args.num_decoders
        self.kv_events: list[tuple[str, str]] = []  # each instance's event publisher and replay socket
        for i in range(n):
            if i < args.num_prefillers:
                inst: Prefiller | Decoder = Prefiller(p["model"], self.log_dir, p["cores"][i], self.log_dir,
                                             server=self._server_kw(i), **keys)
            else:
                inst = Decoder(p["model"], self.log_dir, p["cores"][i], self.log_dir, server=self._server_kw(i),
                               host=args.host, advertise_host=args.advertise_host, **keys)
            self.instances.append(inst)

    def _server_kw(self, i: int) -> dict:
        kw = dict(self.p["placement"][i])
        kw.update(served_name=self.p["served"], max_model_len=self.p["max_len"], die_with_parent=True,
                  host=self.args.host, advertise_host=self.args.advertise_host)
        extra = ["--tensor-parallel-size", str(self.args.tp)] if self.args.tp > 1 else []
        # KV cache events for the proxy's cache-aware routing, on Unix sockets in the (private) log
        # folder: they carry prompts' token ids. vLLM binds an ipc:// endpoint (a tcp one only with
        # "*"), so any number of proxies can subscribe. Cached-token counts in usage let the proxy
        # check its predictions.
        pub, replay = (f"ipc://{self.log_dir}/kv-events-{i}{s}.sock" for s in ("", "-replay"))
        self.kv_events.append((pub, replay))
        extra += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                    "endpoint": pub, "replay_endpoint": replay}),
                  "--enable-prompt-tokens-details"]
        if self.args.otlp_traces_endpoint:  # vLLM's spans; the connector's follow (vLLM sets the env for its processes)
            extra += ["--otlp-traces-endpoint", self.args.otlp_traces_endpoint]
            role = "prefiller" if i < self.args.num_prefillers else "decoder"
            n = i if i < self.args.num_prefillers else i - self.args.num_prefillers
            kw["env"] = {**kw.get("env", {}), "OTEL_SERVICE_NAME": f"vllm-{role}-{n}"}
        kw["extra_args"] = extra + vllm_args(self.args.vllm_args)
        return kw

    def start(self) -> None:
        for s in self.instances:
            s.start()
            self.started(s)
        t0 = time.monotonic()
        last = t0
        waiting = list(self.instances)
        while waiting:
            if self.stopping.is_set():
                raise KeyboardInterrupt
            for s in list(waiting):
                assert s.proc is not None  # started above
                if s.proc.poll() is not None:
                    raise UpError(f"{self.name(s)} exited with {s.proc.returncode} while starting; the end of its "
                                  f"log ({s.log_path}):\n{log_tail(s.log_path)}")
                if s.healthy(timeout=1):
                    waiting.remove(s)
                    print(f"  {self.name(s)} ready on {s.url} ({time.monotonic() - t0:.0f}s)", flush=True)
            if time.monotonic() - t0 > self.args.ready_timeout:
                raise UpError(f"not ready after {self.args.ready_timeout:.0f}s: "
                              + ", ".join(f"{self.name(s)} (log {s.log_path})" for s in waiting))
            if waiting and time.monotonic() - last >= 10:
                print(f"  loading ({time.monotonic() - t0:.0f}s): waiting for "
                      + ", ".join(self.name(s) for s in waiting), flush=True)
                last = time.monotonic()
            if waiting:
                self.stopping.wait(0.5)
        args = [sys.executable, "-m", "kvferry.proxy", "--host", self.args.host, "--port", str(self.args.port),
                "--cluster-secret-file", self.secret_file, "--policy", self.args.policy,
                "--local-prefill-tokens", str(self.args.local_prefill_tokens),
                "--first-token", self.args.first_token]
        if self.args.otlp_traces_endpoint:
            args += ["--otlp-traces-endpoint", self.args.otlp_traces_endpoint]
        if (Path(self.p["model"]) / "tokenizer.json").is_file():  # else text prompts are routed by load
            args += ["--tokenizer", self.p["model"]]
        if self.discovery is not None:
            self._register()
            args += ["--discovery", self.discovery]
        for s, (pub, replay) in zip(self.instances, self.kv_events, strict=True):
            if self.discovery is not None:
                break  # the proxy finds them in discovery
            if isinstance(s, Prefiller):
                args += ["--prefiller", s.url]
            else:
                args += ["--decoder", f"{s.url},{s.init_port},{s.alloc_port},{s.receiver_host}"]
            args += ["--kv-events", f"{s.url}={pub},{replay}"]
        env = dict(os.environ)
        if self.admin_key_file is not None:  # in the environment: a command line is readable by every user
            env[ADMIN_KEY_ENV] = self.admin_key_file.read_text().strip()
        log = open(self.proxy_log, "ab")
        self.proxy = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent, env=env)
        self.reaper.track(self.proxy)
        log.close()
        deadline = time.monotonic() + 30
        while True:
            if self.proxy.poll() is not None:
                raise UpError(f"the proxy exited with {self.proxy.returncode}; its log ({self.proxy_log}):\n"
                              f"{log_tail(self.proxy_log)}")
            try:
                with urllib.request.urlopen(f"{self.local_proxy_url}/health", timeout=2) as r:
                    # "ok": both roles routed (a proxy that knows only decoders answers 200 "degraded")
                    if r.status == 200 and json.loads(r.read()).get("status") == "ok":
                        break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise UpError(f"the proxy did not become healthy; its log ({self.proxy_log}):\n"
                              f"{log_tail(self.proxy_log)}")
            time.sleep(0.2)

    def _register(self) -> None:
        """Every instance into discovery, kept there while its /health passes (launcher/join.py)."""
        from kvferry.common.discovery import sources as disc
        from kvferry.common.wire import messages as m
        from kvferry.launcher.join import JoinedInstance, Registrar, version
        assert self.discovery is not None  # only called with --discovery
        target = disc.parse_target(self.discovery)
        members = []
        for i, (s, (pub, replay)) in enumerate(zip(self.instances, self.kv_events, strict=True)):
            role = "prefiller" if isinstance(s, Prefiller) else "decoder"
            ports: dict[str, Any] = {"receiver_host": s.receiver_host, "init_ports": [s.init_port],
                                     "alloc_ports": [s.alloc_port]} if isinstance(s, Decoder) else {}
            rec = m.InstanceRecord(instance_id=f"up-{os.getpid()}-{role}-{i}", role=role, model=self.p["served"],
                                   url=s.url, kv_events=[pub, replay],
                                   fingerprint=disc.fingerprint(self.p["served"]), tp_size=self.args.tp,
                                   kvferry_version=version(), **ports)
            members.append(JoinedInstance(rec, f"{s.url}/health"))
        registrar = Registrar(target, secret.from_file(self.secret_file, "cluster secret"), self.args.lease_ttl)
        registrar.start_thread(members)
        self.registrar = registrar

    def write_state(self) -> Path:
        """`cluster.json` in the log folder: every process, URL and port (for scripts and tests)."""
        inst = []
        for s, ev in zip(self.instances, self.kv_events, strict=True):
            d = {"name": self.name(s), "kv_events": list(ev),
                 "role": "prefiller" if isinstance(s, Prefiller) else "decoder", "url": s.url,
                 "port": s.port, "pid": s.proc.pid if s.proc else None, "log": str(s.log_path),
                 "config": str(s.config_path)}
            if isinstance(s, Decoder):
                d.update(init_port=s.init_port, alloc_port=s.alloc_port)
            d["restarts"] = self.restarts.get(id(s), 0)
            inst.append(d)
        state = {"proxy": {"url": self.proxy_url, "port": self.args.port,
                           "pid": self.proxy.pid if self.proxy else None, "log": str(self.proxy_log)},
                 "launcher_pid": os.getpid(), "instances": inst, "discovery": self.discovery,
                 "cluster_secret_file": str(Path(self.secret_file).resolve()),  # the path only, never the secret
                 "admin_key_file": None if self.admin_key_file is None else str(self.admin_key_file)}
        path = self.log_dir / "cluster.json"
        path.write_text(json.dumps(state, indent=2))
        return path

    @property
    def proxy_url(self) -> str:
        """The proxy as clients dial it (its advertised address)."""
        return http_url(advertised(self.args.host, self.args.advertise_host, "the proxy (--host)"), self.args.port)

    @property
    def local_proxy_url(self) -> str:
        """The proxy from this machine (loopback when it binds every interface)."""
        return http_url(self.args.host, self.args.port)

    def name(self, s: Prefiller | Decoder) -> str:
        kind = [x for x in self.instances if type(x) is type(s)]
        return f"{'prefiller' if isinstance(s, Prefiller) else 'decoder'} {kind.index(s)}"

    def banner(self) -> str:
        url = self.proxy_url
        lines = [f"kvferry is up: {self.args.num_prefillers} prefiller(s), {self.args.num_decoders} decoder(s), "
                 f"model {self.p['served']}",
                 f"  proxy        {url}    log {self.proxy_log}"]
        if self.admin_key_file is not None:
            lines.append(f"  admin key    {self.admin_key_file} (the proxy's /admin/*: -H \"Authorization: Bearer "
                         f"$(cat {self.admin_key_file})\")")
        if self.discovery is not None:
            lines += [f"  discovery    {self.discovery}; more instances and proxies:",
                      f"    kvferry join --discovery {self.discovery} --cluster-secret-file {self.secret_file} "
                      "--role decoder",
                      f"    kvferry-proxy --discovery {self.discovery} --cluster-secret-file {self.secret_file} "
                      "--port 9001"]
        if self.store is not None:
            lines.append(f"  store        {self.store.url}    log {self.store.log}")
        for s in self.instances:
            extra = f" (init {s.init_port}, alloc {s.alloc_port})" if isinstance(s, Decoder) else ""
            lines.append(f"  {self.name(s):<12} {s.url}{extra}    log {s.log_path}")
        lines += ["try:",
                  f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' -d "
                  f"'{{\"model\": \"{self.p['served']}\", \"prompt\": \"Tell me a story\", \"max_tokens\": 32}}'",
                  f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
                  f"'{{\"model\": \"{self.p['served']}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                  f"\"Hello\"}}], \"max_tokens\": 32}}'",
                  "Ctrl-C stops everything."]
        return "\n".join(lines)

    def started(self, s: VLLMServer) -> None:
        assert s.proc is not None  # called once it started
        self.reaper.track(s.proc)

    def stopped(self, pid: int) -> None:
        self.reaper.forget(pid)

    def watch(self) -> None:
        """Until told to stop: start instances that die again (launcher/restarts.py); the proxy
        routes around a dead one and takes it back once its health checks pass."""
        keeper = Restarts(self, self.args.max_restarts)
        while not self.stopping.wait(0.5):
            keeper.tick()
            if self.proxy is not None and self.proxy.poll() is not None:
                print(f"kvferry: the proxy exited with {self.proxy.returncode}; stopping. Log: {self.proxy_log}",
                      file=sys.stderr, flush=True)
                return

    def stop(self) -> None:
        """Every process group told at once (proxy first), all gone within STOP_SECONDS."""
        deadline = time.monotonic() + STOP_SECONDS - 3
        if self.registrar is not None:
            self.registrar.stop(timeout=5)  # withdrawn first: no proxy sends them anything new
        if self.proxy is not None:
            signal_group(self.proxy, signal.SIGTERM)
        for s in self.instances:
            if s.proc is not None:
                signal_group(s.proc, signal.SIGTERM)
        if self.proxy is not None:
            stop_group(self.proxy, deadline - time.monotonic())
        for s in self.instances:
            s.stop(timeout=deadline - time.monotonic())  # waits on what is still running, then kills
        if self.store is not None:
            self.store.stop(timeout=max(1.0, deadline - time.monotonic()))
        if self.etcd is not None:
            self.etcd.stop(timeout=5)
        self.reaper.close()


def run(args: argparse.Namespace) -> int:
    try:
        p = plan(args)
    except UpError as e:
        print(f"kvferry up: error: {e}", file=sys.stderr)
        return 2
    cluster = Cluster(args, p)

    def on_signal(signum, frame) -> None:
        cluster.stopping.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting {args.num_prefillers} prefiller(s) and {args.num_decoders} decoder(s); logs in "
          f"{cluster.log_dir}", flush=True)
    try:
        cluster.start()
        if cluster.stopping.is_set():
            return 0
        cluster.write_state()
        print(cluster.banner(), flush=True)
        cluster.watch()
        return 0
    except UpError as e:
        print(f"kvferry up: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping ...", flush=True)
        cluster.stop()
        print("stopped", flush=True)
