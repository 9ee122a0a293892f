"""Different vLLM block sizes on prefiller and decoder for a K/V-head (GQA) model in vLLM's GPU
(flash) layouts, with real NIXL and no vLLM (docs/pd.md, "Different block sizes"): the prefiller
writes each decoder page in the decoder's block size (byte runs, kernels/head_map.py), so every
(layer, token, head) lands where the decoder's paged cache of the other block size expects it, in
both directions, with and without an early grant, also when the TP sizes differ too; every page
comes back. What cannot work is still refused at the handshake, naming the fix: vLLM CPU's
layout above all, whose blocks are not token-addressable (shown with vLLM's own cache write)."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("nixl")

from kvferry.buffer import peering  # noqa: E402
from kvferry.common.wire import messages as m  # noqa: E402
from tests.hetero_helpers import HEAD, LAYERS, hetero, run_prompt  # noqa: E402
from tests.polling import until  # noqa: E402


@pytest.mark.parametrize("bs_src,bs_dst", [(16, 32), (32, 16)])
@pytest.mark.parametrize("layout", ["flash_nhd", "flash_hnd"])
def test_hetero_block_size_same_tp_every_token_lands_in_the_decoders_blocks(bs_src: int, bs_dst: int,
                                                                             layout: str) -> None:
    """P block 16 -> D block 32 and back, TP 1 both sides: a prompt of 2 full chunks and a last one
    of 13 tokens (under one block on either side: the sides' partial chunks have different layer
    strides), an early grant and a piece while it computes."""
    with hetero(1, 1, 4, layout, bs_src=bs_src, bs_dst=bs_dst) as h:
        assert h.producers[0].fp.block_size == bs_src and h.consumers[0].fp.block_size == bs_dst
        n = 77
        src_blocks, dst_blocks = run_prompt(h, f"B{bs_src}-{bs_dst}", n)
        assert h.landed(src_blocks, dst_blocks, n - 1) == 2 * 2 * (n - 1) * 4  # K/V, layers, tokens, heads
        until(h.all_free, 5, "every page back on both sides")
        p = h.producers[0]
        assert not p.counters.failures and p.counters.early == 1
        # Every head vector of the prompt's tokens once, no block padding: runs of the real tokens.
        assert p.sender.counters.bytes == n * LAYERS * 2 * 4 * HEAD * 2


@pytest.mark.parametrize("bs_src,bs_dst", [(16, 32), (32, 16), (16, 16)])
def test_hetero_block_size_without_an_early_grant_still_writes_the_decoders_blocks(bs_src: int,
                                                                                    bs_dst: int) -> None:
    """No early grant (the pages are reserved when the prompt ended): the decoder's block size,
    known only after the handshake, still decides the runs (the same block size: whole chunks)."""
    with hetero(1, 1, 4, "flash_hnd", bs_src=bs_src, bs_dst=bs_dst) as h:
        n = 45
        src_blocks, dst_blocks = run_prompt(h, f"N{bs_src}-{bs_dst}", n, early=False)
        assert h.landed(src_blocks, dst_blocks, n - 1) == 2 * 2 * (n - 1) * 4
        until(h.all_free, 5, "every page back on both sides")
        assert h.producers[0].counters.early == 0


@pytest.mark.parametrize("src_tp,dst_tp,bs_src,bs_dst", [(2, 1, 16, 32), (1, 2, 32, 16)])
def test_hetero_block_size_and_tp_both_differ_byte_exact(src_tp: int, dst_tp: int, bs_src: int,
                                                         bs_dst: int) -> None:
    """Block size and TP size differ at once: each decoder rank gets exactly its heads in its
    block size (P TP=2 block 16 -> D TP=1 block 32; P TP=1 block 32 -> D TP=2 block 16)."""
    with hetero(src_tp, dst_tp, 4, "flash_nhd", bs_src=bs_src, bs_dst=bs_dst) as h:
        n = 70
        src_blocks, dst_blocks = run_prompt(h, f"T{src_tp}{dst_tp}", n)
        assert h.landed(src_blocks, dst_blocks, n - 1) == 2 * 2 * (n - 1) * 4
        until(h.all_free, 5, "every page back on all ranks")


def fp(**over) -> m.LayoutFingerprint:
    base = dict(model="x", dtype="bfloat16", num_layers=2, num_kv_heads=4, head_size=64, block_size=16,
                kv_layout="flash_nhd:[2,blocks,block_size,kv_heads,head_size]", chunk_format="block", chunk_size=256,
                tp_size=1, page_bytes=100, total_kv_heads=4, slices=True)
    return m.LayoutFingerprint(**{**base, **over})


def test_hetero_block_size_handshake_accepts_a_mapping_sender_and_refuses_what_cannot_work() -> None:
    roles, names = ("receiver", "sender"), ("d", "p")
    dec = fp(block_size=32, slices=False)
    assert peering.layout_error(roles, names, dec, fp()) is None  # 16 -> 32
    assert peering.layout_error(("sender", "receiver"), ("p", "d"), fp(block_size=32), fp(slices=False)) is None
    for sender, why in ((fp(slices=False), "a sender that does not map blocks"),
                        (fp(chunk_size=48, block_size=16), "chunk_size 48 is no multiple of 32")):
        err = peering.layout_error(roles, names, msgspec.structs.replace(dec, chunk_size=sender.chunk_size), sender)
        assert err and "block_size: 32 != 16" in err and "same --block-size" in err, why
    # vLLM CPU's layout: its blocks are not token-addressable (see the next test).
    cpu = "cpu:[blocks,kv_heads,block_size,2*head_size]"
    err = peering.layout_error(roles, names, fp(block_size=32, slices=False, kv_layout=cpu), fp(kv_layout=cpu))
    assert err and "block_size: 32 != 16" in err and "vLLM CPU" in err and "same --block-size" in err
    # MLA: the latent is never mapped (vLLM CPU forces 16 on both sides anyway).
    mla = fp(kv_kind="mla", num_kv_heads=1, total_kv_heads=1, head_size=576, kv_layout="mla", slices=False)
    err = peering.layout_error(roles, names, msgspec.structs.replace(mla, block_size=32), mla)
    assert err and "block_size: 32 != 16" in err and "MLA" in err
    # P2P never maps blocks: its chunks are read whole.
    assert peering.layout_error(("reader", "holder"), ("a", "b"), dec, fp())


def test_hetero_block_size_is_refused_for_vllm_cpu_whose_block_interior_depends_on_the_block_size() -> None:
    """Why vLLM CPU's layout is refused: its attention writes K transposed (or VNNI-packed in
    16-token tiles) within each block, so where a token's K lies depends on the block size; only
    whole blocks of one size mean the same thing on both sides. Written with vLLM's own op."""
    ops = pytest.importorskip("vllm._custom_ops")
    import torch
    heads, dim, n = 1, 64, 32
    key = torch.arange(n * dim, dtype=torch.float32).reshape(n, heads, dim)
    placed = []
    for bs in (32, 128):
        kv = torch.zeros(1, heads, bs, 2 * dim)
        k, v = kv.view(1, heads, 2 * bs, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, torch.zeros_like(key), k, v, torch.arange(n), "vec")
        placed.append(kv.view(-1)[:n * dim])
        # Token 1's K is not the row after token 0's: the token rows kvferry's cpu layout names.
        assert not torch.equal(kv[0, 0, 1, :dim], key[1, 0])
    assert not torch.equal(placed[0], placed[1]), "the same 32 tokens lie differently in blocks of 32 and 128"
