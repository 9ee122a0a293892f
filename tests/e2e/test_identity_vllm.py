"""Cached KV only for the request it belongs to, on real vLLM CPU: two kv_both instances with the
CPU tier share one Redis store (vLLM's own prefix cache on in one, off in the other), against a
plain vLLM of the same flags. Across cache_salts nothing is cached, within one everything is; a
LoRA adapter's request after the base model's (and the reverse) answers as plain vLLM does, with
no cross-adapter hit; two prompt-embedding inputs of one length answer as plain vLLM does; and a
LoRA request disaggregates through the proxy (prefiller and decoder both serve the adapter) to
plain vLLM's answer. Multimodal keys are a unit test (tests/engine/test_kv_identity.py): the tiny
models have no multimodal inputs.

Float32 for the same reason as tests/e2e/test_offload_vllm.py: loaded and computed paths agree to
1e-4 in every logprob.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvferry.common.hashing import chunk_keys
from kvferry.common.netutil import free_port
from kvferry.connector.request_identity import IdentityReader
from kvferry.engine.offload.ops import offload_salt
from kvferry.engine.tiers.remote import RemoteTier
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.services import Proc
from kvferry.launcher.vllm_proc import VLLMServer
from kvferry.testing import tiny_lora
from kvferry.testing.store_servers import start_redis
from kvferry.testing.vllm_servers import OffloadServer
from tests.pd_helpers import running_proxy, source_tokens
from tests.polling import until

ADAPTER = "adapter-a"
CHUNK = 256
_seed = iter(range(7000, 9000))


def prompt(n: int) -> list[int]:
    rng = random.Random(next(_seed))
    return [rng.randrange(10, 4000) for _ in range(n)]


def flags(lora: Path, prefix_cache: bool) -> list[str]:
    return ["--dtype", "float32", "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={lora}",
            "--enable-prompt-embeds", "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if prefix_cache else "--no-enable-prefix-caching"]


@dataclass
class Cluster:
    plain: VLLMServer  # no connector, no prefix cache: the reference answers
    on: OffloadServer  # kvferry's CPU tier and the Redis store, vLLM's prefix cache on
    off: OffloadServer  # the same store, vLLM's prefix cache off
    redis: Proc
    lora: Path
    model: Path
    log_dir: Path
    conf: Path


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    conf = tmp_path_factory.mktemp("identity")
    lora = tiny_lora.build(tiny_model_path, conf / ADAPTER, seed=5)
    rd = start_redis(conf)
    keys = {"local_cpu": True, "max_local_cpu_size": 0.2, "remote_url": f"redis://127.0.0.1:{rd.port}"}
    plain = VLLMServer(str(tiny_model_path), free_port(), log_dir / "vllm-identity-plain.log", cores="0",
                       extra_args=flags(lora, prefix_cache=False))
    on = OffloadServer(str(tiny_model_path), log_dir, "1", conf, server={"extra_args": flags(lora, True)}, **keys)
    off = OffloadServer(str(tiny_model_path), log_dir, "0", conf, server={"extra_args": flags(lora, False)}, **keys)
    servers = (plain, on, off)
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout=600)
        yield Cluster(plain, on, off, rd, lora, tiny_model_path, log_dir, conf)
    finally:
        for s in servers:
            s.stop()
        rd.stop()


def post(server: VLLMServer | str, path: str, body: dict) -> dict:
    url = server if isinstance(server, str) else server.url
    r = httpx.post(f"{url}{path}", json={"temperature": 0, "logprobs": 1, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def complete(server: VLLMServer | str, p: list[int], model: str = "tiny", **extra: object) -> dict:
    return post(server, "/v1/completions", {"model": model, "prompt": p, "max_tokens": 6, **extra})


def answer(resp: dict) -> tuple[str, list[float]]:
    choice = resp["choices"][0]
    lp = choice["logprobs"]
    return (choice["text"], list(lp["token_logprobs"])) if "token_logprobs" in lp else \
        (choice["message"]["content"], [t["logprob"] for t in lp["content"]])


def cached(resp: dict) -> int:
    return (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def same(got: dict, want: dict) -> None:
    (gt, gl), (wt, wl) = answer(got), answer(want)
    assert gt == wt
    assert max(abs(a - b) for a, b in zip(gl, wl, strict=True)) < 1e-3


def stored_remotely(c: Cluster, tokens: list[int] | None, n: int, **identity: object) -> None:
    """Until Redis holds every chunk of a prompt of `n` tokens (its `tokens`, or embeddings alone)
    under the request identity (vLLM Request fields: cache_salt, lora_request, prompt_embeds),
    keyed as the servers key it: asked of the store itself, since a server's counters reach
    /metrics only with an engine step, and none may follow a write-behind put."""
    req = Request("probe", tokens, SamplingParams(max_tokens=1), None, **identity)  # type: ignore[arg-type]
    ident = IdentityReader(CHUNK).read(req)
    salt = offload_salt(c.model.name, "float32", 8, 8, 64, 128, CHUNK, 1)
    keys = chunk_keys(tokens if tokens is not None else [0] * n, CHUNK, salt, extras=ident.extras)
    tier = RemoteTier(f"redis://127.0.0.1:{c.redis.port}", 1.0)
    try:
        until(lambda: all(tier.exists(keys)), 60, f"the prompt's {len(keys)} chunks to reach the Redis store",
              every=0.2)
    finally:
        tier.close()


def lora(c: Cluster, model: str) -> LoRARequest | None:
    return LoRARequest(ADAPTER, 1, str(c.lora)) if model == ADAPTER else None


@pytest.mark.vllm
def test_isolation_cache_salt_nothing_crosses_salts_everything_hits_within_one(cluster: Cluster) -> None:
    """One prompt per server checked: the server with vLLM's prefix cache (its GPU cache and CPU tier
    hold tenant A's KV), and the one without it (the store holds A's KV, put there by the first)."""
    c = cluster
    for server in (c.on, c.off):
        p = prompt(600)
        want_a, want_b = complete(c.plain, p, cache_salt="tenant-a"), complete(c.plain, p, cache_salt="tenant-b")
        first = complete(c.on, p, cache_salt="tenant-a")
        same(first, want_a)
        assert cached(first) == 0
        stored_remotely(c, p, len(p), cache_salt="tenant-a")
        other = complete(server, p, cache_salt="tenant-b")  # not from the CPU tier, vLLM's cache or the store
        same(other, want_b)
        assert cached(other) == 0, server.log_path
        again = complete(server, p, cache_salt="tenant-a")  # the whole prompt but the token vLLM computes
        same(again, want_a)
        assert cached(again) == len(p) - 1, server.log_path
        assert cached(complete(server, p)) == 0, "no salt is a tenant of its own too"


@pytest.mark.vllm
def test_identity_a_lora_adapter_and_the_base_model_never_share_kv_and_answer_as_plain_vllm(cluster: Cluster) -> None:
    """Both orders, each on both servers (a fresh prompt each time): the second model finds nothing of
    the first's in the CPU tier, vLLM's cache or the store, and the first's KV is shared through the
    store with its own model."""
    c = cluster
    for order in (("tiny", ADAPTER), (ADAPTER, "tiny")):
        for server in (c.on, c.off):
            p = prompt(600)
            want = {m: complete(c.plain, p, m) for m in order}
            assert answer(want["tiny"])[0] != answer(want[ADAPTER])[0], "the adapter changes the answer"
            first = complete(c.on, p, order[0])
            same(first, want[order[0]])
            stored_remotely(c, p, len(p), lora_request=lora(c, order[0]))
            second = complete(server, p, order[1])
            same(second, want[order[1]])
            assert cached(second) == 0, f"{order[1]} after {order[0]} on {server.log_path}"
            again = complete(server, p, order[0])
            same(again, want[order[0]])
            assert cached(again) == len(p) - 1, server.log_path


def tensor(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 512, generator=g) * 0.5


def embeds(n: int, seed: int) -> str:
    buf = io.BytesIO()
    torch.save(tensor(n, seed), buf)
    return base64.b64encode(buf.getvalue()).decode()


def chat_with_embeds(server: VLLMServer, data: str) -> dict:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Read this:"},
                                          {"type": "prompt_embeds", "data": data}]}]
    return post(server, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 6})


@pytest.mark.vllm
def test_identity_two_prompt_embedding_inputs_of_one_length_answer_as_plain_vllm(cluster: Cluster) -> None:
    c = cluster
    one, two = embeds(400, 1), embeds(400, 2)
    want = [chat_with_embeds(c.plain, d) for d in (one, two)]
    assert answer(want[0])[0] != answer(want[1])[0], "the two inputs give different answers"
    for server in (c.on, c.off):
        for d, w in zip((one, two), want, strict=True):
            same(chat_with_embeds(server, d), w)
    # A completion of embeddings alone is keyed by them: the same input hits, another does not.
    want_c = [post(c.plain, "/v1/completions", {"model": "tiny", "prompt_embeds": d, "max_tokens": 6})
              for d in (one, two)]
    same(post(c.on, "/v1/completions", {"model": "tiny", "prompt_embeds": one, "max_tokens": 6}), want_c[0])
    stored_remotely(c, None, 400, prompt_embeds=tensor(400, 1))
    again = post(c.off, "/v1/completions", {"model": "tiny", "prompt_embeds": one, "max_tokens": 6})
    same(again, want_c[0])
    assert cached(again) == 399
    other = post(c.off, "/v1/completions", {"model": "tiny", "prompt_embeds": two, "max_tokens": 6})
    same(other, want_c[1])
    assert cached(other) == 0


@pytest.mark.vllm
def test_identity_a_lora_request_disaggregates_to_plain_vllms_answer(cluster: Cluster) -> None:
    """Prefiller and decoder both serve the adapter; the proxy's decode leg carries it: the answer is
    the adapter's (a decoder that decoded with the base model, or loaded the base model's KV,
    would differ), and the decoder loaded the prompt instead of computing it."""
    c = cluster
    lora = flags(c.lora, prefix_cache=True)
    p_ = Prefiller(str(c.model), c.log_dir, "1", c.conf, server={"extra_args": lora})
    d_ = Decoder(str(c.model), c.log_dir, "0", c.conf, server={"extra_args": lora})
    try:
        p_.start()
        d_.start()
        p_.wait_ready(timeout=600)
        d_.wait_ready(timeout=600)
        with running_proxy([p_], [d_]) as url:
            for model in (ADAPTER, "tiny"):
                p = prompt(500)
                want = complete(c.plain, p, model)
                src0 = source_tokens(d_)
                same(complete(url, p, model), want)
                loaded0 = src0.get("external_kv_transfer", 0)
                until(lambda n=loaded0: source_tokens(d_).get("external_kv_transfer", 0) > n,
                      30, "the decoder to count the loaded prompt", every=0.2)
                src = source_tokens(d_)
                assert src["external_kv_transfer"] - loaded0 == len(p)
                assert src.get("local_compute", 0) - src0.get("local_compute", 0) <= 1  # the first token only
    finally:
        p_.stop()
        d_.stop()
