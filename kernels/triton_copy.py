"""CUDA path: one Triton launch copies all layers (and K/V planes) of a batch of chunks.

The kernel moves whole rows of integer words (a vLLM block per plane in the block format, one
token's heads in the NHD token format) between the paged cache and chunk buffers; its inputs are
tables of base addresses, so any number of layers costs one launch. The plane table lives on the
device from the first call on; each call writes its chunk table and row numbers into one pinned host
buffer and sends it with one asynchronous copy, so a call costs one copy and one launch and never
waits for the GPU. Layouts whose token rows are not plain memory rows (HND, vLLM's CPU layout) use
torch advanced indexing on the device instead.
Runs under TRITON_INTERPRET=1 on CPU tensors too, which is how CI checks it without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kvferry.kernels.row_table import RowTable, check_chunk_buf

_TL_WORD = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}
PROGRAM_WORDS = 4096
NUM_WARPS = 8
# Per chunk in the call's table: buffer address, rows to copy, rows per plane in the buffer, first row
# copied, and where its row numbers start in the call's row list.
_CHUNK_COLS = 5


@triton.jit
def _copy_rows(planes, chunks, row_idx, num_planes, num_chunks, row_blocks, row_words,
               WORD: tl.constexpr, TO_CHUNK: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr):
    # Program (c, q, b) copies rows b*ROWS.. of plane q of chunk c, TILE words of each at a time.
    pid = tl.program_id(0)
    b = pid % row_blocks
    q = (pid // row_blocks) % num_planes
    c = pid // (row_blocks * num_planes)
    n_rows = tl.load(chunks + num_chunks + c)
    if b * ROWS < n_rows:
        r = b * ROWS + tl.arange(0, ROWS)
        valid = r < n_rows
        row = tl.load(row_idx + tl.load(chunks + 4 * num_chunks + c) + r, mask=valid, other=0)
        plane = tl.load(planes + q).to(tl.pointer_type(WORD))
        chunk = tl.load(chunks + c).to(tl.pointer_type(WORD))
        plane_rows = tl.load(chunks + 2 * num_chunks + c)
        first = tl.load(chunks + 3 * num_chunks + c)
        cache_rows = plane + row * tl.load(planes + num_planes + q)
        chunk_rows = chunk + (q * plane_rows + first + r) * row_words
        offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
        mask = valid[:, None] & (offs < row_words)[None, :]
        if TO_CHUNK:
            tl.store(chunk_rows[:, None] + offs[None, :], tl.load(cache_rows[:, None] + offs[None, :], mask=mask),
                     mask=mask)
        else:
            tl.store(cache_rows[:, None] + offs[None, :], tl.load(chunk_rows[:, None] + offs[None, :], mask=mask),
                     mask=mask)


def _word(table: RowTable) -> int:
    return min(table.word, 8)  # Triton has no 16-byte integer


def _device_planes(device: torch.device, table: RowTable) -> torch.Tensor:
    """[bases..., strides in words...] on the device, built once per table."""
    if table.device_planes is None:
        w = _word(table)
        table.device_planes = torch.tensor(table.bases + [s // w for s in table.strides],
                                           dtype=torch.int64).to(device)
    return table.device_planes


def copy_rows(device: torch.device, table: RowTable, rows: np.ndarray, counts: Sequence[int],
              bufs: Sequence[torch.Tensor], nbytes: Sequence[int], to_chunk: bool,
              plane_rows: Sequence[int] | None = None, first: Sequence[int] | None = None) -> int:
    """Copy rows of every plane between the cache and the chunk buffers `bufs`, in one launch.

    `rows` holds every chunk's checked row numbers (block ids, or token slots) one after the other,
    `counts[c]` of them for chunk c; chunk c holds `plane_rows[c]` rows per plane (default: its
    count) of which rows `first[c]`.. are copied (default 0). Asynchronous on the current CUDA
    stream: synchronize before reading a gathered chunk from another stream, NIXL or the host, and
    keep the buffers alive until then.
    """
    ptrs = []
    for b, size in zip(bufs, nbytes, strict=True):
        if b.device != device:
            raise ValueError(f"chunk buffer is on {b.device}, the KV cache on {device}")
        if not b.is_contiguous() or b.numel() * b.element_size() < size:
            check_chunk_buf(b, size)  # raises, naming what is wrong
        ptrs.append(b.data_ptr())
    if any(p % table.word for p in ptrs):
        raise ValueError(f"chunk buffer is not aligned to {table.word} bytes")
    nc, nq = len(ptrs), len(table.bases)
    max_rows = max(counts)
    host = torch.empty(_CHUNK_COLS * nc + rows.size, dtype=torch.int64, pin_memory=device.type == "cuda")
    h = host.numpy()
    h[:nc] = ptrs
    h[nc:2 * nc] = counts
    h[2 * nc:3 * nc] = counts if plane_rows is None else plane_rows
    h[3 * nc:4 * nc] = 0 if first is None else first
    h[4 * nc + 1:5 * nc] = np.cumsum(counts[:-1])
    h[4 * nc] = 0
    h[_CHUNK_COLS * nc:] = rows
    table_dev = host.to(device, non_blocking=True)
    w = _word(table)
    row_words = table.row_bytes // w
    # Short rows (a token's heads) are batched so every program moves about PROGRAM_WORDS words.
    tile = min(triton.next_power_of_2(row_words), PROGRAM_WORDS)
    rows_per = PROGRAM_WORDS // tile
    row_blocks = triton.cdiv(max_rows, rows_per)
    grid = (nc * nq * row_blocks, triton.cdiv(row_words, tile))
    _copy_rows[grid](_device_planes(device, table), table_dev, table_dev[_CHUNK_COLS * nc:], nq, nc,
                     row_blocks, row_words, WORD=_TL_WORD[w], TO_CHUNK=to_chunk, ROWS=rows_per, TILE=tile,
                     num_warps=NUM_WARPS)
    return sum(nbytes)
