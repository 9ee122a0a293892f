"""`kvferry join`: one instance on this machine, joined to a cluster through discovery.

The sidecar starts vLLM with KVFerryConnector (or, with ``--attach URL``, watches a server that
something else started), waits until its ``/health`` passes, then registers it (etcd with a lease,
or a discovery file) and keeps the lease alive. It withdraws the entry when the server stops
answering ``/health`` (and registers again when it answers again), when vLLM exits, and on
SIGTERM/SIGINT; if the sidecar itself is killed, the lease ends after ``--lease-ttl`` seconds and
every proxy drops the instance. docs/deploy.md "Discovery" says why a sidecar and not the connector.

:class:`Registrar` is the same logic for many instances at once (``kvferry up --discovery``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvferry.common import secret as cluster_secret
from kvferry.common.discovery import sources as disc
from kvferry.common.discovery.etcd import EtcdAccessError, EtcdError
from kvferry.common.errors import ConfigurationError
from kvferry.common.http.client import Broken, Pool, Unreachable
from kvferry.common.log import get_logger
from kvferry.common.netutil import advertised, is_loopback
from kvferry.common.wire import messages as m

logger = get_logger(__name__)

FAILS_TO_WITHDRAW = 2  # consecutive failed /health checks
HEALTH_TIMEOUT_S = 2.0
MAX_HEALTH_BODY = 1 << 16  # vLLM's /health answers an empty body


def version() -> str:
    try:
        return importlib.metadata.version("kvferry")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class JoinedInstance:
    """One instance to keep registered while `health_url` answers 200."""

    record: m.InstanceRecord
    health_url: str


class Registrar:
    """Keeps members registered while they are healthy (a checks-and-lease beat every
    `interval` seconds); `stop` withdraws them all."""

    def __init__(self, target: disc.Target, secret: cluster_secret.ClusterSecret | None, ttl: int,
                 interval: float = 1.0) -> None:
        self.target, self.secret, self.ttl, self.interval = target, secret, ttl, min(interval, ttl / 3)
        self.registered: dict[str, bool] = {}

    async def _health(self, pool: Pool, url: str) -> bool:
        """GET `url` answers 200 within HEALTH_TIMEOUT_S (its body bounded, read so that the
        connection is kept for the next check)."""
        u = urlsplit(url)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                r = await pool.request("GET", f"{u.scheme}://{u.netloc}", path)
                try:
                    await r.read(MAX_HEALTH_BODY)
                finally:
                    r.release()
        except (TimeoutError, Unreachable, Broken):
            return False
        return r.status == 200

    async def keep(self, member: JoinedInstance, stop: asyncio.Event) -> None:
        """Until `stop`: register once healthy, renew, withdraw after FAILS_TO_WITHDRAW failed checks."""
        reg = disc.Registration(self.target, member.record, self.secret, self.ttl)
        iid = member.record.instance_id
        fails, registered, warned = 0, False, False
        beat: tuple[asyncio.Event, asyncio.Future[None]] | None = None  # set while registered
        # The library's one HTTP client: one kept connection per member for its checks.
        checks = Pool(1, HEALTH_TIMEOUT_S, HEALTH_TIMEOUT_S, HEALTH_TIMEOUT_S, {})
        try:
            try:
                while not stop.is_set():
                    ok = await self._health(checks, member.health_url)
                    fails = 0 if ok else fails + 1
                    try:
                        if ok and not registered:
                            await reg.register()
                            registered = True
                            beat_stop = asyncio.Event()
                            beat = (beat_stop, asyncio.ensure_future(reg.keep_alive(beat_stop)))
                            logger.info("discovery: %s registered in %s (%s, lease %ds)", iid, self.target,
                                        member.record.url, self.ttl)
                        elif registered and fails >= FAILS_TO_WITHDRAW:
                            assert beat is not None
                            beat[0].set()
                            await beat[1]
                            await reg.withdraw()
                            registered = False
                            logger.warning("discovery: %s withdrawn: %s does not answer /health", iid,
                                           member.health_url)
                        warned = False
                    except (EtcdError, disc.DiscoveryError, OSError) as e:
                        if not warned:  # once per outage
                            logger.warning("discovery: %s: %s; trying again every %gs", iid, e, self.interval)
                        warned = True
                    self.registered[iid] = registered
                    try:
                        await asyncio.wait_for(stop.wait(), self.interval)
                    except TimeoutError:
                        pass
            finally:
                if beat is not None:
                    beat[0].set()
                    await asyncio.gather(beat[1], return_exceptions=True)
                if registered:
                    await reg.withdraw()
                    logger.info("discovery: %s withdrawn", iid)
                self.registered[iid] = False
                await reg.close()
        finally:
            await checks.close()

    def start_thread(self, members: list[JoinedInstance]) -> threading.Thread:
        """Keep `members` registered from a thread of its own (the launcher is not async); `stop()` ends it."""
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()

        async def main() -> None:
            await asyncio.gather(*(self.keep(mb, self._stop) for mb in members))

        def body() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(main())
            self._loop.close()
        self._thread = threading.Thread(target=body, name="kvferry-registrar", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 10.0) -> None:
        if getattr(self, "_thread", None) is None:
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--discovery", required=True, metavar="etcd://HOST:PORT/PREFIX|file://PATH",
                   help="where the cluster's proxies look for instances; etcds:// for TLS, and ?cacert=&cert=&key= "
                        "(a client certificate), ?user=&password_file= (an etcd user) for etcd's own security "
                        "(docs/deploy.md)")
    p.add_argument("--role", required=True, choices=("prefiller", "decoder"))
    p.add_argument("--model", default=None, help="model path or name (default: the tiny test model)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model, or "
                                                             "'tiny' for the tiny model)")
    p.add_argument("--port", type=int, default=None, help="vLLM's port (default: a free one)")
    p.add_argument("--bind-host", default="127.0.0.1", help="address vLLM and the receiver listen on "
                                                            "(0.0.0.0: every interface)")
    p.add_argument("--advertise-host", default=None, help="address proxies and prefillers reach this machine at "
                                                          "(default: --bind-host; for 0.0.0.0 or ::, this machine's "
                                                          "address: its host name's first address that is not "
                                                          "loopback, else the default route's source address)")
    p.add_argument("--instance-id", default=None, help="its name in discovery (default ROLE-HOST-PORT)")
    p.add_argument("--lease-ttl", type=int, default=disc.DEFAULT_TTL_S,
                   help=f"seconds a killed instance stays registered (default {disc.DEFAULT_TTL_S})")
    p.add_argument("--config", default=None, help="a kvferry/LMCache config file merged into the instance's")
    p.add_argument("--cluster-secret-file", default=None,
                   help="the cluster secret (signs the registration; else env KVFERRY_CLUSTER_SECRET[_FILE])")
    p.add_argument("--insecure-discovery", action="store_true",
                   help="register beyond loopback without a cluster secret (proxies ignore such entries unless "
                        "they are told --insecure-discovery too)")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype (part of the layout fingerprint)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (CPU)")
    p.add_argument("--log-dir", default=None, help="logs and the instance's config (default: a new temp folder)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for vLLM's /health")
    p.add_argument("--attach", default=None, metavar="URL",
                   help="start nothing: register the server already running at URL (for a decoder, with "
                        "--init-ports and --alloc-ports)")
    p.add_argument("--init-ports", default=None, help="with --attach, a decoder's receiver init ports (a,b,...)")
    p.add_argument("--alloc-ports", default=None, help="with --attach, a decoder's receiver alloc ports")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT[,REPLAY]",
                   help="with --attach, the server's KV event publisher as proxies reach it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="-- VLLM_ARGS",
                   help="after --: more arguments for vLLM (e.g. -- --gpu-memory-utilization 0.8)")


class JoinError(ConfigurationError, ValueError):
    """A flag or setting `kvferry join` cannot use; the message names the fix."""


def _ports(flag: str, raw: str | None) -> list[int]:
    try:
        ports = [int(x) for x in (raw or "").split(",") if x.strip()]
    except ValueError:
        raise JoinError(f"{flag}: expected comma-separated port numbers, got {raw!r}") from None
    if any(not 0 < p < 65536 for p in ports):
        raise JoinError(f"{flag}: {raw!r} holds a number that is not a port")
    return ports


def _secret(args: argparse.Namespace, target: disc.Target, advertise: str) -> cluster_secret.ClusterSecret | None:
    try:
        secret = cluster_secret.from_env(args.cluster_secret_file)
    except cluster_secret.SecretError as e:
        raise JoinError(str(e)) from None
    if secret is None and not args.insecure_discovery:
        beyond = [h for h in (target.host, advertise) if h and not is_loopback(h)]
        if beyond:
            raise JoinError(f"{beyond[0]} is beyond loopback and there is no cluster secret: proxies trust an entry "
                            "only when it is signed with it. Give --cluster-secret-file (or KVFERRY_CLUSTER_SECRET"
                            "_FILE), or --insecure-discovery")
    return secret


async def _serve(args: argparse.Namespace, target: disc.Target, members: JoinedInstance,
                 secret: cluster_secret.ClusterSecret | None, proc_alive) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reg = Registrar(target, secret, args.lease_ttl)
    keeper = asyncio.ensure_future(reg.keep(members, stop))
    code = 0
    while not stop.is_set():
        code = proc_alive()
        if code is not None:
            print(f"kvferry join: the server exited with {code}; withdrawing", file=sys.stderr, flush=True)
            stop.set()
            break
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass
    await keeper
    return code or 0


def run(args: argparse.Namespace) -> int:
    try:
        target = disc.parse_target(args.discovery)
        disc.check_registrable(target, "kvferry join")
        if args.lease_ttl < 2:
            raise JoinError(f"--lease-ttl {args.lease_ttl}: at least 2 seconds")
        advertise = advertised(args.bind_host, args.advertise_host, "kvferry join (--bind-host)")
        secret = _secret(args, target, advertise)
        if target.scheme == "etcd":
            asyncio.run(disc.check_access(target))
    except (JoinError, disc.DiscoveryError, EtcdAccessError) as e:
        print(f"kvferry join: error: {e}", file=sys.stderr)
        return 2
    except EtcdError as e:  # not there yet: the registrar tries again every second
        print(f"kvferry join: {e}; registering once it answers", file=sys.stderr, flush=True)
    hostport = f"[{advertise}]" if ":" in advertise else advertise
    if args.attach:
        if args.vllm_args:
            print("kvferry join: error: --attach starts nothing: vLLM arguments after -- do not apply",
                  file=sys.stderr)
            return 2
        return _attach(args, target, secret, advertise)
    from kvferry.launcher.local_node import UpError, model_of
    from kvferry.launcher.pd_instances import Decoder, Prefiller
    try:
        model, served, max_len = model_of(args.model)
    except UpError as e:
        print(f"kvferry join: error: {e}", file=sys.stderr)
        return 2
    served = args.served_model_name or served
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-join-")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    keys: dict = {}
    if args.config:
        from kvferry.common.config import ConfigError, load_config
        try:
            cfg = load_config(path=args.config, env={})
        except ConfigError as e:
            print(f"kvferry join: error: --config {args.config}: {e}", file=sys.stderr)
            return 2
        keys = {k: v for k, v in vars(cfg).items() if v is not None and k in ("pd_buffer_size", "pd_buffer_device",
                                                                              "chunk_size", "pd_chunk_format")}
    if args.cluster_secret_file:
        keys["cluster_secret_file"] = str(Path(args.cluster_secret_file).resolve())
    from kvferry.common.netutil import free_port
    port = args.port or free_port()
    extra = ["--dtype", args.dtype]
    if args.bind_host != "127.0.0.1":
        extra += ["--host", args.bind_host]  # vLLM takes the last --host
    if args.tp > 1:
        extra += ["--tensor-parallel-size", str(args.tp)]
    from kvferry.launcher.local_node import gpu_count
    if gpu_count():
        keys.setdefault("pd_buffer_device", "cuda")
    pub, replay = (f"ipc://{log_dir}/kv-events-{port}{s}.sock" for s in ("", "-replay"))
    if is_loopback(advertise):  # tcp events beyond loopback wait for authenticated KV events (docs/deploy.md)
        import json
        extra += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                    "endpoint": pub, "replay_endpoint": replay}),
                  "--enable-prompt-tokens-details"]
    rest = list(args.vllm_args or [])
    extra += rest[1:] if rest[:1] == ["--"] else rest
    server = {"served_name": served, "max_model_len": max_len, "kv_cache_gb": args.kv_cache_gb,
              "die_with_parent": True, "extra_args": extra}
    inst: Prefiller | Decoder
    if args.role == "prefiller":
        inst = Prefiller(model, log_dir, None, log_dir, port=port, server=server, **keys)
        ports: dict = {}
    else:
        inst = Decoder(model, log_dir, None, log_dir, port=port, host=args.bind_host, server=server, **keys)
        ports = {"receiver_host": advertise, "init_ports": [inst.init_port], "alloc_ports": [inst.alloc_port]}
    rec = m.InstanceRecord(instance_id=args.instance_id or f"{args.role}-{socket.gethostname()}-{port}",
                           role=args.role, model=served, url=f"http://{hostport}:{port}",
                           kv_events=[pub, replay] if is_loopback(advertise) else [],
                           fingerprint=disc.fingerprint(served, args.dtype), tp_size=args.tp,
                           kvferry_version=version(), **ports)
    print(f"kvferry join: starting the {args.role} {rec.instance_id} on port {port}; log {inst.log_path}",
          flush=True)
    inst.start()
    try:
        return asyncio.run(_serve(args, target, JoinedInstance(rec, _local_health(args.bind_host, port)), secret,
                                  lambda: inst.proc.poll() if inst.proc else 0))
    finally:
        inst.stop()


def _local_health(bind_host: str, port: int) -> str:
    """vLLM's /health as this machine reaches it: the bind address (loopback for a wildcard)."""
    host = "127.0.0.1" if bind_host in ("0.0.0.0", "") else "::1" if bind_host == "::" else bind_host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/health"


def _attach(args: argparse.Namespace, target: disc.Target, secret, advertise: str) -> int:
    from kvferry.proxy.instance_flags import OptionError, parse_url
    try:
        url = parse_url("--attach", args.attach)
        init, alloc = _ports("--init-ports", args.init_ports), _ports("--alloc-ports", args.alloc_ports)
        if args.role == "decoder" and (not init or len(init) != len(alloc)):
            raise JoinError("--attach with --role decoder needs --init-ports and --alloc-ports, as many of each "
                            "(one per TP rank)")
        ev = [e.strip() for e in (args.kv_events or "").split(",") if e.strip()]
        if len(ev) > 2 or not all(e.startswith(("tcp://", "ipc://")) for e in ev):
            raise JoinError(f"--kv-events: expected ENDPOINT[,REPLAY] (tcp:// or ipc://), got {args.kv_events!r}")
    except (JoinError, OptionError) as e:
        print(f"kvferry join: error: {e}", file=sys.stderr)
        return 2
    served = args.served_model_name or args.model or "tiny"
    rec = m.InstanceRecord(instance_id=args.instance_id or f"{args.role}-{url.split('://', 1)[1]}",
                           role=args.role, model=served, url=url, receiver_host=args.advertise_host or "",
                           init_ports=init, alloc_ports=alloc, kv_events=ev,
                           fingerprint=disc.fingerprint(served, args.dtype), tp_size=args.tp,
                           kvferry_version=version())
    return asyncio.run(_serve(args, target, JoinedInstance(rec, f"{url}/health"), secret, lambda: None))
