"""A GQA model (the tiny Llama, 8 KV heads) across TP sizes on real vLLM CPU servers (docs/pd.md,
"Different TP with K/V heads"). P TP=2 -> D TP=1: each prefiller rank slices its 4 heads into the
decoder's pages, the decoder reads the transfer once both ranks notified. P TP=1 -> D TP=2: the one
prefiller rank writes heads 0-3 into decoder rank 0's pages and 4-7 into rank 1's. Each time the
decoder computes one prompt token per request, its pd_buffers are free at the end, and greedy ids
equal one plain instance of the decoder's TP size, logprobs within 1e-3 (float32: across TP sizes
the sums are rounded differently).

Each test's three servers (one or two of them TP=2) load together: 2-4 minutes on 2 cores."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvferry.common.netutil import free_port
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.vllm_proc import VLLMServer
from tests.pd_helpers import (
    RawPeer,
    disagg,
    every_rank_free,
    plain,
    same_answers,
    serving,
    source_tokens,
    tiny_fingerprint,
)

FP32 = ["--dtype", "float32"]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


@pytest.fixture  # one test each: its servers stop before the next test starts its own
def gqa_tp2_to_tp1(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[Prefiller, Decoder, VLLMServer]]:
    tmp = tmp_path_factory.mktemp("gqa-tp2")
    p2 = Prefiller(str(tiny_model_path), log_dir, "0|1", tmp,
                   server={"extra_args": FP32 + ["--tensor-parallel-size", "2"]})
    d = Decoder(str(tiny_model_path), log_dir, "1", tmp, server={"extra_args": FP32}, pd_kv_ready_timeout=30.0)
    port = free_port()
    ref = VLLMServer(str(tiny_model_path), port, log_dir / f"vllm-gqa-plain-{port}.log", cores="0", extra_args=FP32)
    with serving(p2, d, ref):
        yield p2, d, ref


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
    same_answers(answers)


@pytest.fixture  # one test each: its servers stop before the next test starts its own
def gqa_tp1_to_tp2(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[Prefiller, Decoder, VLLMServer]]:
    tmp = tmp_path_factory.mktemp("gqa-tp1-tp2")
    tp2 = FP32 + ["--tensor-parallel-size", "2"]
    p = Prefiller(str(tiny_model_path), log_dir, "0", tmp, server={"extra_args": FP32})
    d = Decoder(str(tiny_model_path), log_dir, "0|1", tmp, server={"extra_args": tp2}, tp_size=2,
                pd_kv_ready_timeout=30.0)
    port = free_port()
    ref = VLLMServer(str(tiny_model_path), port, log_dir / f"vllm-gqa-tp2-plain-{port}.log", cores="0|1",
                     extra_args=tp2)
    with serving(p, d, ref):
        yield p, d, ref


@pytest.mark.vllm
@pytest.mark.slow  # two TP=2 servers: ~4 minutes on 2 cores
def test_gqa_hetero_tp1_prefiller_to_tp2_decoder(gqa_tp1_to_tp2, tiny_model_path: Path) -> None:
    p, d, ref = gqa_tp1_to_tp2
    assert len(d.init_ports) == 2
    prompts = [prompt(n, seed=950 + n) for n in (9, 300)]
    answers = [(disagg(p, d, pr, 5)[:2], plain(ref, pr, 5)) for pr in prompts]
    got = source_tokens(d)
    assert got.get("local_compute", 0) == len(prompts), got
    assert got.get("external_kv_transfer", 0) == sum(map(len, prompts)), got
    fp = tiny_fingerprint(tiny_model_path)
    fp = msgspec.structs.replace(fp, dtype="float32", tp_size=2, num_kv_heads=fp.num_kv_heads // 2,
                                 page_bytes=fp.page_bytes)  # half the heads in float32: the same bytes
    every_rank_free(d, fp, "gqa-tp2-test-peer")
    same_answers(answers)
