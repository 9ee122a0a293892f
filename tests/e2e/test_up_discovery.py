"""`kvferry up --discovery etcd` on real vLLM CPU servers: the cluster runs through a local etcd,
a second proxy started by hand serves the same instances, a decoder joins with `kvferry join`, a
dead decoder leaves both proxies (requests go on), and a withdrawn one too."""

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
from tests.polling import alive, until
from tests.up_cluster import start_up, stop


def _listed(proxy: str) -> set[str]:
    return {i["instance_id"] for i in httpx.get(f"{proxy}/health", timeout=5).json()["instances"]
            if "instance_id" in i}


@pytest.mark.vllm
def test_up_discovery_etcd_second_proxy_join_and_a_dead_decoder(tmp_path: Path, etcd_available) -> None:
    proc, state = start_up(tmp_path, "--num-prefillers", "1", "--num-decoders", "1", "--discovery", "etcd",
                           "--lease-ttl", "2")
    second = joined = None
    try:
        target = state["discovery"]
        assert target.startswith("etcd://127.0.0.1:"), state
        out = (tmp_path / "up.out").read_text()
        assert f"kvferry join --discovery {target}" in out and f"kvferry-proxy --discovery {target}" in out
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
                return httpx.get(f"{b}/health", timeout=1).json()["status"] == "ok"  # both roles found
            except httpx.HTTPError:
                return False
        until(ready, 20, "the second proxy to find the instances")
        again = httpx.post(f"{b}/v1/completions", json=body, timeout=120)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        # A decoder joins with `kvferry join`; the first one is then SIGKILLed: requests go on, through
        # both proxies, with the same greedy answer.
        joined = subprocess.Popen([sys.executable, "-m", "kvferry.launcher", "join", "--discovery", target,
                                   "--role", "decoder", "--cluster-secret-file", state["cluster_secret_file"],
                                   "--lease-ttl", "2", "--log-dir", str(tmp_path / "join")],
                                  stdout=open(tmp_path / "join.out", "wb"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        until(lambda: len(_listed(a)) == len(_listed(b)) == 3 or joined.poll() is not None, 300,
              "both proxies to list the joined decoder")
        assert joined.poll() is None, (tmp_path / "join.out").read_text()
        decoder = next(i for i in state["instances"] if i["role"] == "decoder")
        os.killpg(decoder["pid"], signal.SIGKILL)  # vLLM dies; its registrar (kvferry up) withdraws it
        t0 = time.monotonic()
        until(lambda: len(_listed(a)) == len(_listed(b)) == 2, 10, "both proxies to drop the dead decoder")
        assert time.monotonic() - t0 < 6
        for px in (a, b):
            r = httpx.post(f"{px}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        joined.send_signal(signal.SIGTERM)  # withdraws, then stops its vLLM
        until(lambda: len(_listed(a)) == len(_listed(b)) == 1, 5, "both proxies to drop the withdrawn decoder")
        assert joined.wait(30) == 0
    finally:
        if joined is not None and joined.poll() is None:
            os.killpg(joined.pid, signal.SIGKILL)
            joined.wait(10)
        if second is not None and second.poll() is None:
            second.send_signal(signal.SIGTERM)
            second.wait(15)
        assert stop(proc) < 25
    assert not alive(state["launcher_pid"])
