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
                runs: Sequence[np.ndarray] | None = None) -> tuple[list[Desc], list[Desc], int, int]:
    """(local descriptors, remote descriptors, bytes written, the most bytes of one page written).
    `runs[i]`: ``[n, 3]`` rows ``(src_offset, dst_offset, length)`` within chunk i and its page; a
    run outside either is refused here, before anything is posted (it would read or write memory
    that is not the chunk's or the page's)."""
    if runs is None:
        local = [(a, n, device_id) for a, n in chunks]
        remote = [(region.addr + p * region.page_bytes, n, region.device_id)
                  for p, (_, n) in zip(pages, chunks, strict=True)]
        return local, remote, sum(n for _, n in chunks), max((n for _, n in chunks), default=0)
    if len(runs) != len(chunks):
        raise ChunkError(f"{len(runs)} run lists for {len(chunks)} chunks")
    local, remote, total, widest = [], [], 0, 0
    for (addr, n), page, r in zip(chunks, pages, runs, strict=True):
        r = np.asarray(r, dtype=np.int64).reshape(-1, 3)
        if r.size and ((r < 0).any() or (r[:, 2] == 0).any() or (r[:, 0] + r[:, 2]).max() > n):
            raise ChunkError(f"a byte run lies outside its {n}-byte chunk (or is empty)")
        end = int((r[:, 1] + r[:, 2]).max()) if r.size else 0
        base = region.addr + page * region.page_bytes
        local += [(addr + int(so), int(ln), device_id) for so, _, ln in r]
        remote += [(base + int(do), int(ln), region.device_id) for _, do, ln in r]
        total += int(r[:, 2].sum()) if r.size else 0
        widest = max(widest, end)
    if not local:
        raise ChunkError("the byte runs of this write are all empty: nothing to write")
    return local, remote, total, widest
