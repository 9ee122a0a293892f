"""MLA from a TP=1 prefiller to a TP=2 decoder on real vLLM CPU servers (``--tensor-parallel-size 2``,
one core per rank): the prefiller's one rank writes its latent to both decoder ranks (the latent
is the same on every rank). Greedy ids and logprobs equal one plain TP=2 instance, the decoder
computes one prompt token per request, and both decoder ranks' pd_buffers are free at the end.
Float32, tokens identical and logprobs within 1e-3 across the TP sizes (see test_mla_vllm.py).

Two TP=2 servers and one TP=1 server load together: about 4 minutes on 2 cores."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvferry.common.netutil import free_port
from kvferry.launcher import tiny_model
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.vllm_proc import VLLMServer
from tests.mla_helpers import FP32, answers_match, mla_fingerprint
from tests.pd_helpers import disagg, every_rank_free, plain, serving, source_tokens

TP2 = ["--dtype", "float32", "--tensor-parallel-size", "2"]
CORES = "0|1"


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def mla_tp1_to_tp2(log_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[Prefiller, Decoder, VLLMServer, Path]]:
    model = tiny_model.ensure(arch="deepseek")
    tmp = tmp_path_factory.mktemp("mla-tp2")
    p = Prefiller(str(model), log_dir, "0", tmp, server={"extra_args": FP32})
    d = Decoder(str(model), log_dir, CORES, tmp, server={"extra_args": TP2}, tp_size=2, pd_kv_ready_timeout=30.0)
    port = free_port()
    ref = VLLMServer(str(model), port, log_dir / f"vllm-tp2-plain-{port}.log", cores=CORES, extra_args=TP2)
    with serving(p, d, ref):
        yield p, d, ref, model


@pytest.mark.vllm
@pytest.mark.slow  # a TP=2 server: ~4 minutes on 2 cores
def test_mla_hetero_tp1_prefiller_to_tp2_decoder(mla_tp1_to_tp2) -> None:
    p, d, ref, model = mla_tp1_to_tp2
    assert d.disagg_spec()["receiver_init_port"] == d.init_ports and len(d.init_ports) == 2
    prompts = [prompt(n, seed=800 + n) for n in (7, 300)]
    answers = [(disagg(p, d, pr, 5)[:2], plain(ref, pr, 5)) for pr in prompts]
    got = source_tokens(d)
    assert got.get("local_compute", 0) == len(prompts), got
    assert got.get("external_kv_transfer", 0) == sum(map(len, prompts)), got
    fp = msgspec.structs.replace(mla_fingerprint(model), tp_size=2)
    every_rank_free(d, fp, "tp2-test-peer")
    answers_match(answers)
