"""`kvferry up --remote mooncake` starts a real mooncake_master for the cluster, points every
instance's remote tier at it, and stops it with the rest."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from kvferry.common.config import load_config
from kvferry.engine.remote import mooncake_settings
from kvferry.launcher.services import mooncake_master_binary
from tests.polling import alive, until
from tests.up_cluster import start_up, stop, tree

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(mooncake_master_binary() is None, reason="mooncake_master not installed")]


def test_up_with_a_mooncake_store_stores_prompts_in_it(tmp_path: Path) -> None:
    proc, state = start_up(tmp_path, "--num-prefillers", "1", "--num-decoders", "1", "--remote", "mooncake")
    pids: set[int] = set()
    try:
        out = (tmp_path / "up.out").read_text()
        assert "store        mooncakestore://127.0.0.1:" in out
        url = state["proxy"]["url"]
        body = {"model": "tiny", "prompt": "Tell me a story about the king " * 40, "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
        cfg = load_config(path=state["instances"][0]["config"], env={})
        assert cfg.remote_url.startswith("mooncakestore://") and mooncake_settings.from_config(cfg) is not None
        master_log = next((tmp_path / "logs").glob("mooncake-master-*.log"))
        until(lambda: re.search(r"Keys: [1-9]", master_log.read_text(errors="replace")), 40,  # logged every 10 s
              "the prefiller to store a chunk in the Mooncake store", every=1)
        pids = tree(proc.pid)
    finally:
        stop(proc)
    assert not [p for p in pids if alive(p)], "kvferry up left processes behind (the master included)"
