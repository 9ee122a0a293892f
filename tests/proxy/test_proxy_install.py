"""A light proxy install: `pip install '.[proxy]'` into a fresh venv (no torch, NIXL or
vLLM) gives a working `kvferry-proxy`, which starts and answers /health in front of a stub engine.

pip resolves the core dependencies from its configured index and cache (warm after `make setup`:
about a minute on a busy 2-core machine). Where no index answers, the test skips and says so; any other pip failure
fails it. KVFERRY_SKIP_PROXY_INSTALL=1 skips it on purpose (say, a machine without network and
without a pip cache)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import httpx
import pytest

from kvferry.common.netutil import free_port
from kvferry.launcher.vllm_proc import stop_group
from tests.stub_procs import stub, wait_http

REPO = Path(__file__).resolve().parents[2]
OFFLINE = ("No matching distribution found", "Could not find a version", "Failed to establish a new connection",
           "Temporary failure in name resolution", "Network is unreachable", "ProxyError")


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("KVFERRY_SKIP_PROXY_INSTALL"):
        pytest.skip("KVFERRY_SKIP_PROXY_INSTALL is set")
    root = tmp_path_factory.mktemp("proxy-venv")
    # No pip of its own (ensurepip alone costs as much as the install): this venv's pip installs
    # into it (--python). A wheel of this tree built here (no build isolation: this venv has
    # setuptools), installed there with its dependencies: what `pip install 'kvferry[proxy]'` gives.
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    py = root / "venv" / "bin" / "python"
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = root / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "logs",
                                                             "__pycache__", ".*_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "dist"), str(src)], check=True, capture_output=True, text=True, timeout=300)
    wheel = next((root / "dist").glob("kvferry-*.whl"))
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", f"{wheel}[proxy]"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        if any(s in r.stdout + r.stderr for s in OFFLINE):
            pytest.skip(f"pip cannot reach a package index here (offline?): {(r.stderr or r.stdout)[-300:]}")
        pytest.fail(f"pip install '.[proxy]' failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return root / "venv"


def test_proxy_install_has_no_torch_nixl_or_vllm(light_venv: Path) -> None:
    py = light_venv / "bin" / "python"
    # aiohttp, httpx: the proxy's one server and one client are kvferry's own
    for mod in ("torch", "nixl", "vllm", "fastapi", "aiohttp", "httpx"):
        r = subprocess.run([str(py), "-c", f"import {mod}"], capture_output=True, text=True, cwd="/")
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, f"{mod} is installed in the light venv"
    r = subprocess.run([str(light_venv / "bin" / "kvferry-proxy"), "--help"], capture_output=True, text=True, cwd="/",
                       timeout=60)
    assert r.returncode == 0 and "--decoder-receiver-host" in r.stdout, r.stderr
    r = subprocess.run([str(light_venv / "bin" / "kvferry"), "secret"], capture_output=True, text=True, cwd="/",
                       timeout=60)
    assert r.returncode == 0 and len(r.stdout.strip()) >= 16, r.stderr


def test_proxy_install_serves_health_in_front_of_a_stub_engine(light_venv: Path) -> None:
    p0, d0 = stub(), stub()  # the stubs run in the test's venv; the proxy in the light one, from / (not this tree)
    port = free_port()
    proc = subprocess.Popen([str(light_venv / "bin" / "kvferry-proxy"), "--port", str(port), "--prefiller", p0.url,
                             "--decoder", f"{d0.url},{free_port()},{free_port()}", "--health-interval", "0.3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd="/")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc)
        h = httpx.get(url + "/health", timeout=5)
        assert h.status_code == 200, h.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "light", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    finally:
        stop_group(proc, 10)
