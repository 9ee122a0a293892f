"""Offload on real vLLM CPU servers (kv_role kv_both, vLLM's own prefix cache off): a shared prefix
is loaded from the CPU tier, the disk tier serves it after a restart, both tiers stay under their
limits, and a damaged file is a miss with a warning and a correct answer.

The servers run the tiny model in float32: its random weights leave near-ties between the top
tokens, and bf16 rounding differs between a prompt computed whole and one computed after a
loaded prefix (vLLM's own prefix cache gives the same bf16 tokens as kvferry here). In float32
the loaded and the computed paths agree to 1e-4 in every logprob.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.common.hashing import chunk_keys
from kvferry.common.netutil import free_port
from kvferry.engine.offload.ops import GB, offload_salt
from kvferry.engine.tiers.disk import HEADER_BYTES, scan
from kvferry.launcher.vllm_proc import VLLMServer
from kvferry.testing.vllm_servers import OffloadServer
from tests.pd_helpers import completion, prom, source_tokens, tier_value, tokens_and_logprobs
from tests.polling import until

FP32 = ["--dtype", "float32", "--no-enable-prefix-caching"]
CHUNK = 256
CHUNK_BYTES = 8 << 20  # 256 tokens x 8 layers x 8 heads x 64 x K,V x 4 bytes
CPU_GB, DISK_GB = 0.15, 0.25  # 19 and 31 chunks: the 2,150-token prompt fits, the stream does not


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


class Cluster:
    def __init__(self, model: str, log_dir: Path, conf: Path) -> None:
        self.model, self.log_dir, self.conf = model, log_dir, conf
        self.disk = conf / "kv"
        self.keys = {"local_cpu": True, "max_local_cpu_size": CPU_GB, "local_disk": f"file://{self.disk}/",
                     "max_local_disk_size": DISK_GB}
        self.port = free_port()
        self.plain = VLLMServer(model, free_port(), log_dir / "vllm-plain-fp32.log", cores="0", extra_args=FP32)
        self.server = self._offload()

    def _offload(self) -> OffloadServer:
        return OffloadServer(self.model, self.log_dir, "1", self.conf, port=self.port,
                             server={"extra_args": FP32}, **self.keys)

    def restart(self) -> None:
        self.server.stop()
        self.server = self._offload()
        self.server.start().wait_ready()

    def log(self) -> str:
        return self.server.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(str(tiny_model_path), log_dir, tmp_path_factory.mktemp("offload"))
    c.plain.start()
    c.server.start()
    try:
        c.plain.wait_ready()
        c.server.wait_ready()
        yield c
    finally:
        c.server.stop()
        c.plain.stop()


def same_answer(c: Cluster, p: list[int], max_tokens: int = 8) -> None:
    got = tokens_and_logprobs(completion(c.server, p, max_tokens))
    want = tokens_and_logprobs(completion(c.plain, p, max_tokens))
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3


def settle(check, timeout: float = 10.0) -> None:
    """Metrics reach /metrics with the engine's next stats update: poll, bounded."""
    until(check, timeout, "metrics to settle", every=0.2)


@pytest.mark.vllm
def test_a_shared_prefix_is_loaded_from_the_cpu_tier_and_only_the_rest_is_computed(cluster: Cluster) -> None:
    c = cluster
    shared = prompt(2000, 1)
    a, b = shared + prompt(100, 2), shared + prompt(150, 3)
    same_answer(c, a)
    settle(lambda: tier_value(c.server, "kvferry:cache_chunks", "cpu") == 9)
    hits0, src0 = tier_value(c.server, "kvferry:cache_hit_tokens_total", "cpu"), source_tokens(c.server)
    same_answer(c, b)
    loaded = 2000 // CHUNK * CHUNK  # 1,792: the chunks b shares with a
    settle(lambda: tier_value(c.server, "kvferry:cache_hit_tokens_total", "cpu") - hits0 == loaded)
    src = source_tokens(c.server)
    assert src["local_compute"] - src0["local_compute"] == len(b) - loaded
    assert src["external_kv_transfer"] - src0["external_kv_transfer"] == loaded
    assert src["local_cache_hit"] == 0  # vLLM's own prefix cache is off
    cached = prom(c.server, "vllm:prompt_tokens_cached_by_source_total")
    assert any('source="host"' in k and v >= loaded for k, v in cached.items())
    log = c.log()
    assert f"total tokens {len(b)}, hit tokens {loaded}, need to load {loaded}" in log
    assert f"Retrieved {loaded} out of {loaded} required tokens (from {len(b)} total tokens)" in log


@pytest.mark.vllm
def test_each_tier_stays_under_its_limit_under_a_stream_of_prompts(cluster: Cluster) -> None:
    c = cluster
    root = c.disk / "rank0"
    stream = [prompt(1000, 100 + i) for i in range(8)]  # 4 chunks each: 32 in all
    for p in stream:
        completion(c.server, p, 2)
        assert tier_value(c.server, "kvferry:cache_usage_bytes", "cpu") <= CPU_GB * GB
        assert tier_value(c.server, "kvferry:cache_usage_bytes", "disk") <= DISK_GB * GB
        assert sum(n for _, n in scan(root)) <= DISK_GB * GB  # files on disk, not only the index
    settle(lambda: tier_value(c.server, "kvferry:cache_evicted_chunks_total", "disk") > 0)
    assert tier_value(c.server, "kvferry:cache_evicted_chunks_total", "cpu") > 0
    assert tier_value(c.server, "kvferry:cache_chunks", "cpu") == int(CPU_GB * GB) // CHUNK_BYTES
    hits0 = tier_value(c.server, "kvferry:cache_hit_tokens_total", "cpu")
    same_answer(c, stream[-1])  # the newest prompt is still held
    settle(lambda: tier_value(c.server, "kvferry:cache_hit_tokens_total", "cpu") - hits0 == 999)


@pytest.mark.vllm
def test_after_a_restart_the_disk_tier_hits_and_a_damaged_file_is_a_warned_miss(cluster: Cluster,
                                                                                tiny_model_path: Path) -> None:
    c = cluster
    good, bad = prompt(1000, 200), prompt(1000, 201)
    for p in (good, bad):
        completion(c.server, p, 2)
    salt = offload_salt(tiny_model_path.name, "float32", 8, 8, 64, 128, CHUNK, 1)
    files = [c.disk / "rank0" / f"{k.hex()}.kvf" for k in chunk_keys(bad, CHUNK, salt)]
    settle(lambda: all(f.exists() for f in files))
    c.restart()  # the CPU tier starts empty; the disk tier's files are indexed again
    assert tier_value(c.server, "kvferry:cache_usage_bytes", "cpu") == 0
    raw = bytearray(files[1].read_bytes())
    raw[HEADER_BYTES + 4096] ^= 0xFF
    files[1].write_bytes(bytes(raw))

    same_answer(c, good)
    settle(lambda: tier_value(c.server, "kvferry:cache_hit_tokens_total", "disk") == 999)
    assert "from earlier runs" in c.log()

    same_answer(c, bad)  # the load fails on chunk 1, vLLM recomputes the prompt
    assert "treated as a miss and deleted" in c.log()
    assert not files[1].exists()
    settle(lambda: sum(prom(c.server, "kvferry:cache_load_errors_total").values()) == 1)
    assert sum(prom(c.server, "kvferry:cache_disk_corrupt_files_total").values()) == 1
    same_answer(c, bad)  # and again: chunk 0 from the CPU tier, the rest computed
