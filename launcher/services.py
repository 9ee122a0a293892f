"""Starts the services `kvferry up` runs beside its instances, as child processes on free ports:
mooncake_master (``--remote mooncake``) and etcd (``--discovery etcd``); `Proc` is any such
process. The stores tests start (redis-server, Sentinels, kvferry-server, kvferry-controller) are
in kvferry.testing.store_servers.

mooncake_master comes from the mooncake-transfer-engine wheels (the ``cpu`` and ``cuda`` extras),
which need libibverbs1 from the OS."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvferry.common.errors import UnavailableError
from kvferry.common.netutil import free_port
from kvferry.launcher.vllm_proc import die_with_parent, log_tail


class StoreStartError(UnavailableError, RuntimeError):
    pass


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
        """LMCache's Mooncake extra_config keys for a client of this master, over TCP."""
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
                         "--logger", "zap", "--log-level", "warn",
                         # every registration is re-written each TTL/3: keep 5 minutes of history, not all
                         "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m"],
                port, work / f"etcd-{port}.log")
