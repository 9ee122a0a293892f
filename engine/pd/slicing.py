"""Which decoder ranks a prefiller rank feeds, and with which bytes, when the two sides' TP sizes
differ (docs/pd.md, "Different TP"). The head mapping itself is kernels/head_map.py's.

- MLA: the latent is the same on every rank: prefiller rank r writes whole chunks to every
  decoder rank d with d % P == r.
- K/V heads, same TP: rank r writes whole chunks to decoder rank r.
- K/V heads, other TP: the sender slices. Rank r writes to every decoder rank it is a chosen
  source of (`senders_of`), into that rank's own pages and chunk format, only the byte runs of
  the heads it sends there (`chunk_runs`), as writer `i` of the `n` prefiller ranks that write
  into the same pages (the receiver reads them once all `n` notified).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from kvferry.common.wire import messages as m
from kvferry.kernels.head_map import ChunkGeometry, chunk_runs, rank_heads, senders_of
from kvferry.kernels.layout import KVLayout, LayoutError


@dataclass(frozen=True)
class Slice:
    """How one prefiller rank writes into one decoder rank's pages: (`writers`, `writer`) for the
    receiver, and the decoder's TP size and rank for the runs."""

    dst_tp: int
    dst_rank: int
    writers: int
    writer: int

    @property
    def share(self) -> tuple[int, int]:
        return self.writers, self.writer


def feeds(fp: m.LayoutFingerprint, src_rank: int, dst_tp: int) -> list[tuple[int, Slice | None]]:
    """The decoder ranks prefiller rank `src_rank` (of `fp.tp_size`) writes into, each with its
    slice (None: whole chunks). Empty when it sends nothing (a TP=2 MLA prefiller's rank 1 to a TP=1
    decoder)."""
    if fp.kv_kind == "mla":
        return [(d, None) for d in range(dst_tp) if d % fp.tp_size == src_rank]
    if dst_tp == fp.tp_size:
        return [(src_rank, None)]
    if not fp.slices or not fp.total_kv_heads:
        raise LayoutError(f"a decoder of tensor-parallel size {dst_tp} needs this prefiller (size {fp.tp_size}) "
                          "to slice K/V heads, and its layout fingerprint does not say the model's total of KV "
                          "heads: start both sides with the same --tensor-parallel-size")
    out: list[tuple[int, Slice | None]] = []
    for d in range(dst_tp):
        writers = senders_of(fp.total_kv_heads, fp.tp_size, dst_tp, d)
        if src_rank in writers:
            out.append((d, Slice(dst_tp, d, len(writers), writers.index(src_rank))))
    return out


def same_rank(fp: m.LayoutFingerprint, rank: int, dst: m.LayoutFingerprint) -> Slice | None:
    """The slice a prefiller rank writes into the decoder rank of its own TP rank when only the
    block sizes differ (block format: the decoder's pages hold its own blocks); None when whole
    chunks fit as they are (same block size, or the token format, which has no blocks)."""
    if dst.block_size == fp.block_size or fp.chunk_format == "token" or fp.kv_kind != "mha":
        return None
    return Slice(fp.tp_size, rank, 1, 0)


def as_decoder_rank(fp: m.LayoutFingerprint, s: Slice) -> m.LayoutFingerprint:
    """`fp` with the heads per rank of the decoder rank `s` writes into: what that rank's own
    fingerprint says, for the chunk keys' salt (shared.key_salt)."""
    heads = len(rank_heads(fp.total_kv_heads, s.dst_tp, s.dst_rank))
    return msgspec.structs.replace(fp, num_kv_heads=heads, tp_size=s.dst_tp)


def geometry(fp: m.LayoutFingerprint) -> ChunkGeometry:
    """One side's chunk geometry from its layout fingerprint (the decoder's comes in its Welcome)."""
    dtype = getattr(torch, fp.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"dtype {fp.dtype!r} in a layout fingerprint is not a torch dtype")
    name = fp.kv_layout.split(":", 1)[0]
    return ChunkGeometry(KVLayout(name, 0, fp.block_size, fp.num_kv_heads, fp.head_size, dtype), fp.chunk_format,
                         fp.num_layers)


class Slicer:
    """Byte runs of a prefiller rank's chunks into decoder ranks' pages, made once per (decoder
    layout, slice, tokens in the chunk) and kept (a handful: full chunks and the last ones)."""

    MAX = 1024

    def __init__(self, fp: m.LayoutFingerprint, src_rank: int) -> None:
        self.fp, self.src_rank = fp, src_rank
        self.src = geometry(fp)
        self._cache: dict[tuple, np.ndarray] = {}

    def runs(self, dst_fp: m.LayoutFingerprint, s: Slice, token_counts: list[int]) -> list[np.ndarray]:
        """One ``[n, 3]`` run array per chunk of `token_counts` tokens each."""
        if dst_fp.tp_size != s.dst_tp or dst_fp.total_kv_heads != self.fp.total_kv_heads:
            raise LayoutError(f"decoder rank {s.dst_rank} says TP {dst_fp.tp_size} and {dst_fp.total_kv_heads} KV "
                              f"heads; its request listed {s.dst_tp} ranks and this prefiller has "
                              f"{self.fp.total_kv_heads} heads")
        return [self._one(dst_fp, s, n) for n in token_counts]

    def _one(self, dst_fp: m.LayoutFingerprint, s: Slice, n: int) -> np.ndarray:
        if self.fp.chunk_format == "block" and dst_fp.block_size == self.fp.block_size:
            n = -(-n // self.fp.block_size) * self.fp.block_size  # whole blocks, as an unsliced write: longer runs
        # Other block sizes: the chunk's real tokens only. A partial chunk's blocks per layer (its
        # layer stride) differ between the sides, so rounding up to one side's block would shift
        # the other's layers.
        key = (dst_fp, s, n)
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) >= self.MAX:
                self._cache.clear()
            got = chunk_runs(self.src, geometry(dst_fp), self.fp.total_kv_heads, self.fp.tp_size, self.src_rank,
                             s.dst_tp, s.dst_rank, n)
            self._cache[key] = got
        return got
