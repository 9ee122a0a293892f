"""MLA (DeepSeek-V2 architecture) on real vLLM CPU servers (CPU_MLA backend, block size 16).

The servers run in float32: the random-weight model's next-token distribution is nearly flat, so
the rounding differences between TP=2 and TP=1 (or between a loaded prefix and a computed one) flip
bf16 greedy tokens. In float32 the same-TP path is still bit-identical to a plain instance; across
TP sizes tokens are identical and logprobs agree to 1e-3. vLLM CPU's rotary op is off for MLA (it
rotates MLA's strided query wrongly, by the batch's token count: launcher/vllm_proc.py
cpu_mla_args), so the prefill is causal (`prefix_drift` 0.0) and a prefix loaded from a tier
gives the answer of the prompt computed whole (docs/pd.md).

The tiny DeepSeek model's KV is one 576-wide latent per token per layer. A prefiller sends it to a
decoder (TP 1 -> TP 1): greedy ids and logprobs equal one plain instance, the decoder computes one
prompt token per request, and every pd_buffer page is free at the end. A kv_both server's CPU tier
serves a shared prefix (vLLM CPU turns its own prefix cache off for MLA). A TP=2 prefiller feeds the
TP=1 decoder (hetero TP: one rank's copy of the latent travels). A second kv_both server fetches a
prompt's latent chunks from the first over NIXL (P2P through a controller). The four PD servers load
together (about 4 minutes on 2 cores); the two kv_both servers load together after them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.common.netutil import free_port
from kvferry.launcher import tiny_model
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.vllm_proc import VLLMServer
from kvferry.testing.store_servers import ControllerProcess
from kvferry.testing.vllm_servers import OffloadServer, p2p_keys
from tests.mla_helpers import FP32, answers_match, mla_fingerprint, prefix_drift
from tests.pd_helpers import (
    RawPeer,
    completion,
    disagg,
    plain,
    serving,
    source_tokens,
    tier_value,
    tokens_and_logprobs,
)
from tests.polling import until

VOCAB_LO, VOCAB_HI = 10, 4000


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


@pytest.fixture(scope="module")
def deepseek_model() -> Path:
    return tiny_model.ensure(arch="deepseek")


@pytest.fixture(scope="module")
def mla_pd(deepseek_model: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Prefiller, Decoder, VLLMServer, Prefiller]]:
    """A prefiller (core 0), a decoder (core 1), a plain instance (core 0) of the tiny DeepSeek, and
    a TP=2 prefiller (cores 0 and 1) for the hetero-TP test."""
    tmp = tmp_path_factory.mktemp("mla")
    p = Prefiller(str(deepseek_model), log_dir, "0", tmp, server={"extra_args": FP32})
    d = Decoder(str(deepseek_model), log_dir, "1", tmp, server={"extra_args": FP32}, pd_kv_ready_timeout=20.0)
    port = free_port()
    ref = VLLMServer(str(deepseek_model), port, log_dir / f"vllm-mla-plain-{port}.log", cores="0", extra_args=FP32)
    p2 = Prefiller(str(deepseek_model), log_dir, "0|1", tmp,
                   server={"extra_args": FP32 + ["--tensor-parallel-size", "2"]})
    with serving(p, d, ref, p2):
        yield p, d, ref, p2


@pytest.fixture(scope="module")
def mla_share(deepseek_model: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[OffloadServer, OffloadServer, ControllerProcess]]:
    """Two kv_both servers with a CPU tier each, sharing them through a controller (P2P over NIXL)."""
    work = tmp_path_factory.mktemp("mla-share")
    controller = ControllerProcess(work)
    servers: list[OffloadServer] = []
    try:
        for name, core in (("instance_1", "1"), ("instance_2", "0")):
            servers.append(OffloadServer(
                str(deepseek_model), log_dir, core, work, server={"extra_args": FP32}, local_cpu=True,
                max_local_cpu_size=0.1, blocking_timeout_secs=3.0, **p2p_keys(), **controller.worker_keys(name),
            ))
            servers[-1].start()
        for s in servers:
            s.wait_ready(timeout=600)
        yield servers[0], servers[1], controller
    finally:
        for s in servers:
            s.stop()
        controller.stop()


@pytest.fixture(scope="module")
def mla_offload(mla_share: tuple[OffloadServer, OffloadServer, ControllerProcess]) -> OffloadServer:
    """The first of the two: a kv_both server with a CPU tier, in float32."""
    return mla_share[0]


@pytest.mark.vllm
def test_mla_1p1d_same_tokens_and_logprobs_as_one_plain_instance(mla_pd, deepseek_model: Path) -> None:
    p, d, ref, _ = mla_pd
    assert sum(source_tokens(d).values()) == 0
    prompts = [prompt(n, seed=n) for n in (5, 255, 256, 257, 700)]
    for pr in prompts:
        want = plain(ref, pr, 6)
        toks, lps, params = disagg(p, d, pr, 6)
        assert toks == want[0], f"{len(pr)}-token prompt: tokens differ"
        assert lps == want[1], f"{len(pr)}-token prompt: logprobs differ"
        assert params["num_tokens"] == len(pr)
    got = source_tokens(d)
    # The decoder's prompt is the prompt and the first token: it computed that one token per request,
    # the prompt's KV came over NIXL.
    assert got.get("local_compute", 0) == len(prompts), got
    assert got.get("external_kv_transfer", 0) == sum(map(len, prompts)), got
    peer = RawPeer(d, mla_fingerprint(deepseek_model), name="mla-test-peer")
    try:
        assert peer.fully_free(), "pd_buffer pages still held after all requests finished"
    finally:
        peer.close()


@pytest.mark.vllm
def test_mla_fingerprint_refuses_a_gqa_sender_naming_both_sides(mla_pd, tiny_model_path: Path) -> None:
    """A Llama (K/V heads) sender at an MLA decoder is refused at the handshake, both sides named."""
    from tests.pd_helpers import tiny_fingerprint
    d = mla_pd[1]
    with pytest.raises(AssertionError, match="kv_kind: 'mha' != 'mla'|kv_kind: 'mla' != 'mha'"):
        RawPeer(d, tiny_fingerprint(tiny_model_path), name="gqa-test-peer")


@pytest.mark.vllm
def test_mla_hetero_tp2_prefiller_to_tp1_decoder(mla_pd, deepseek_model: Path) -> None:
    """P TP=2 -> D TP=1: the latent is the same on both prefiller ranks, so rank 0's copy travels and
    rank 1 sends nothing; the decoder's answer equals one plain TP=1 instance."""
    _, d, ref, p2 = mla_pd
    before = source_tokens(d)
    prompts = [prompt(n, seed=700 + n) for n in (9, 300)]
    answers = [(disagg(p2, d, pr, 5)[:2], plain(ref, pr, 5)) for pr in prompts]
    got = source_tokens(d)
    assert got.get("local_compute", 0) - before.get("local_compute", 0) == len(prompts), (before, got)
    assert (got.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
            == sum(map(len, prompts))), (before, got)
    peer = RawPeer(d, mla_fingerprint(deepseek_model), name="mla-hetero-test-peer")
    try:
        assert peer.fully_free(), "pd_buffer pages still held after the hetero-TP requests"
    finally:
        peer.close()
    answers_match(answers)


@pytest.mark.vllm
def test_mla_offload_cpu_tier_serves_a_prefix_with_the_same_answer(mla_offload: OffloadServer, mla_pd) -> None:
    """A prompt computed whole stores its chunks (two full, one partial); asked again, all but its
    last token come from the CPU tier (vLLM CPU has no prefix cache for MLA) and the answer is the same."""
    off = mla_offload
    a = prompt(600, seed=41)
    first = tokens_and_logprobs(completion(off, a, 6))
    until(lambda: tier_value(off, "kvferry:cache_chunks", "cpu") >= 3, 30, "the prompt's three chunks in the CPU tier")
    src0 = source_tokens(off)
    again = tokens_and_logprobs(completion(off, a, 6))
    src = source_tokens(off)
    assert src.get("external_kv_transfer", 0) - src0.get("external_kv_transfer", 0) == len(a) - 1, (src0, src)
    assert src.get("local_compute", 0) - src0.get("local_compute", 0) == 1, (src0, src)
    assert tokens_and_logprobs(completion(off, a, 6)) == again, "a second load of the same prefix answers otherwise"
    # The loaded answer computes the prompt's last token alone (vLLM's decode path); the first answer
    # computed it in one prefill with the rest: the same tokens, logprobs within float32's rounding.
    assert again[0] == first[0]
    assert max(abs(x - y) for x, y in zip(again[1], first[1], strict=True)) < 1e-3


@pytest.mark.vllm
def test_mla_prefill_is_causal_with_vllm_cpus_rotary_op_off(mla_pd) -> None:
    """VLLMServer starts vLLM CPU with its rotary op off for an MLA model; with it on, a 40-token
    prefix's prompt logprobs move by 0.4 when one token follows (its result depends on the batch)."""
    ref = mla_pd[2]
    assert "-rotary_embedding" in " ".join(ref.args), ref.args
    assert prefix_drift(ref, prompt(40, seed=43)) == 0.0


@pytest.mark.vllm
def test_mla_p2p_second_instance_loads_the_prefix_from_the_first(mla_share) -> None:
    """Instance 2 fetches a prompt's latent chunks from instance 1 over NIXL (P2P, through the
    controller's index) and answers exactly as instance 1 does from its own CPU tier: the same bytes
    on the same path (all but the last token loaded, that one computed)."""
    one, two, controller = mla_share
    p = prompt(600, seed=61)
    completion(one, p, 1)  # computed whole: three chunks (the last partial) into instance 1's CPU tier

    def holders() -> dict[str, int]:
        r = httpx.post(controller.url + "/lookup", json={"tokens": p}, timeout=30)
        assert r.status_code == 200, r.text
        return {k: v[1] for k, v in r.json()["layout_info"].items()}
    until(lambda: holders() == {"instance_1": len(p)}, 30, "the controller's index lists instance 1")
    src0 = source_tokens(two)
    got = tokens_and_logprobs(completion(two, p, 6))
    src = source_tokens(two)
    assert src.get("external_kv_transfer", 0) - src0.get("external_kv_transfer", 0) == len(p) - 1, (src0, src)
    assert src.get("local_compute", 0) - src0.get("local_compute", 0) == 1, (src0, src)
    assert "chunks: 3 from p2p" in two.log_path.read_text(errors="replace")
    want = tokens_and_logprobs(completion(one, p, 6))  # instance 1 loads the same chunks from its CPU tier
    assert "chunks: 3 from cpu" in one.log_path.read_text(errors="replace").rsplit("Retrieved", 1)[1]
    assert got == want


@pytest.mark.vllm
def test_prefix_drift_measures_causality_the_llama_gives_zero(plain_vllm: VLLMServer) -> None:
    """The check the MLA offload test leans on: a causal model's prefix logprobs do not move when a
    token follows (exactly 0.0 for the tiny Llama on vLLM CPU)."""
    assert prefix_drift(plain_vllm, prompt(40, seed=43)) == 0.0
