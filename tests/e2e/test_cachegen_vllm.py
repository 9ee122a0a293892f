"""remote_serde cachegen on real vLLM: KV stored as cachegen chunks in a real Redis, loaded back as a
remote hit, gives the greedy answer the computed KV gave.

The models are ``llama-copy`` (GQA) and ``deepseek-copy`` (MLA's latent KV), from
launcher/tiny_model.py: small models trained here to continue a repeated 16-token pattern, so their
answers read the cached KV of the pattern's last period with a trained model's margins. The
random-weight test models cannot judge a lossy codec: their logits' margins are so small that any
KV error flips their greedy answers (benchmarks/cachegen_bench.py reports how far). One server per
model, vLLM's prefix cache off and no CPU tier: a prompt's first request computes it and stores its
chunks; its second loads all but the last token from Redis."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import redis

from kvferry.engine.remote.serde import HEADER_BYTES, peek
from kvferry.launcher import tiny_model
from kvferry.testing.store_servers import start_redis
from kvferry.testing.vllm_servers import OffloadServer
from tests.pd_helpers import completion, tier_value, tokens_and_logprobs
from tests.polling import until

CHUNK = 256
MAX_TOKENS = 16
# The largest |logprob| difference of a chosen token between the remote hit and the computed answer
# that the test holds (measured with the default bins: 0.0013 on llama-copy, 0.0125 on deepseek-copy; a
# flipped answer moves it by nats).
MAX_LOGPROB_DIFF = 0.1


@pytest.mark.vllm
@pytest.mark.parametrize(("arch", "kind", "block", "head_size"),
                         [("llama-copy", "cpu", 128, 64), ("deepseek-copy", "mla", 16, 576)])
def test_cachegen_remote_hits_give_the_computed_greedy_answers_on_a_trained_model(
        arch: str, kind: str, block: int, head_size: int, log_dir: Path, tmp_path: Path,
        redis_available: None) -> None:
    """`block`: vLLM CPU's block size for the model (16 for MLA, which it forces)."""
    import torch

    from kvferry.connector.cpu_isa import attention_isa
    from kvferry.kernels.layout import KVLayout
    layout = KVLayout(kind, 1, block, 1, head_size, torch.bfloat16)
    if attention_isa(layout, "auto") == "amx":
        pytest.skip("vLLM CPU packs KV in AMX tiles on this machine, which cachegen refuses at start "
                    "(tests/engine/test_cachegen.py checks the refusal)")
    model = tiny_model.ensure(arch=arch)
    store = start_redis(tmp_path)
    server = OffloadServer(str(model), log_dir, "0", tmp_path, local_cpu=False, remote_serde="cachegen",
                           remote_url=f"redis://127.0.0.1:{store.port}",
                           server={"extra_args": ["--no-enable-prefix-caching"]})
    rng = random.Random(52)
    try:
        server.start().wait_ready()
        client = redis.Redis(port=store.port, socket_timeout=10)
        worst, chunks = 0.0, 0
        for tokens in (300, 520, 1000):
            p = tiny_model.copy_prompt(rng, tokens)
            cold = tokens_and_logprobs(completion(server, p, MAX_TOKENS))
            want = [p[(tokens + i) % tiny_model.COPY_PERIOD] for i in range(MAX_TOKENS)]
            assert cold[0] == want, "the copy model does not continue its pattern: rebuild it (make model)"
            chunks += -(-tokens // CHUNK)
            until(lambda n=chunks: client.dbsize() >= 2 * n, 30, f"Redis to hold {chunks} chunks (2 keys each)")
            hits = tier_value(server, "kvferry:cache_hit_tokens_total", "remote")
            hit = tokens_and_logprobs(completion(server, p, MAX_TOKENS))
            until(lambda h=hits, n=tokens: tier_value(server, "kvferry:cache_hit_tokens_total", "remote") >= h + n - 1,
                  10, "the second request to be a remote hit of all but the last token")
            assert hit[0] == cold[0]
            worst = max(worst, *(abs(a - b) for a, b in zip(hit[1], cold[1], strict=True)))
        print(f"max logprob difference, remote cachegen hit vs computed: {worst:.4f}")
        assert worst <= MAX_LOGPROB_DIFF, worst
        # What Redis holds is cachegen, and small: the naive chunk would be whole blocks of raw KV.
        naive = stored = 0
        for k in (k for k in client.keys("*") if k.endswith(b":h")):
            fmt, dtype, (layers, n, kv_heads, size) = peek(client.get(k))
            assert (fmt, size) == ("cachegen", head_size)
            naive += layers * layout.kv_planes * -(-n // block) * block * kv_heads * size * dtype.itemsize
            stored += HEADER_BYTES + client.strlen(k[:-2] + b":d")
        assert stored < naive / 3.5, (stored, naive)
    finally:
        server.stop()
        store.stop()
