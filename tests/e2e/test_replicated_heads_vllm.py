"""Replicated KV heads across TP sizes on real vLLM CPU servers (docs/pd.md, "Different TP with K/V
heads"): the tiny Llama with one KV head (`make-tiny-model --kv-heads 1`, 8 attention heads), so at
TP=2 each rank holds a copy of the same head. P TP=2 -> D TP=1: the head's two holders are prefiller
ranks 0 and 1, and only rank 0 (`d % holders` for decoder rank 0) writes; rank 1 sends nothing and
never dials the decoder. P TP=1 -> D TP=2: the one prefiller rank writes the whole head into each
decoder rank's own pages (each rank needs its copy in its own memory). Each time
the decoder computes one prompt token per request, its pd_buffers are free at the end, and greedy
ids equal one plain instance of the decoder's TP size, logprobs within 1e-3 (float32).

Each test's three servers (one or two of them TP=2) load together: about 2 minutes each on 2 cores."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.vllm_proc import VLLMServer
from tests.pd_helpers import disagg, every_rank_free, plain, same_answers, serving, source_tokens, tiny_fingerprint
from tests.polling import until

FP32 = ["--dtype", "float32"]
TP2 = FP32 + ["--tensor-parallel-size", "2"]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def replicated_fp(model: Path, tp_size: int) -> m.LayoutFingerprint:
    """What each rank of a decoder of `tp_size` says for the one-head model in float32: one KV head per
    rank, one in all (at TP=2 both ranks hold the same head), pages of a whole one-head chunk."""
    fp = tiny_fingerprint(model)
    assert fp.num_kv_heads == 1, fp
    return msgspec.structs.replace(fp, dtype="float32", page_bytes=fp.page_bytes * 2, tp_size=tp_size,
                                   total_kv_heads=1)


def sends(p: VLLMServer, tids: list[str]) -> list[int]:
    """How many (prefiller rank, decoder rank) sends each transfer took: each logs one "stored" line."""
    log = p.log_path.read_text(errors="replace")
    return [log.count(f"transfer {tid}: stored ") for tid in tids]


def run_and_check(p: Prefiller, d: Decoder, ref: VLLMServer, model: Path, seed: int, name: str) -> list[int]:
    """Disaggregated answers equal the plain instance's, the decoder computed one token per prompt and
    holds no page after; returns how many (prefiller rank, decoder rank) sends each prompt took."""
    prompts = [prompt(n, seed=seed + n) for n in (9, 300)]
    answers, tids = [], []
    for pr in prompts:
        toks, lps, params = disagg(p, d, pr, 5)
        answers.append(((toks, lps), plain(ref, pr, 5)))
        tids.append(params["transfer_id"])
    got = source_tokens(d)
    assert got.get("local_compute", 0) == len(prompts), got
    assert got.get("external_kv_transfer", 0) == sum(map(len, prompts)), got
    # The decoder's ranks accept a peer saying one head per rank and one in all (at TP=2: replicated),
    # and every page of every rank is free.
    every_rank_free(d, replicated_fp(model, len(d.init_ports)), name)
    print(f"{name}: largest logprob difference from the plain instance {same_answers(answers):.3g}")
    until(lambda: all(sends(p, tids)), 60, "the prefiller's stored lines")
    time.sleep(1)  # a sleep (window): a later send's line, if there is one, comes by now
    return sends(p, tids)


def receivers_dialed(p: VLLMServer) -> int:
    return p.log_path.read_text(errors="replace").count("connected to receiver ")


@pytest.fixture  # one test each: its servers stop before the next test starts its own
def replicated_tp2_to_tp1(tiny_kv1_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[tuple[Prefiller, Decoder, VLLMServer]]:
    model = str(tiny_kv1_model_path)
    tmp = tmp_path_factory.mktemp("replicated-tp2")
    p2 = Prefiller(model, log_dir, "0|1", tmp, server={"extra_args": TP2})
    d = Decoder(model, log_dir, "1", tmp, server={"extra_args": FP32}, pd_kv_ready_timeout=30.0)
    port = free_port()
    ref = VLLMServer(model, port, log_dir / f"vllm-replicated-plain-{port}.log", cores="0", extra_args=FP32)
    with serving(p2, d, ref):
        yield p2, d, ref


@pytest.mark.vllm
@pytest.mark.slow  # a TP=2 server: ~2 minutes on 2 cores
def test_replicated_heads_hetero_tp2_prefiller_to_tp1_decoder(replicated_tp2_to_tp1, tiny_kv1_model_path: Path
                                                              ) -> None:
    p2, d, ref = replicated_tp2_to_tp1
    got = run_and_check(p2, d, ref, tiny_kv1_model_path, 1200, "replicated-tp2-test-peer")
    # Only prefiller rank 0 sends the one head to decoder rank 0; rank 1 (its other holder) sends nothing
    # and never dials the receiver (the 8-head model's TP=2 prefiller sends each prompt from both ranks,
    # each its half of the heads).
    assert got == [1, 1], f"sends per prompt: {got}"
    assert receivers_dialed(p2) == 1


@pytest.fixture  # one test each: its servers stop before the next test starts its own
def replicated_tp1_to_tp2(tiny_kv1_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> Iterator[tuple[Prefiller, Decoder, VLLMServer]]:
    model = str(tiny_kv1_model_path)
    tmp = tmp_path_factory.mktemp("replicated-tp1-tp2")
    p = Prefiller(model, log_dir, "0", tmp, server={"extra_args": FP32})
    d = Decoder(model, log_dir, "0|1", tmp, server={"extra_args": TP2}, tp_size=2, pd_kv_ready_timeout=30.0)
    port = free_port()
    ref = VLLMServer(model, port, log_dir / f"vllm-replicated-tp2-plain-{port}.log", cores="0|1", extra_args=TP2)
    with serving(p, d, ref):
        yield p, d, ref


@pytest.mark.vllm
@pytest.mark.slow  # two TP=2 servers: ~2 minutes on 2 cores
def test_replicated_heads_hetero_tp1_prefiller_to_tp2_decoder(replicated_tp1_to_tp2, tiny_kv1_model_path: Path
                                                              ) -> None:
    p, d, ref = replicated_tp1_to_tp2
    assert len(d.init_ports) == 2
    got = run_and_check(p, d, ref, tiny_kv1_model_path, 1250, "replicated-tp1-tp2-test-peer")
    # The one prefiller rank writes the whole head into each decoder rank's own pages: one send each.
    assert got == [2, 2], f"sends per prompt: {got}"
    assert receivers_dialed(p) == 2
