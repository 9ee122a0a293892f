"""The stores and services tests and benchmarks start, as child processes on free ports:
redis-server and Redis Sentinels (from the OS: ``apt-get install redis-server``; ``make redis``
does it where apt is usable), kvferry-server (lm://) and kvferry-controller (P2P). Each is a
`kvferry.launcher.services.Proc`: ``.port``, ``.url_hostport``, ``.stop()``."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from kvferry.common.netutil import free_port
from kvferry.launcher.services import Proc, StoreStartError, wait_port


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _redis_exe() -> str:
    exe = redis_server_binary()
    if exe is None:
        raise StoreStartError("redis-server not found: install it (Debian/Ubuntu: apt-get install redis-server; "
                              "`make redis` does it)")
    return exe


@dataclass(frozen=True)
class ServerTLS:
    """A TLS Redis server's files: its certificate and key, and the CA whose clients it accepts
    (`check_clients`: only clients with a certificate that CA signed)."""

    cert: Path
    key: Path
    ca: Path
    check_clients: bool = True


def _secret_conf(path: Path, lines: list[str]) -> Path:
    """A redis.conf fragment for passwords, readable by its owner only (not on the command line,
    where `ps` shows it to every user)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(f"{line}\n" for line in lines))
    return path


def start_redis(work: Path, port: int | None = None, replicaof: int | None = None, maxmemory_mb: int = 512, *,
                password: str | None = None, users: dict[str, str] | None = None, masterauth: str | None = None,
                tls: ServerTLS | None = None, plain: bool = True) -> Proc:
    """A redis-server with no persistence, evicting least recently used keys past `maxmemory_mb`.

    `password` is the default user's (requirepass), `users` more ACL users (name: password, all
    commands and keys), `masterauth` what a replica tells its master (default: `password`). With
    `tls` it also listens for TLS on `proc.tls_port`; `plain=False` leaves only that port."""
    exe = _redis_exe()
    port = port or free_port()
    d = work / f"redis-{port}"
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"requirepass {password}"] if password else []
    lines += [f"user {name} on >{pw} ~* &* +@all" for name, pw in (users or {}).items()]
    if replicaof is not None and (masterauth or password):
        lines.append(f"masterauth {masterauth or password}")
    argv = [exe, str(_secret_conf(d / "auth.conf", lines)), "--port", str(port if plain else 0),
            "--bind", "127.0.0.1", "--dir", str(d), "--save", "", "--appendonly", "no",
            "--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"]
    if replicaof is not None:
        argv += ["--replicaof", "127.0.0.1", str(replicaof)]
    tls_port = None
    if tls is not None:
        tls_port = free_port()
        argv += ["--tls-port", str(tls_port), "--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key),
                 "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "yes" if tls.check_clients else "no"]
    first = port if plain else tls_port
    assert first is not None  # plain or TLS: one of the two ports listens
    proc = Proc(f"redis-server :{first}", argv, first, work / f"redis-{port}.log")
    proc.tls_port = tls_port
    if tls_port is not None and plain:
        wait_port(proc.proc, tls_port, proc.what, proc.log)
    return proc


def start_sentinel(work: Path, master_port: int, service: str = "mymaster", down_after_ms: int = 1000,
                   port: int | None = None, *, password: str | None = None, master_password: str | None = None,
                   master_user: str | None = None) -> Proc:
    """A Sentinel watching the master at `master_port` (quorum 1, fast failover for tests).

    `password` is the Sentinel's own (requirepass; Sentinels of one set share it, as they also use
    it with each other), `master_password` / `master_user` what it tells the master and replicas."""
    exe = _redis_exe()
    port = port or free_port()
    lines = [f"port {port}", "bind 127.0.0.1", "protected-mode no", f"dir {work}",
             f"sentinel monitor {service} 127.0.0.1 {master_port} 1",
             f"sentinel down-after-milliseconds {service} {down_after_ms}",
             f"sentinel failover-timeout {service} {max(3 * down_after_ms, 3000)}",
             f"sentinel parallel-syncs {service} 1"]
    if password:
        lines.append(f"requirepass {password}")
    if master_password:
        lines.append(f"sentinel auth-pass {service} {master_password}")
    if master_user:
        lines.append(f"sentinel auth-user {service} {master_user}")
    conf = _secret_conf(work / f"sentinel-{port}.conf", lines)
    return Proc(f"redis-sentinel :{port}", [exe, str(conf), "--sentinel"], port, work / f"sentinel-{port}.log")


def start_lm_server(work: Path, port: int | None = None, *extra: str, secret_file: str | Path | None = None) -> Proc:
    """kvferry-server (the lm:// store); with `secret_file`, clients must prove the cluster secret."""
    port = port or free_port()
    secret = ["--cluster-secret-file", str(secret_file)] if secret_file else []
    return Proc(f"kvferry-server :{port}", [sys.executable, "-m", "kvferry.launcher.lm_server", "127.0.0.1", str(port),
                                            "cpu", *secret, *extra], port, work / f"lm-server-{port}.log")


class ControllerProcess(Proc):
    """kvferry-controller on free ports: `port` (HTTP), `pull`, `reply`, `heartbeat`; with
    `secret_file` its ZMQ ports speak CurveZMQ, with `admin_key` (passed in the environment, not
    on the command line) its HTTP API wants the key."""

    def __init__(self, work: Path, port: int | None = None, secret_file: str | Path | None = None,
                 admin_key: str | None = None) -> None:
        self.pull, self.reply, self.heartbeat = free_port(), free_port(), free_port()
        self.secret_file, self.admin_key = secret_file, admin_key
        port = port or free_port()
        ports = f'{{"pull": {self.pull}, "reply": {self.reply}, "heartbeat": {self.heartbeat}}}'
        secret = ["--cluster-secret-file", str(secret_file)] if secret_file else []
        super().__init__(f"kvferry-controller :{port}", [sys.executable, "-m", "kvferry.controller.server",
                                                          "--host", "127.0.0.1", "--port", str(port),
                                                          "--monitor-ports", ports, *secret],
                         port, work / f"controller-{port}.log", env={"KVFERRY_ADMIN_KEY": admin_key or ""})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_keys(self, instance_id: str) -> dict[str, object]:
        """LMCache's controller keys for an instance that reports to this controller."""
        keys: dict[str, object] = {
            "enable_controller": True, "lmcache_instance_id": instance_id,
            "controller_pull_url": f"127.0.0.1:{self.pull}", "controller_reply_url": f"127.0.0.1:{self.reply}",
            "lmcache_worker_ports": free_port()}
        if self.secret_file:
            keys["cluster_secret_file"] = str(self.secret_file)
        return keys
