"""Which KV heads each tensor-parallel rank holds, and how a prefiller rank's chunk maps onto a
decoder rank's chunk when the two sides differ in TP size (or block size).

Head ownership follows vLLM (``QKVParallelLinear``): with ``H`` KV heads and TP size ``T``,

- ``H >= T``: rank ``r`` holds heads ``[r*H/T, (r+1)*H/T)``;
- ``H < T`` (replicated heads): every rank holds one head, ``r // (T/H)``;
- MLA: every rank holds the same latent (one "head", replicated on all ranks).

Design (docs/pd.md, "Different TP"): the **sender slices**. Each decoder rank receives a chunk in
its own format (its heads, its block size) in its own pd_buffer page, so the decoder's scatter is
unchanged; each prefiller rank writes into that page only the byte runs of the heads it is the
chosen source of. The runs come from :func:`chunk_runs`, which lists, for one (prefiller rank,
decoder rank) pair, ``(src_offset, dst_offset, length)`` byte runs between the two chunk formats,
coalesced where both sides are contiguous (a NIXL descriptor each). A head held by several
prefiller ranks (replicated heads, MLA) is sent by exactly one: the rank ``d % replicas`` among its
holders, so the senders share the work and no byte travels twice to the same decoder rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvferry.kernels.layout import KVLayout, LayoutError


def rank_heads(total_heads: int, tp_size: int, rank: int, mla: bool = False) -> list[int]:
    """Global KV head ids rank `rank` of a TP group of `tp_size` holds (vLLM's split)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside a TP group of {tp_size}")
    if mla:
        return [0]
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise LayoutError(f"{total_heads} KV heads do not split over tensor-parallel size {tp_size}")
        per = total_heads // tp_size
        return list(range(rank * per, (rank + 1) * per))
    if tp_size % total_heads:
        raise LayoutError(f"tensor-parallel size {tp_size} is not a multiple of {total_heads} KV heads")
    return [rank // (tp_size // total_heads)]


def source_rank(head: int, total_heads: int, src_tp: int, dst_rank: int, mla: bool = False) -> int:
    """The prefiller rank that sends global head `head` to decoder rank `dst_rank`."""
    holders = [r for r in range(src_tp) if head in rank_heads(total_heads, src_tp, r, mla)]
    if not holders:
        raise LayoutError(f"no prefiller rank of {src_tp} holds KV head {head} of {total_heads}")
    return holders[dst_rank % len(holders)]


def senders_of(total_heads: int, src_tp: int, dst_tp: int, dst_rank: int, mla: bool = False) -> list[int]:
    """The prefiller ranks that write into decoder rank `dst_rank`'s pages (sorted)."""
    return sorted({source_rank(h, total_heads, src_tp, dst_rank, mla)
                   for h in rank_heads(total_heads, dst_tp, dst_rank, mla)})


@dataclass(frozen=True)
class ChunkGeometry:
    """One side's chunk: its layout (heads per rank, block size, head size, dtype), format, layers."""

    layout: KVLayout
    fmt: str
    num_layers: int

    def head_offsets(self, num_tokens: int) -> np.ndarray:
        """Byte offset in the chunk of every (kv plane, layer, token, local head) head vector."""
        lay = self.layout
        kvp, nl, bs, h = lay.kv_planes, self.num_layers, lay.block_size, lay.num_kv_heads
        d = lay.head_size * lay.elem_bytes
        k = np.arange(kvp)[:, None, None, None]
        layer = np.arange(nl)[None, :, None, None]
        t = np.arange(num_tokens)[None, None, :, None]
        head = np.arange(h)[None, None, None, :]
        if self.fmt == "token":
            return ((k * nl + layer) * num_tokens + t) * h * d + head * d
        if self.fmt != "block":
            raise LayoutError(f"chunk format {self.fmt!r} is not block or token")
        nblk = lay.num_blocks_for(num_tokens)
        b, s = t // bs, t % bs
        plane = 0 * k if lay.planes == 1 else k
        within = {
            "cpu": head * (2 * bs * d) + k * (bs * d) + s * d,
            "flash_nhd": (s * h + head) * d,
            "flash_hnd": (head * bs + s) * d,
            "mla": s * d + 0 * head,
        }[lay.name]
        return ((layer * lay.planes + plane) * nblk + b) * lay.block_bytes + within

    @property
    def head_bytes(self) -> int:
        return self.layout.head_size * self.layout.elem_bytes


def chunk_runs(src: ChunkGeometry, dst: ChunkGeometry, total_heads: int, src_tp: int, src_rank: int,
               dst_tp: int, dst_rank: int, num_tokens: int) -> np.ndarray:
    """``[n, 3]`` int64 rows ``(src_offset, dst_offset, length)``: the bytes prefiller rank
    `src_rank` writes from its chunk into decoder rank `dst_rank`'s chunk of the same tokens (empty
    when it sends nothing there). Adjacent runs are merged."""
    mla = src.layout.is_mla
    if mla != dst.layout.is_mla or src.head_bytes != dst.head_bytes or src.num_layers != dst.num_layers:
        raise LayoutError(f"prefiller chunk ({src.layout.name}, {src.num_layers} layers, {src.head_bytes}-byte "
                          f"heads) and decoder chunk ({dst.layout.name}, {dst.num_layers} layers, "
                          f"{dst.head_bytes}-byte heads) cannot be mapped onto each other")
    mine = rank_heads(total_heads, src_tp, src_rank, mla)
    theirs = rank_heads(total_heads, dst_tp, dst_rank, mla)
    if len(mine) != src.layout.num_kv_heads or len(theirs) != dst.layout.num_kv_heads:
        raise LayoutError(f"layouts hold {src.layout.num_kv_heads} and {dst.layout.num_kv_heads} heads per rank; "
                          f"{total_heads} heads over TP {src_tp} and {dst_tp} give {len(mine)} and {len(theirs)}")
    pairs = [(mine.index(g), j) for j, g in enumerate(theirs)
             if g in mine and source_rank(g, total_heads, src_tp, dst_rank, mla) == src_rank]
    if not pairs:
        return np.zeros((0, 3), dtype=np.int64)
    so, do = src.head_offsets(num_tokens), dst.head_offsets(num_tokens)
    s_idx = np.array([p[0] for p in pairs])
    d_idx = np.array([p[1] for p in pairs])
    s_off = so[..., s_idx].reshape(-1)
    d_off = do[..., d_idx].reshape(-1)
    order = np.argsort(d_off, kind="stable")
    return _coalesce(s_off[order], d_off[order], src.head_bytes)


def _coalesce(s_off: np.ndarray, d_off: np.ndarray, size: int) -> np.ndarray:
    """Merge runs that continue each other on both sides."""
    if s_off.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.ones(s_off.size, dtype=bool)
    brk[1:] = (s_off[1:] != s_off[:-1] + size) | (d_off[1:] != d_off[:-1] + size)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, s_off.size)) * size
    return np.stack([s_off[starts], d_off[starts], lengths], axis=1).astype(np.int64)


def apply_runs(runs: np.ndarray, src: memoryview | bytes | np.ndarray, dst: np.ndarray) -> None:
    """Copy the runs on the host (what the NIXL WRITE of each run's descriptor does)."""
    s = np.frombuffer(src, dtype=np.uint8) if not isinstance(src, np.ndarray) else src.view(np.uint8)
    for so, do, n in runs:
        dst[do:do + n] = s[so:so + n]
