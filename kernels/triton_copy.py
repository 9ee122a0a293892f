"""CUDA path: one Triton launch copies all layers (and K/V planes) of a batch of chunks.

The kernel moves whole rows of integer words (a vLLM block per plane in the block format, one
token's heads in the NHD token format) between the paged cache and chunk buffers; its inputs are
tables of base addresses, so any number of layers costs one launch. Layouts whose token rows are
not plain memory rows (HND, vLLM's CPU layout) use torch advanced indexing on the device instead.
Runs under TRITON_INTERPRET=1 on CPU tensors too, which is how CI checks it without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kvferry.kernels.paged_copy import PagedKV, RowTable

_TL_WORD = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}
TILE = 1024


@triton.jit
def _copy_rows(plane_ptrs, plane_strides, chunk_ptrs, row_idx, rows_per_chunk, num_planes, max_rows,
               row_words, WORD: tl.constexpr, TO_CHUNK: tl.constexpr, TILE: tl.constexpr):
    pid = tl.program_id(0)
    r = pid % max_rows
    q = (pid // max_rows) % num_planes
    c = pid // (max_rows * num_planes)
    n_rows = tl.load(rows_per_chunk + c)
    if r < n_rows:
        row = tl.load(row_idx + c * max_rows + r)
        plane = tl.load(plane_ptrs + q).to(tl.pointer_type(WORD))
        chunk = tl.load(chunk_ptrs + c).to(tl.pointer_type(WORD))
        cache_row = plane + row * tl.load(plane_strides + q)
        chunk_row = chunk + (q * n_rows + r) * row_words
        offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
        mask = offs < row_words
        if TO_CHUNK:
            tl.store(chunk_row + offs, tl.load(cache_row + offs, mask=mask), mask=mask)
        else:
            tl.store(cache_row + offs, tl.load(chunk_row + offs, mask=mask), mask=mask)


def copy_rows(kv: PagedKV, table: RowTable, fmt: str, chunks: list[tuple[torch.Tensor, int]],
              bufs: list[torch.Tensor], to_chunk: bool) -> int:
    """Gather (to_chunk) or scatter a batch of (block ids, tokens) chunks in one launch.

    Asynchronous on the current CUDA stream: synchronize before reading a gathered chunk from
    another stream, NIXL or the host, and keep the buffers alive until then.
    """
    dev = kv.device
    rows = [kv.rows(fmt, ids, n) for ids, n in chunks]
    nbytes = [kv.chunk_nbytes(fmt, n) for _, n in chunks]
    flats = [kv.chunk_bytes_view(b, size) for b, size in zip(bufs, nbytes, strict=True)]
    if any(f.data_ptr() % table.word for f in flats):
        raise ValueError(f"chunk buffer is not aligned to {table.word} bytes")
    max_rows = max(r.numel() for r in rows)
    row_idx = torch.zeros(len(rows), max_rows, dtype=torch.int64, device=dev)
    for c, r in enumerate(rows):
        row_idx[c, :r.numel()] = r
    w = min(table.word, 8)  # Triton has no 16-byte integer
    meta = torch.tensor(table.bases + [s // w for s in table.strides] + [f.data_ptr() for f in flats]
                        + [r.numel() for r in rows], dtype=torch.int64).to(dev, non_blocking=True)
    nq, nc = len(table.bases), len(flats)
    row_words = table.row_bytes // w
    grid = (nc * nq * max_rows, triton.cdiv(row_words, TILE))
    _copy_rows[grid](meta[:nq], meta[nq:2 * nq], meta[2 * nq:2 * nq + nc], row_idx, meta[2 * nq + nc:],
                     nq, max_rows, row_words, WORD=_TL_WORD[w], TO_CHUNK=to_chunk, TILE=TILE)
    return sum(nbytes)
