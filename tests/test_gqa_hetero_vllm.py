"""A GQA model (the tiny Llama, 8 KV heads) from a TP=2 prefiller to a TP=1 decoder on real vLLM
CPU servers: each prefiller rank slices its 4 heads into the decoder's pages, the decoder reads the
transfer once both ranks notified (docs/pd.md, "Different TP with K/V heads"). The decoder computes
one prompt token per request, its pd_buffer is free at the end, and greedy ids equal one plain TP=1
instance, logprobs within 1e-3 (float32: across TP sizes the sums are rounded differently).

One TP=2 and two TP=1 servers load together: about 4 minutes on 2 cores."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvferry.common.netutil import free_port
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.vllm_proc import VLLMServer
from tests.pd_helpers import RawPeer, disagg, plain, source_tokens, tiny_fingerprint

FP32 = ["--dtype", "float32"]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def gqa_tp2_to_tp1(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[Prefiller, Decoder, VLLMServer]]:
    tmp = tmp_path_factory.mktemp("gqa-tp2")
    p2 = Prefiller(str(tiny_model_path), log_dir, "0|1", tmp,
                   server={"extra_args": FP32 + ["--tensor-parallel-size", "2"]})
    d = Decoder(str(tiny_model_path), log_dir, "1", tmp, server={"extra_args": FP32}, pd_kv_ready_timeout=30.0)
    port = free_port()
    ref = VLLMServer(str(tiny_model_path), port, log_dir / f"vllm-gqa-plain-{port}.log", cores="0", extra_args=FP32)
    servers = [p2, d, ref]
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_ready(timeout=600)
        yield p2, d, ref
    finally:
        for s in servers:
            s.stop()


@pytest.mark.vllm
@pytest.mark.slow  # a TP=2 server: ~4 minutes on 2 cores
def test_gqa_hetero_tp2_prefiller_to_tp1_decoder(gqa_tp2_to_tp1, tiny_model_path: Path) -> None:
    p2, d, ref = gqa_tp2_to_tp1
    prompts = [prompt(n, seed=900 + n) for n in (9, 300)]
    answers = [(disagg(p2, d, pr, 5)[:2], plain(ref, pr, 5)) for pr in prompts]
    got = source_tokens(d)
    assert got.get("local_compute", 0) == len(prompts), got
    assert got.get("external_kv_transfer", 0) == sum(map(len, prompts)), got
    fp = tiny_fingerprint(tiny_model_path)
    fp = msgspec.structs.replace(fp, dtype="float32", page_bytes=fp.page_bytes * 2)
    peer = RawPeer(d, fp, name="gqa-hetero-test-peer")
    try:
        assert peer.fully_free(), "pd_buffer pages still held after the hetero-TP requests"
    finally:
        peer.close()
    for i, ((toks, lps), (want_toks, want_lps)) in enumerate(answers):
        assert toks == want_toks, f"prompt {i}: tokens differ"
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-3, f"prompt {i}: logprobs differ"
