"""The NIXL descriptors of one write: whole chunks into whole pages, or byte runs of each chunk
into its page (a prefiller rank slicing K/V heads for a decoder rank of another TP size,
docs/pd.md "Different TP with K/V heads"; the runs come from kernels/head_map.py `chunk_runs`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvferry.common import messages as m
from kvferry.sender.errors import ChunkError

Desc = tuple[int, int, int]  # (address, bytes, device id)


def write_descs(chunks: Sequence[tuple[int, int]], pages: Sequence[int], region: m.Region, device_id: int,
                runs: Sequence[np.ndarray] | None = None
                ) -> tuple[list[Desc] | np.ndarray, list[Desc] | np.ndarray, int, int]:
    """(local descriptors, remote descriptors, bytes written, the most bytes of one page written);
    with runs the descriptors are ``[n, 3]`` int64 arrays (NIXL takes those as they are).
    `runs[i]`: ``[n, 3]`` rows ``(src_offset, dst_offset, length)`` within chunk i and its page; a
    run outside either is refused here, before anything is posted (it would read or write memory
    that is not the chunk's or the page's)."""
    local: list[Desc] | np.ndarray
    remote: list[Desc] | np.ndarray
    if runs is None:
        local = [(a, n, device_id) for a, n in chunks]
        remote = [(region.addr + p * region.page_bytes, n, region.device_id)
                  for p, (_, n) in zip(pages, chunks, strict=True)]
        return local, remote, sum(n for _, n in chunks), max((n for _, n in chunks), default=0)
    if len(runs) != len(chunks):
        raise ChunkError(f"{len(runs)} run lists for {len(chunks)} chunks")
    # Vectorized, and handed to NIXL as Nx3 arrays: a write of a few thousand runs costs the
    # caller (vLLM's forward thread) tens of microseconds, not a Python loop per run.
    rs = [np.asarray(r, dtype=np.int64).reshape(-1, 3) for r in runs]
    counts = [len(r) for r in rs]
    cat = np.concatenate(rs) if rs else np.zeros((0, 3), dtype=np.int64)
    if not cat.size:
        raise ChunkError("the byte runs of this write are all empty: nothing to write")
    sizes = np.repeat(np.array([n for _, n in chunks], dtype=np.int64), counts)
    if (cat < 0).any() or (cat[:, 2] == 0).any() or (cat[:, 0] + cat[:, 2] > sizes).any():
        raise ChunkError("a byte run lies outside its chunk (or is empty)")
    addrs = np.repeat(np.array([a for a, _ in chunks], dtype=np.int64), counts)
    bases = np.repeat(np.array([region.addr + p * region.page_bytes for p in pages], dtype=np.int64), counts)
    local = np.stack([addrs + cat[:, 0], cat[:, 2], np.full(len(cat), device_id)], axis=1)
    remote = np.stack([bases + cat[:, 1], cat[:, 2], np.full(len(cat), region.device_id)], axis=1)
    return local, remote, int(cat[:, 2].sum()), int((cat[:, 1] + cat[:, 2]).max())
