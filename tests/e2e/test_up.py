"""`kvferry up` runs a real local cluster (vLLM CPU servers, the connector, the proxy) and takes it
all down again."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from kvferry.common.netutil import free_port
from tests.polling import alive, until
from tests.up_cluster import KVFERRY, start_up, stop, tree


def _staging_taken(url: str) -> bool:
    free = total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvferry:pd_buffer_free_pages{"):
            free += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvferry:pd_buffer_pages{"):
            total += float(line.rsplit(" ", 1)[1])
    return free < total


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


@pytest.mark.vllm
def test_up_2p2d_keeps_serving_when_a_decoder_or_a_prefiller_dies_and_nothing_outlives_a_crashed_launcher(
        tmp_path: Path) -> None:
    proc, state = start_up(tmp_path, "--num-prefillers", "2", "--num-decoders", "2")
    pids: set[int] = set()
    try:
        url = state["proxy"]["url"]
        dead = [i for i in state["instances"] if i["role"] == "decoder"][0]
        os.killpg(dead["pid"], signal.SIGKILL)

        def ejected() -> dict | None:
            h = httpx.get(url + "/health").json()
            return None if [i for i in h["instances"] if i["url"] == dead["url"]][0]["healthy"] else h
        h = until(ejected, 30, "the proxy to eject the killed decoder", every=0.5)
        inst = [i for i in h["instances"] if i["url"] == dead["url"]][0]
        assert not inst["healthy"] and h["status"] == "ok"
        assert f'kvferry_proxy_instance_healthy{{instance="{inst["id"]}",role="decoder",url="{dead["url"]}"}} 0.0' \
            in httpx.get(url + "/metrics").text
        for i in range(6):
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": f"request {i} " * 30,
                                                          "max_tokens": 6}, timeout=120)
            assert r.status_code == 200, r.text
        assert "exited" in (tmp_path / "up.out").read_text()
        # A prefiller SIGKILLed mid-prefill: the request is prefilled again on the other one.
        body = {"model": "tiny", "prompt": " ".join(f"word{i}" for i in range(700)), "max_tokens": 6,
                "temperature": 0}
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(url + "/v1/completions", json=body,
                                                                    timeout=180)), daemon=True)
        t.start()

        def computing() -> dict | None:  # its staging pages are taken once the prompt computes
            assert t.is_alive(), out
            return next((i for i in state["instances"] if i["role"] == "prefiller" and _staging_taken(i["url"])),
                        None)
        busy = until(computing, 60, lambda: f"a prefiller computing the prompt: {out}", every=0.02)
        os.killpg(busy["pid"], signal.SIGKILL)
        t.join(180)
        assert out["r"].status_code == 200, out["r"].text
        assert out["r"].json()["usage"]["completion_tokens"] == 6
        # The launcher itself crashes (SIGKILL: no handler runs): its children must not live on.
        pids = tree(proc.pid) - {proc.pid}
        assert len(pids) >= 4
        proc.kill()
        proc.wait(10)
        until(lambda: not any(alive(p) for p in pids), 30, lambda: "the launcher's children to end; orphans: "
              + "; ".join(f"{p}: {cmdline(p)}" for p in pids if alive(p)), every=0.5)
    finally:
        if proc.poll() is None:
            stop(proc)
        for p in pids:  # never leave them to the next test, whatever failed above
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_up_errors_are_one_line(tmp_path: Path) -> None:
    busy = free_port()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        for args, text in ([["--port", str(busy)], f"--port {busy}: the port is in use"],
                           [["--model", str(tmp_path / "nope")], "no such path"],
                           [["--tp", "2"], "--tp > 1 needs GPUs"],
                           [["--num-decoders", "0"], "at least 1"],
                           [["--config", str(tmp_path / "missing.yaml")], "no such file"],
                           [["--vllm-args=--port 1234"], "--port is set by kvferry up itself: use kvferry up's --port"],
                           [["--vllm-args=--kv-transfer-config={}"], "--kv-transfer-config is set by kvferry up"],
                           [["--vllm-args=--dtype 'float32"], "quote it as one shell string"]):
            r = subprocess.run([KVFERRY, "up", *args], capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr, r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_sise: 256\n")
    r = subprocess.run([KVFERRY, "up", "--config", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "chunk_sise" in r.stderr and "did you mean chunk_size" in r.stderr


def test_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    import importlib.util

    from kvferry.launcher import up
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    with pytest.raises(up.UpError, match=r"pip install 'kvferry\[cpu\]'"):
        up.plan(p.parse_args([]))


@pytest.mark.vllm
def test_a_child_that_dies_while_starting_stops_the_rest(tmp_path: Path) -> None:
    """A folder that is no model: vLLM exits during start-up; the launcher shows its log and stops."""
    bogus = tmp_path / "not-a-model"
    bogus.mkdir()
    (bogus / "config.json").write_text("{}")
    r = subprocess.run([KVFERRY, "up", "--model", str(bogus), "--port", str(free_port()), "--log-dir",
                        str(tmp_path / "logs")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exited with" in r.stderr and "while starting" in r.stderr and "the end of its log" in r.stderr
    assert "stopped" in r.stdout

    def leftovers() -> list[str]:
        return subprocess.run(["pgrep", "-f", str(bogus)], capture_output=True, text=True).stdout.split()
    until(lambda: not leftovers(), 60, lambda: f"no process left of the failed start: {leftovers()}")
