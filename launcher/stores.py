"""Starts the services kvferry's tiers talk to: redis-server, Redis Sentinels, kvferry-server
(lm://), mooncake_master (mooncakestore://) and kvferry-controller (P2P), as child processes on
free ports (tests, benchmarks, demos, ``kvferry up --remote``).

redis-server comes from the OS (Debian: ``apt-get install redis-server``; ``make redis`` does it
where it is missing and apt is usable); mooncake_master from the mooncake-transfer-engine wheels
(the ``cpu`` and ``cuda`` extras), which need libibverbs1 from the OS."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvferry.common.errors import UnavailableError
from kvferry.common.netutil import free_port
from kvferry.launcher.vllm_proc import die_with_parent, log_tail


class StoreStartError(UnavailableError, RuntimeError):
    pass


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _redis_exe() -> str:
    exe = redis_server_binary()
    if exe is None:
        raise StoreStartError("redis-server not found: install it (Debian/Ubuntu: apt-get install redis-server; "
                              "`make redis` does it)")
    return exe


def wait_port(proc: subprocess.Popen, port: int, what: str, log: Path, timeout: float = 30.0) -> None:
    """Until `port` accepts connections; StoreStartError (with the log's tail) if the process dies or
    `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StoreStartError(f"{what} exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise StoreStartError(f"{what} did not listen on port {port} within {timeout:.0f}s:\n{log_tail(log)}")


class Proc:
    """One store process: started on a free port, stopped (and waited for) by stop()."""

    def __init__(self, what: str, argv: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.what, self.port, self.log = what, port, log
        self.tls_port: int | None = None  # a redis-server's TLS port, if it has one
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                         env=None if env is None else {**os.environ, **env})
        wait_port(self.proc, port, what, log)

    @property
    def url_hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def tls_hostport(self) -> str:
        return f"127.0.0.1:{self.tls_port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


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
    proc = Proc(f"redis-server :{port if plain else tls_port}", argv, port if plain else tls_port,
                work / f"redis-{port}.log")
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


class Controller(Proc):
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
        """The seed's controller keys for an instance that reports to this controller."""
        keys: dict[str, object] = {
            "enable_controller": True, "lmcache_instance_id": instance_id,
            "controller_pull_url": f"127.0.0.1:{self.pull}", "controller_reply_url": f"127.0.0.1:{self.reply}",
            "lmcache_worker_ports": free_port()}
        if self.secret_file:
            keys["cluster_secret_file"] = str(self.secret_file)
        return keys


def mooncake_master_binary() -> str | None:
    """mooncake_master next to this Python (the wheel's script) or on PATH; None when missing."""
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


class MooncakeMaster(Proc):
    """mooncake_master on free ports: `port` (RPC, what mooncakestore:// names), its built-in HTTP
    metadata server on `metadata_port`, metrics on `metrics_port`; restart() brings it back on the
    same ports (with an empty store, as a real restart)."""

    def __init__(self, work: Path, port: int | None = None) -> None:
        exe = mooncake_master_binary()
        if exe is None:
            raise StoreStartError("mooncake_master not found: pip install 'kvferry[cpu]' (mooncake-transfer-engine-"
                                  "non-cuda) or 'kvferry[cuda]' (mooncake-transfer-engine)")
        self.metadata_port, self.metrics_port = free_port(), free_port()
        port = port or free_port()
        self.argv = [exe, "-rpc_port", str(port), "-rpc_address", "127.0.0.1", "-metrics_port", str(self.metrics_port),
                     "-metrics_host", "127.0.0.1", "--enable_http_metadata_server=true",
                     "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.metadata_port}"]
        super().__init__(f"mooncake_master :{port}", self.argv, port, work / f"mooncake-master-{port}.log")
        wait_port(self.proc, self.metadata_port, self.what, self.log)

    @property
    def url(self) -> str:
        return f"mooncakestore://127.0.0.1:{self.port}/"

    def extra_config(self, segment_bytes: int = 256 << 20) -> dict[str, object]:
        """The seed's extra_config keys for a client of this master, over TCP."""
        return {"local_hostname": "127.0.0.1", "metadata_server": f"http://127.0.0.1:{self.metadata_port}/metadata",
                "protocol": "tcp", "device_name": "", "master_server_address": f"127.0.0.1:{self.port}",
                "global_segment_size": segment_bytes, "local_buffer_size": 0}

    def restart(self) -> None:
        self.stop()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        wait_port(self.proc, self.port, self.what, self.log)
        wait_port(self.proc, self.metadata_port, self.what, self.log)


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def start_etcd(work: Path, port: int | None = None) -> Proc:
    """A one-member etcd (Debian: ``apt-get install etcd-server``; ``make etcd`` does it) on
    loopback, its data in `work` (removed with it): discovery's engine for tests, benchmarks and
    ``kvferry up --discovery etcd``."""
    exe = etcd_binary()
    if exe is None:
        raise StoreStartError("etcd not found: install it (Debian/Ubuntu: apt-get install etcd-server; "
                              "`make etcd` does it)")
    port = port or free_port()
    peer = free_port()
    d = work / f"etcd-{port}"
    d.mkdir(parents=True, exist_ok=True)
    client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    return Proc("etcd", [exe, "--name", "kvferry", "--data-dir", str(d / "data"), "--listen-client-urls", client,
                         "--advertise-client-urls", client, "--listen-peer-urls", peer_url,
                         "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"kvferry={peer_url}",
                         "--logger", "zap", "--log-level", "warn"], port, work / f"etcd-{port}.log")
