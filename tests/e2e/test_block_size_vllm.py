"""Different vLLM block sizes on real vLLM CPU servers (docs/pd.md, "Why not on vLLM CPU"): vLLM
CPU 0.32 starts the tiny Llama with `--block-size 32` (16 fails: its attention takes multiples of
32 only), but its blocks are not token-addressable (K is stored transposed or VNNI-packed per block
size), so kvferry refuses a prefiller of block size 32 feeding a decoder of 128 at the handshake,
naming the fix, and the decoder recomputes: the answer is still a plain instance's, no wrong token,
no page held.

Three servers (one the shared plain instance): 121 s here on 2 cores, 103 s of it starting them
(`make test-slow`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.vllm_proc import VLLMServer
from tests.pd_helpers import RawPeer, disagg, plain, serving, source_tokens, tiny_fingerprint


@pytest.fixture(scope="module")
def p32_d128(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Prefiller, Decoder]]:
    tmp = tmp_path_factory.mktemp("bs32-128")
    p = Prefiller(str(tiny_model_path), log_dir, "0", tmp, server={"extra_args": ["--block-size", "32"]})
    d = Decoder(str(tiny_model_path), log_dir, "1", tmp, pd_kv_ready_timeout=5.0)  # vLLM CPU's default: 128
    with serving(p, d):
        yield p, d


@pytest.mark.vllm
@pytest.mark.slow  # three vLLM servers: 121 s on 2 cores
def test_block_size_32_prefiller_to_128_decoder_on_vllm_cpu_is_refused_and_recomputed(
        p32_d128, plain_vllm: VLLMServer, tiny_model_path: Path) -> None:
    p, d = p32_d128
    rng = random.Random(32)
    pr = [rng.randrange(10, 4000) for _ in range(300)]
    toks, lps, _ = disagg(p, d, pr, 5)
    # The decoder's tokens are a plain instance's (block 128) continuing the prefiller's first token.
    want_toks, want_lps = plain(plain_vllm, pr + toks[:1], 4)
    assert toks[1:] == want_toks
    assert max(abs(a - b) for a, b in zip(lps[1:], want_lps, strict=True)) < 1e-3
    got = source_tokens(d)
    assert got.get("external_kv_transfer", 0) == 0 and got.get("local_compute", 0) == len(pr) + 1, got
    log = p.log_path.read_text(errors="replace")
    assert "block_size: 128 != 32" in log and "same --block-size" in log and "vLLM CPU" in log  # receiver first
    peer = RawPeer(d, tiny_fingerprint(tiny_model_path), name="block-size-test-peer")
    try:
        assert peer.fully_free(), "pd_buffer pages held after a refused transfer"
    finally:
        peer.close()
