"""Starts the services kvferry's tiers talk to: redis-server, Redis Sentinels, kvferry-server
(lm://) and kvferry-controller (P2P), as child processes on free ports (tests, benchmarks, demos).

redis-server comes from the OS (Debian: ``apt-get install redis-server``; ``make redis`` does it
where it is missing and apt is usable)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvferry.common.netutil import free_port
from kvferry.launcher.vllm_proc import die_with_parent, log_tail


class StoreStartError(RuntimeError):
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
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                         env=None if env is None else {**os.environ, **env})
        wait_port(self.proc, port, what, log)

    @property
    def url_hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

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


def start_redis(work: Path, port: int | None = None, replicaof: int | None = None, maxmemory_mb: int = 512) -> Proc:
    """A redis-server with no persistence, evicting least recently used keys past `maxmemory_mb`."""
    exe = _redis_exe()
    port = port or free_port()
    d = work / f"redis-{port}"
    d.mkdir(parents=True, exist_ok=True)
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "", "--appendonly", "no",
            "--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"]
    if replicaof is not None:
        argv += ["--replicaof", "127.0.0.1", str(replicaof)]
    return Proc(f"redis-server :{port}", argv, port, work / f"redis-{port}.log")


def start_sentinel(work: Path, master_port: int, service: str = "mymaster", down_after_ms: int = 1000,
                   port: int | None = None) -> Proc:
    """A Sentinel watching the master at `master_port` (quorum 1, fast failover for tests)."""
    exe = _redis_exe()
    port = port or free_port()
    conf = work / f"sentinel-{port}.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {work}\n"
                    f"sentinel monitor {service} 127.0.0.1 {master_port} 1\n"
                    f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                    f"sentinel failover-timeout {service} {max(3 * down_after_ms, 3000)}\n"
                    f"sentinel parallel-syncs {service} 1\n")
    return Proc(f"redis-sentinel :{port}", [exe, str(conf), "--sentinel"], port, work / f"sentinel-{port}.log")


def start_lm_server(work: Path, port: int | None = None, *extra: str, secret_file: str | Path | None = None) -> Proc:
    """kvferry-server (the lm:// store); with `secret_file`, clients must prove the cluster secret."""
    port = port or free_port()
    secret = ["--cluster-secret-file", str(secret_file)] if secret_file else []
    return Proc(f"kvferry-server :{port}", [sys.executable, "-m", "kvferry.engine.lm_server", "127.0.0.1", str(port),
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
