"""LMCache's Mooncake PD example on real vLLM CPU servers: a prefiller (kv_producer) and a decoder
(kv_consumer) share KV only through a real mooncake_master (``mooncakestore://``, chunk_size 32: the
smallest vLLM's CPU build allows),
so the decoder loads a prompt the prefiller computed instead of recomputing it (vLLM's metrics show
the tokens loaded, the greedy tokens are the same); with the master killed mid-stream every request
still succeeds (misses), and hits resume after it restarts.

Float32 for the same reason as tests/e2e/test_offload_vllm.py: loaded and computed paths then agree
to 1e-4 in every logprob."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvferry.common.config import load_config
from kvferry.common.hashing import chunk_keys
from kvferry.common.netutil import free_port
from kvferry.engine.offload.ops import offload_salt
from kvferry.engine.remote import mooncake_backend, mooncake_settings
from kvferry.engine.tiers.remote import RemoteTier
from kvferry.launcher.pd_instances import CONNECTOR, write_config
from kvferry.launcher.services import MooncakeMaster, mooncake_master_binary
from kvferry.launcher.vllm_proc import VLLMServer
from tests.pd_helpers import completion, source_tokens, tier_value, tokens_and_logprobs
from tests.polling import until

# LMCache's example has chunk_size 16; vLLM's CPU attention wants blocks of a multiple of 32, and a chunk
# is whole blocks, so 32 is the smallest this build allows.
CHUNK = 32
ARGS = ["--dtype", "float32", "--no-enable-prefix-caching", "--block-size", str(CHUNK)]
_seed = iter(range(5000, 10_000))

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(mooncake_master_binary() is None, reason="mooncake_master not installed")]


def prompt(n: int = 600) -> list[int]:
    rng = random.Random(next(_seed))
    return [rng.randrange(10, 4000) for _ in range(n)]


def appendix2_keys(m: MooncakeMaster, hostname: str) -> dict[str, object]:
    """LMCache's mooncake-{prefiller,decoder}-config.yaml, pointed at this master, with a smaller
    segment and buffer than its 30 GiB / 1 GiB."""
    return {"chunk_size": CHUNK, "remote_url": m.url, "remote_serde": "naive", "local_cpu": False,
            "max_local_cpu_size": 2, "numa_mode": None,
            "extra_config": {**m.extra_config(256 << 20), "local_hostname": hostname, "local_buffer_size": 64 << 20,
                             "transfer_timeout": 1, "save_chunk_meta": False}}


@dataclass
class Setup:
    model: Path
    master: MooncakeMaster
    prefiller: VLLMServer
    decoder: VLLMServer

    def keys(self, p: list[int]) -> list[bytes]:
        salt = offload_salt(self.model.name, "float32", 8, 8, 64, CHUNK, CHUNK, 1)
        return chunk_keys(p, CHUNK, salt, include_partial=True)

    def stored(self, p: list[int], timeout: float = 30.0) -> None:
        """Until the store holds every chunk of `p` (puts are asynchronous)."""
        cfg = load_config({"remote_url": self.master.url, "extra_config": self.master.extra_config(16 << 20)}, env={})
        t, keys = RemoteTier(self.master.url, 1.0, mooncake=mooncake_settings.from_config(cfg)), self.keys(p)
        try:
            until(lambda: all(t.exists(keys)), timeout, f"the store to get the prompt's {len(keys)} chunks", every=0.2)
        finally:
            t.close()


@pytest.fixture(scope="module")
def setup(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("mooncake-vllm")
    master = MooncakeMaster(work)
    servers: list[VLLMServer] = []
    try:
        for role, name, cores in (("kv_producer", "prefiller", "0"), ("kv_consumer", "decoder", "1")):
            port = free_port()
            conf = write_config(work / f"mooncake-{name}-config.yaml", **appendix2_keys(master, "127.0.0.1"))
            servers.append(VLLMServer(str(tiny_model_path), port, log_dir / f"vllm-mooncake-{name}-{port}.log",
                                      cores=cores, kv_transfer_config={**CONNECTOR, "kv_role": role},
                                      env={"LMCACHE_CONFIG_FILE": str(conf)}, extra_args=ARGS).start())
        for s in servers:
            s.wait_ready()
        yield Setup(tiny_model_path, master, *servers)
    finally:
        for s in servers:
            s.stop()
        mooncake_backend.close_all()  # the test's own client (Setup.stored), before its master goes
        master.stop()


def log(server: VLLMServer) -> str:
    return server.log_path.read_text(errors="replace")


def remote_hits(server: VLLMServer) -> int:
    return log(server).count("from remote")


def test_the_decoder_loads_the_prefillers_prompt_from_mooncake(setup: Setup) -> None:
    s = setup
    p = prompt(600)
    want = tokens_and_logprobs(completion(s.prefiller, p, 8))
    s.stored(p)
    src0 = source_tokens(s.decoder)
    got = tokens_and_logprobs(completion(s.decoder, p, 8))
    loaded = len(p) - 1  # every chunk (the last one partial); vLLM computes the last token
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3
    assert f"Retrieved {loaded} out of {loaded} required tokens (from {len(p)} total tokens)" in log(s.decoder)
    src = source_tokens(s.decoder)
    assert src["external_kv_transfer"] - src0.get("external_kv_transfer", 0) == loaded
    assert src["local_compute"] - src0.get("local_compute", 0) == len(p) - loaded
    until(lambda: tier_value(s.decoder, "kvferry:cache_hit_tokens_total", "remote") >= loaded, 10,
          "kvferry:cache_hit_tokens_total{tier=remote} to count the hit", every=0.2)


def test_a_killed_master_is_misses_and_its_restart_brings_hits_back(setup: Setup) -> None:
    s = setup
    s.master.kill()
    for _ in range(2):  # the store is gone: lookups and puts fail, requests do not
        p = prompt(300)
        a = tokens_and_logprobs(completion(s.prefiller, p, 4))[0]
        assert tokens_and_logprobs(completion(s.decoder, p, 4))[0] == a
    assert "treating it as empty" in log(s.prefiller) and "treating it as empty" in log(s.decoder)
    s.master.restart()
    hits0 = remote_hits(s.decoder)

    def hit_again() -> bool:  # each instance retries after its back-off (at most 30 s)
        p = prompt(300)
        a = tokens_and_logprobs(completion(s.prefiller, p, 4))[0]
        try:
            s.stored(p, timeout=5)
        except AssertionError:
            return False  # the prefiller was still backing off: its puts were dropped
        assert tokens_and_logprobs(completion(s.decoder, p, 4))[0] == a
        return remote_hits(s.decoder) != hits0
    until(hit_again, 90, "a remote hit within 90 s of the master's restart", every=0)
