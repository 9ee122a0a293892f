"""Heterogeneous TP and block size, byte for byte (no vLLM): every (prefiller rank, decoder rank,
layer, token, head) lands where the decoder's paged cache expects it, for GQA, replicated heads
(KV heads fewer than TP) and MLA. The prefiller ranks gather real chunks with PagedKV, the byte runs
of kernels/head_map.py move them into the decoder ranks' chunks, and the decoder ranks scatter them
with PagedKV; the decoder caches are then compared with the model's logical KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.kernels.head_map import ChunkGeometry, apply_runs, chunk_runs, rank_heads, senders_of
from kvferry.kernels.layout import KVLayout, LayoutError
from kvferry.kernels.paged_copy import PagedKV

HEAD = 16  # head size in elements (bf16: 32 bytes)


def logical_kv(kv_planes: int, layers: int, tokens: int, heads: int, seed: int) -> torch.Tensor:
    """[kv, layer, token, global head, head bytes]: the model's KV for a prompt, as random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (kv_planes, layers, tokens, heads, HEAD * 2), dtype=torch.uint8, generator=g)


def rank_cache(name: str, layers: int, nb: int, bs: int, heads: list[int], seed: int) -> list[torch.Tensor]:
    lay = KVLayout(name, nb, bs, len(heads), HEAD, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    shape = lay.expected_shape()
    return [torch.randint(0, 256, (*shape[:-1], shape[-1] * 2), dtype=torch.uint8, generator=g)
            .view(torch.bfloat16) for _ in range(layers)]


def place(kv: PagedKV, logical: torch.Tensor, heads: list[int], ids: list[int]) -> None:
    """Write the logical KV of `heads` for the prompt's tokens into blocks `ids` (a prefiller's cache)."""
    bs = kv.layout.block_size
    n = logical.shape[2]
    for layer, views in enumerate(kv._kv):
        for k, view in enumerate(views):
            for t in range(n):
                view[ids[t // bs], t % bs] = logical[k, layer, t, heads]


def check(kv: PagedKV, logical: torch.Tensor, heads: list[int], ids: list[int], who: str) -> None:
    bs = kv.layout.block_size
    for layer, views in enumerate(kv._kv):
        for k, view in enumerate(views):
            for t in range(logical.shape[2]):
                for j, g in enumerate(heads):
                    got = view[ids[t // bs], t % bs, j]
                    assert torch.equal(got, logical[k, layer, t, g]), \
                        f"{who}: layer {layer} kv {k} token {t} local head {j} (global {g}) is wrong"


def hetero(name: str, fmt_p: str, fmt_d: str, total: int, tp_p: int, tp_d: int, bs_p: int = 16, bs_d: int = 16,
           layers: int = 2, tokens: int = 64, name_d: str | None = None, device: str = "cpu") -> int:
    """Move one chunk of `tokens` from a TP=`tp_p` prefiller to a TP=`tp_d` decoder; returns runs used.
    With `device="cuda"` both sides' paged caches and chunks are in GPU memory, so PagedKV's gather
    and scatter run the Triton kernel; the byte runs are applied on the host, as NIXL would move them."""
    mla = name == "mla"
    name_d = name_d or name
    logical = logical_kv(1 if mla else 2, layers, tokens, 1 if mla else total, seed=tp_p * 10 + tp_d)
    rng = np.random.default_rng(tokens)
    chunks, geos = [], []
    for p in range(tp_p):
        heads = rank_heads(total, tp_p, p, mla)
        nb = tokens // bs_p + 3
        kv = PagedKV(rank_cache(name, layers, nb, bs_p, heads, seed=p), name)
        ids = rng.permutation(nb)[:kv.layout.num_blocks_for(tokens)].tolist()
        place(kv, logical, heads, ids)
        kv = PagedKV([t.to(device) for t in kv.caches], name)
        buf = torch.zeros(kv.chunk_nbytes(fmt_p, tokens), dtype=torch.uint8, device=device)
        kv.gather(ids, buf, fmt_p, tokens)
        chunks.append(buf.cpu().numpy())
        geos.append(ChunkGeometry(kv.layout, fmt_p, layers))
    nruns = 0
    for d in range(tp_d):
        heads = rank_heads(total, tp_d, d, mla)
        nb = tokens // bs_d + 5
        kv = PagedKV([t.to(device) for t in rank_cache(name_d, layers, nb, bs_d, heads, seed=100 + d)], name_d)
        page = np.zeros(kv.chunk_nbytes(fmt_d, tokens), dtype=np.uint8)
        covered = np.zeros(page.size, dtype=np.int64)
        dst = ChunkGeometry(kv.layout, fmt_d, layers)
        for p in range(tp_p):
            runs = chunk_runs(geos[p], dst, total, tp_p, p, tp_d, d, tokens)
            assert (runs.size > 0) == (p in senders_of(total, tp_p, tp_d, d, mla))
            apply_runs(runs, chunks[p], page)
            for _, off, n in runs:
                covered[off:off + n] += 1
            nruns += len(runs)
        assert (covered == 1).all(), f"decoder rank {d}: bytes written {set(covered.tolist())} times, not once each"
        ids = rng.permutation(nb)[:kv.layout.num_blocks_for(tokens)].tolist()
        kv.scatter(torch.from_numpy(page).to(device), ids, fmt_d, tokens)
        kv = PagedKV([t.cpu() for t in kv.caches], name_d)
        check(kv, logical, heads, ids, f"P TP={tp_p} -> D rank {d}/{tp_d}")
    return nruns


def test_rank_heads_follow_vllms_split_and_replication() -> None:
    assert [rank_heads(8, 2, r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_heads(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]  # replicated
    assert [rank_heads(1, 2, r, mla=True) for r in range(2)] == [[0], [0]]
    # MLA from TP=2 to TP=2: each decoder rank gets its latent from one prefiller rank, spread over both.
    assert [senders_of(1, 2, 2, d, mla=True) for d in range(2)] == [[0], [1]]
    assert senders_of(8, 2, 1, 0) == [0, 1] and senders_of(8, 1, 2, 1) == [0]
    with pytest.raises(LayoutError, match="do not split"):
        rank_heads(6, 4, 0)


@pytest.mark.parametrize("name", ["cpu", "flash_nhd", "flash_hnd"])
@pytest.mark.parametrize("fmt", ["block", "token"])
def test_hetero_tp2_to_tp1_gqa_every_head_lands_in_place(name: str, fmt: str) -> None:
    hetero(name, fmt, fmt, total=4, tp_p=2, tp_d=1)


@pytest.mark.parametrize("name", ["cpu", "flash_nhd", "flash_hnd"])
@pytest.mark.parametrize("fmt", ["block", "token"])
def test_hetero_tp1_to_tp2_gqa_every_head_lands_in_place(name: str, fmt: str) -> None:
    hetero(name, fmt, fmt, total=4, tp_p=1, tp_d=2)


@pytest.mark.parametrize("tp_p,tp_d", [(4, 1), (1, 4), (4, 2), (2, 4)])
def test_hetero_replicated_heads_fewer_than_tp(tp_p: int, tp_d: int) -> None:
    """2 KV heads over TP 4: each head on two ranks; each decoder rank still gets its head once."""
    hetero("cpu", "block", "block", total=2, tp_p=tp_p, tp_d=tp_d)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("fmt", ["block", "token"])
def test_hetero_mla_one_ranks_copy_travels(tp_p: int, tp_d: int, fmt: str) -> None:
    runs = hetero("mla", fmt, fmt, total=1, tp_p=tp_p, tp_d=tp_d)
    # The latent is the same on every rank: each decoder rank gets one whole-chunk run from one prefiller.
    assert runs == tp_d


def test_hetero_block_size_16_to_32_in_the_token_and_block_formats() -> None:
    """Per-token runs make differing block sizes work too (P block 16 -> D block 32), in kvferry's
    model of each layout (vLLM CPU's real block interior is not token-addressable: refused at the
    handshake, tests/transfer/buffer/test_hetero_block_size.py)."""
    hetero("cpu", "token", "token", total=4, tp_p=2, tp_d=1, bs_p=16, bs_d=32)
    hetero("cpu", "block", "block", total=4, tp_p=1, tp_d=2, bs_p=16, bs_d=32)
    hetero("flash_nhd", "block", "token", total=4, tp_p=2, tp_d=2, bs_p=32, bs_d=16, name_d="cpu")


def test_hetero_runs_coalesce_to_whole_head_ranges() -> None:
    """vLLM's CPU layout keeps a head's block contiguous: P TP=2 -> D TP=1 is one run per layer and
    block from each prefiller rank, not one per token."""
    assert hetero("cpu", "block", "block", total=4, tp_p=2, tp_d=1, layers=2, tokens=64) == 2 * 2 * 4


def test_hetero_mismatch_is_refused_naming_both_sides() -> None:
    a = ChunkGeometry(KVLayout("cpu", 4, 16, 2, 64, torch.bfloat16), "block", 2)
    b = ChunkGeometry(KVLayout("cpu", 4, 16, 2, 128, torch.bfloat16), "block", 2)
    with pytest.raises(LayoutError, match="prefiller chunk .* and decoder chunk"):
        chunk_runs(a, b, 4, 2, 0, 2, 0, 16)
    m = ChunkGeometry(KVLayout("mla", 4, 16, 1, 64, torch.bfloat16), "block", 2)
    with pytest.raises(LayoutError, match="cannot be mapped"):
        chunk_runs(a, m, 4, 2, 0, 1, 0, 16)


def test_hetero_tp_mla_handshake_accepts_another_tp_size_gqa_does_not() -> None:
    """The MLA latent is the same on every rank, so an MLA prefiller of TP 2 may feed a decoder of
    TP 1 (its rank 0's copy travels); a GQA one may not (its ranks hold different heads)."""
    import msgspec

    from kvferry.buffer.peering import layout_error
    from kvferry.common.wire import messages as msg

    mla = msg.LayoutFingerprint(model="m", dtype="bfloat16", num_layers=8, num_kv_heads=1, head_size=576,
                                block_size=16, kv_layout="mla", chunk_format="block", chunk_size=256, tp_size=1,
                                page_bytes=8 * 256 * 576 * 2, kv_kind="mla")
    roles, names = ("receiver", "sender"), ("d", "p")
    assert layout_error(roles, names, mla, msgspec.structs.replace(mla, tp_size=2)) is None
    err = layout_error(roles, names, mla, msgspec.structs.replace(mla, tp_size=2, block_size=32))
    assert err is not None and "block_size: 16 != 32" in err and "tp_size" not in err.split(". Fix")[0]
    gqa = msgspec.structs.replace(mla, kv_kind="mha", num_kv_heads=8, head_size=64, kv_layout="cpu")
    err = layout_error(roles, names, gqa, msgspec.structs.replace(gqa, tp_size=2, num_kv_heads=4))
    assert err is not None and "tp_size: 1 != 2" in err and "same --tensor-parallel-size" in err


GPU_CASES = [  # (name, fmt, total heads, tp_p, tp_d): GQA both ways, replicated heads, MLA
    ("cpu", "block", 4, 2, 1), ("flash_nhd", "token", 4, 2, 1), ("flash_hnd", "block", 4, 1, 2),
    ("flash_nhd", "block", 2, 4, 2), ("flash_hnd", "token", 2, 1, 4), ("mla", "block", 1, 2, 1),
    ("mla", "token", 1, 1, 2),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,fmt,total,tp_p,tp_d", GPU_CASES)
def test_hetero_tp_gpu_triton_kernel_every_head_lands_in_place(name: str, fmt: str, total: int, tp_p: int,
                                                               tp_d: int) -> None:
    """The same byte-level check with both sides' caches in GPU memory: PagedKV's CUDA path (the Triton
    kernel; torch indexing for a layout whose token rows are not memory rows, flash HND's token format)."""
    hetero(name, fmt, fmt, total=total, tp_p=tp_p, tp_d=tp_d, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hetero_block_size_and_tp_gpu_triton_kernel_every_head_lands_in_place() -> None:
    hetero("flash_nhd", "block", "token", total=4, tp_p=2, tp_d=2, bs_p=32, bs_d=16, name_d="flash_hnd",
           device="cuda")
