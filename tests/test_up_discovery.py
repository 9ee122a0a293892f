"""`kvferry up --discovery etcd` on real vLLM CPU servers: the cluster runs through a local etcd,
a second proxy started by hand serves the same instances, and a dead decoder leaves both proxies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvferry.common.netutil import free_port
from tests.polling import until
from tests.test_up import alive, start_up, stop


def _listed(proxy: str) -> set[str]:
    return {i["instance_id"] for i in httpx.get(f"{proxy}/health", timeout=5).json()["instances"]
            if "instance_id" in i}


@pytest.mark.vllm
def test_up_discovery_etcd_second_proxy_and_a_dead_decoder(tmp_path: Path, etcd_available) -> None:
    proc, state = start_up(tmp_path, "--num-prefillers", "1", "--num-decoders", "1", "--discovery", "etcd",
                           "--lease-ttl", "2")
    second = None
    try:
        target = state["discovery"]
        assert target.startswith("etcd://127.0.0.1:"), state
        a = state["proxy"]["url"]
        body = {"model": "tiny", "prompt": "Tell me a story about the king", "max_tokens": 8, "temperature": 0}
        first = httpx.post(f"{a}/v1/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        port = free_port()
        b = f"http://127.0.0.1:{port}"
        with open(tmp_path / "proxy-b.log", "ab") as log:
            second = subprocess.Popen([sys.executable, "-m", "kvferry.proxy", "--port", str(port), "--discovery",
                                       target, "--cluster-secret-file", state["cluster_secret_file"]],
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def ready() -> bool:
            try:
                return httpx.get(f"{b}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        until(ready, 20, "the second proxy to find the instances")
        again = httpx.post(f"{b}/v1/completions", json=body, timeout=120)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        decoder = next(i for i in state["instances"] if i["role"] == "decoder")
        assert len(_listed(a)) == len(_listed(b)) == 2
        os.killpg(decoder["pid"], signal.SIGKILL)  # vLLM dies; its registrar (kvferry up) withdraws it
        t0 = time.monotonic()
        until(lambda: len(_listed(a)) == len(_listed(b)) == 1, 10, "both proxies to drop the dead decoder")
        assert time.monotonic() - t0 < 6
    finally:
        if second is not None and second.poll() is None:
            second.send_signal(signal.SIGTERM)
            second.wait(15)
        assert stop(proc) < 25
    assert not alive(state["launcher_pid"])
