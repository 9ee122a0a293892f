"""gather/scatter between vLLM's per-layer paged KV caches and contiguous chunks.

All copies work on bytes, so bf16, fp16 and fp8 caches are the same to them. Where a chunk is
made of whole memory rows (the block format always; the token format for NHD) every copy is a
list of (plane, row) pairs over per-plane row tables: base address, row stride, row size.

- CPU: the compiled row copy of ``native`` (one memcpy per row, rows over torch's threads)
  takes the address table of every row of the chunk, all layers at once. Without a C compiler,
  one ``index_select`` (gather) or ``index_copy_`` (scatter) moves the whole chunk through a
  single overlapping ``[words, row_words]`` view (strides ``(1, 1)``)
  of the address span that holds every layer: row *r* of that view starts at word *r*, so any
  row of any layer is one index. A torch call's dispatch costs as much as copying a small chunk,
  which is why one call for all layers matters. Rows are moved as the widest integer word that
  divides every address and size involved.
- CUDA: the Triton kernel of ``triton_copy`` takes the same tables; one launch per batch. Block ids
  are checked and turned into row numbers on the host (numpy), so a call never waits for the GPU.
- Other token layouts (HND, vLLM's CPU layout) use torch advanced indexing on K/V views.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from kvferry.kernels import native
from kvferry.kernels.layout import FORMATS, KVLayout, LayoutError, detect_layout
from kvferry.kernels.row_table import RowTable, check_chunk_buf

# complex128 is the widest element torch has: its copies move 16 bytes per element (moves only,
# no arithmetic, so every bit pattern survives; the property tests use random bytes), and wider
# words make index_copy_ faster.
_WORD_DTYPES = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _dense(t: torch.Tensor) -> bool:
    """Do `t`'s elements fill one contiguous range, in some order?"""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    expect = 1
    for stride, n in dims:
        if stride != expect:
            return False
        expect *= n
    return True


class PagedKV:
    """The paged KV caches of one worker (all layers, one TP rank), ready to gather and scatter."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], layout: KVLayout | str) -> None:
        if not kv_caches:
            raise LayoutError("no KV cache tensors were registered")
        t0 = kv_caches[0]
        if isinstance(layout, str):
            layout = from_tensor(layout, t0)
        kv_caches = [layout.canonical(t) for t in kv_caches]
        t0 = kv_caches[0]
        for i, t in enumerate(kv_caches):
            if tuple(t.shape) != layout.expected_shape() or t.dtype != layout.dtype:
                raise LayoutError(f"layer {i} KV cache is {list(t.shape)} {t.dtype}, expected "
                                  f"{list(layout.expected_shape())} {layout.dtype} like layer 0")
            if t.device != t0.device:
                raise LayoutError(f"layer {i} is on {t.device}, layer 0 on {t0.device}")
            if t.stride(-1) != 1:
                raise LayoutError(f"layer {i}: the innermost (head_size) dimension must be contiguous")
        self.layout = layout
        self.caches = list(kv_caches)  # keeps the memory alive while the raw views exist
        self.num_layers = len(kv_caches)
        self.device = t0.device
        e = layout.elem_bytes
        # Byte-space twins: every copy below is dtype-agnostic.
        blayout = replace(layout, dtype=torch.uint8, head_size=layout.head_size * e)
        nbytes = [t.view(torch.uint8) for t in kv_caches]
        self._kv = [blayout.kv_views(b) for b in nbytes]

        lo: int | None = None
        hi = 0
        if self.device.type == "cpu":
            lo = min(t.data_ptr() for t in nbytes)
            hi = max(t.data_ptr() + _extent(t) for t in nbytes)

        planes = [p for b in nbytes for p in blayout.block_planes(b)]  # q = layer * P + plane
        self._planes = planes
        if not all(_dense(p[0]) for p in planes):
            raise LayoutError("a KV block is not one contiguous range of memory; use pd_chunk_format: token")
        self._tables: dict[str, RowTable | None] = {
            "block": RowTable([p.data_ptr() for p in planes], [p.stride(0) for p in planes],
                              layout.block_bytes).finish(lo)}
        # Token rows are memory rows when each token's heads are adjacent and every block is an
        # evenly spaced run of tokens (NHD); otherwise token copies index [block, slot] pairs.
        k = self._kv[0][0]
        token_rows = (_dense(k[0, 0]) and k.stride(2) == k.shape[3]
                      and k.stride(0) == k.stride(1) * layout.block_size)
        kvs = [self._kv[i][kv] for kv in range(layout.kv_planes) for i in range(self.num_layers)]  # q = kv*L + l
        self._tables["token"] = (RowTable([v.data_ptr() for v in kvs], [v.stride(1) for v in kvs],
                                          layout.token_row_bytes).finish(lo) if token_rows else None)
        self._span: dict[tuple[int, int], torch.Tensor] = {}
        if lo is not None:
            for table in self._tables.values():
                if table is not None:
                    key = (table.word, table.row_words)
                    self._span.setdefault(key, _span_view(lo, hi, table.word, table.row_words))

    def table(self, fmt: str) -> RowTable | None:
        return self._tables[fmt]

    def chunk_nbytes(self, fmt: str, num_tokens: int) -> int:
        return self.layout.chunk_nbytes(fmt, self.num_layers, num_tokens)

    def _indices(self, block_ids: Sequence[int] | torch.Tensor, fmt: str,
                 num_tokens: int | None, check_range: bool = True) -> tuple[torch.Tensor, int]:
        """Block ids as a contiguous long tensor and the token count, validated.

        `check_range=False` leaves the id range check to the caller (the compiled copy checks
        every row itself, cheaper than a separate min/max op)."""
        lo: int | torch.Tensor = 0
        hi: int | torch.Tensor = 0
        if isinstance(block_ids, torch.Tensor):
            ids = block_ids.to(self.device, torch.long).contiguous()
            if check_range and ids.numel():
                lo, hi = ids.aminmax()
        else:
            if block_ids:
                lo, hi = min(block_ids), max(block_ids)
            ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return ids, self._checked_tokens(ids.numel(), int(lo), int(hi), fmt, num_tokens)

    def _checked_tokens(self, nids: int, lo: int, hi: int, fmt: str, num_tokens: int | None) -> int:
        """The chunk's token count, after checking the format, the block count and the id range."""
        if fmt not in FORMATS:
            raise LayoutError(f"chunk format {fmt!r} is not one of {FORMATS}")
        bs = self.layout.block_size
        n = nids * bs if num_tokens is None else num_tokens
        if not 0 < n <= nids * bs:
            raise ValueError(f"{n} tokens do not fit the {nids} blocks given")
        nblk = self.layout.num_blocks_for(n)
        if nids != nblk:
            raise ValueError(f"{n} tokens need {nblk} blocks, got {nids}")
        # Out-of-range ids would address another layer's memory through the span view.
        if lo < 0 or hi >= self.layout.num_blocks:
            raise IndexError(f"block ids must lie in [0, {self.layout.num_blocks})")
        return n

    def host_rows_batch(self, block_ids: Sequence[Sequence[int] | torch.Tensor], fmt: str,
                        num_tokens: Sequence[int | None]) -> tuple[np.ndarray, list[int], list[int]]:
        """Checked row numbers of several chunks, one after the other, with each chunk's row and
        token counts: the CUDA path's input, built without a torch call per chunk."""
        lists = [b.tolist() if isinstance(b, torch.Tensor) else b for b in block_ids]
        if fmt != "block":
            parts = [self.host_rows(b, fmt, n) for b, n in zip(lists, num_tokens, strict=True)]
            return (np.concatenate([r for r, _ in parts]), [len(r) for r, _ in parts], [n for _, n in parts])
        counts = [len(b) for b in lists]
        ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(counts))
        lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        ns = [self._checked_tokens(c, lo, hi, fmt, n) for c, n in zip(counts, num_tokens, strict=True)]
        return ids, counts, ns

    def host_rows(self, block_ids: Sequence[int] | torch.Tensor, fmt: str,
                  num_tokens: int | None) -> tuple[np.ndarray, int]:
        """Checked row numbers of one chunk as a host array (the CUDA path's input), and its tokens."""
        if isinstance(block_ids, torch.Tensor):
            block_ids = block_ids.tolist()
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        n = self._checked_tokens(ids.size, lo, hi, fmt, num_tokens)
        if fmt == "block":
            return ids, n
        bs = self.layout.block_size
        return (ids[:, None] * bs + np.arange(bs)).reshape(-1)[:n], n

    def chunk_bytes_view(self, buf: torch.Tensor, nbytes: int) -> torch.Tensor:
        check_chunk_buf(buf, nbytes)
        flat = buf.view(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        return flat[:nbytes]

    def rows(self, fmt: str, ids: torch.Tensor, n: int) -> torch.Tensor:
        """Row numbers within each plane: block ids (block format) or token slots (token)."""
        if fmt == "block":
            return ids
        bs = self.layout.block_size
        return (ids[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)[:n]

    def gather(self, block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor, fmt: str = "block",
               num_tokens: int | None = None) -> int:
        """Copy one chunk (the tokens held by `block_ids`) into `out`; returns bytes written."""
        return self.copy_batch([block_ids], [out], fmt, [num_tokens], to_chunk=True)

    def scatter(self, chunk: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, fmt: str = "block",
                num_tokens: int | None = None) -> int:
        """Copy one chunk from `chunk` into the blocks `block_ids`; returns bytes read."""
        return self.copy_batch([block_ids], [chunk], fmt, [num_tokens], to_chunk=False)

    def scatter_blocks(self, chunk: torch.Tensor, block_ids: Sequence[int], first: int,
                       chunk_blocks: int | None = None) -> int:
        """Scatter blocks `first`..`len(block_ids)-1` of a block-format chunk that holds
        `chunk_blocks` blocks (default: one per id). The leading blocks belong to the prefix cache
        and may be read by other requests; trailing ones may not be allocated. Returns bytes read."""
        nblk = len(block_ids) if chunk_blocks is None else chunk_blocks
        if not 0 <= first < len(block_ids) <= nblk:
            raise ValueError(f"blocks {first}..{len(block_ids) - 1} are outside the chunk's {nblk} blocks")
        tail = list(block_ids[first:])
        if min(tail) < 0 or max(tail) >= self.layout.num_blocks:
            raise IndexError(f"block ids must lie in [0, {self.layout.num_blocks})")
        rb = self.layout.block_bytes
        nbytes = len(self._planes) * (len(block_ids) - first) * rb
        if self.device.type == "cuda":
            from kvferry.kernels import triton_copy
            table = self._tables["block"]
            assert table is not None  # a block table is made for every cache
            triton_copy.copy_rows(self.device, table, np.asarray(tail, dtype=np.int64), [len(tail)],
                                  [chunk], [len(self._planes) * nblk * rb], False, plane_rows=[nblk], first=[first])
            return nbytes
        tail_t = torch.tensor(tail, dtype=torch.long, device=self.device)
        src = self.chunk_bytes_view(chunk, len(self._planes) * nblk * rb).view(len(self._planes), nblk, rb)
        for q, plane in enumerate(self._planes):
            rows = torch.as_strided(plane, (plane.shape[0], rb), (plane.stride(0), 1))
            rows.index_copy_(0, tail_t, src[q, first:len(block_ids)])
        return nbytes

    def copy_batch(self, block_ids: Sequence[Sequence[int] | torch.Tensor], bufs: Sequence[torch.Tensor],
                   fmt: str, num_tokens: Sequence[int | None], to_chunk: bool) -> int:
        """Gather (to_chunk) or scatter several chunks; on CUDA one kernel launch for all of them."""
        table = self._tables[fmt] if fmt in self._tables else None
        rowcopy = native.row_copier() if self.device.type == "cpu" and table is not None else None
        if rowcopy is not None and table is not None:
            return sum([self._copy_native(rowcopy, table, fmt, b, buf, n, to_chunk)
                        for b, buf, n in zip(block_ids, bufs, num_tokens, strict=True)])
        if self.device.type == "cuda" and table is not None:
            from kvferry.kernels import triton_copy
            rows, counts, ns = self.host_rows_batch(block_ids, fmt, num_tokens)
            return triton_copy.copy_rows(self.device, table, rows, counts, bufs,
                                         [self.chunk_nbytes(fmt, n) for n in ns], to_chunk)
        checked = [self._indices(b, fmt, n) for b, n in zip(block_ids, num_tokens, strict=True)]
        if table is None:
            return sum(self.token_copy_indexed(i, b, n, to_chunk)
                       for (i, n), b in zip(checked, bufs, strict=True))
        total = 0
        span = self._span[(table.word, table.row_words)]
        assert table.base_words is not None and table.stride_words is not None  # finish() made them on CPU
        for (ids, n), buf in zip(checked, bufs, strict=True):
            nbytes = self.chunk_nbytes(fmt, n)
            flat = self.chunk_bytes_view(buf, nbytes)
            if flat.data_ptr() % table.word:
                raise ValueError(f"chunk buffer is not aligned to {table.word} bytes")
            chunk = flat.view(_WORD_DTYPES[table.word]).view(-1, table.row_words)
            offsets = torch.addcmul(table.base_words, self.rows(fmt, ids, n), table.stride_words).view(-1)
            if to_chunk:
                torch.index_select(span, 0, offsets, out=chunk)
            else:
                span.index_copy_(0, offsets, chunk)
            total += nbytes
        return total

    def _copy_native(self, rowcopy: native.RowCopier, table: RowTable, fmt: str,
                     block_ids: Sequence[int] | torch.Tensor, buf: torch.Tensor, num_tokens: int | None,
                     to_chunk: bool) -> int:
        # Lean on purpose: a 1 MiB copy takes tens of microseconds, so each microsecond of Python counts.
        ids, n = self._indices(block_ids, fmt, num_tokens, check_range=False)
        nbytes = self.chunk_nbytes(fmt, n)
        check_chunk_buf(buf, nbytes)
        row_limit = self.layout.num_blocks * (1 if fmt == "block" else self.layout.block_size)
        assert table.base_addr is not None and table.stride_bytes is not None  # finish() made them on CPU
        try:
            rowcopy.copy(table.base_addr, table.stride_bytes, self.rows(fmt, ids, n), row_limit,
                         table.row_bytes, buf.data_ptr(), to_chunk)
        except IndexError:
            raise IndexError(f"block ids must lie in [0, {self.layout.num_blocks})") from None
        return nbytes

    def token_copy_indexed(self, ids: torch.Tensor, buf: torch.Tensor, n: int, to_chunk: bool) -> int:
        """Token format for layouts whose token rows are not memory rows (HND, vLLM CPU)."""
        nbytes = self.chunk_nbytes("token", n)
        chunk = self.chunk_bytes_view(buf, nbytes).view(self.layout.kv_planes, self.num_layers, n, -1)
        bs = self.layout.block_size
        t = torch.arange(n, device=self.device)
        b, s = ids[t // bs], t % bs
        h = self.layout.num_kv_heads
        for layer, pair in enumerate(self._kv):
            for kv, view in enumerate(pair):
                if to_chunk:
                    chunk[kv, layer].view(n, h, -1).copy_(view[b, s])
                else:
                    view.index_put_((b, s), chunk[kv, layer].view(n, h, -1))
        return nbytes


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0


def _span_view(lo: int, hi: int, word: int, row_words: int) -> torch.Tensor:
    """[n, row_words] words over [lo, hi) with strides (1, 1): row r starts at word r.

    The memory belongs to the cache tensors PagedKV holds; rows are only ever indexed at
    offsets computed from their tables and checked block ids.
    """
    nwords = (hi - lo) // word
    raw = torch.frombuffer((ctypes.c_char * (nwords * word)).from_address(lo), dtype=_WORD_DTYPES[word])
    return raw.as_strided((nwords - row_words + 1, row_words), (1, 1))


def from_tensor(name: str, t: torch.Tensor) -> KVLayout:
    """A layout named `name` with its sizes read off one layer's tensor."""
    s = tuple(t.shape)
    if name == "cpu" and len(s) == 4:
        return KVLayout(name, s[0], s[2], s[1], s[3] // 2, t.dtype)
    if name == "flash_nhd" and len(s) == 5:
        return KVLayout(name, s[1], s[2], s[3], s[4], t.dtype)
    if name == "flash_hnd" and len(s) == 5:
        return KVLayout(name, s[1], s[3], s[2], s[4], t.dtype)
    if name == "mla" and len(s) == 3:
        return KVLayout(name, s[0], s[1], 1, s[2], t.dtype)
    if name == "mla" and len(s) == 4 and s[1] == 1:  # vLLM CPU_MLA's [blocks, 1, block_size, latent]
        return KVLayout(name, s[0], s[2], 1, s[3], t.dtype)
    raise LayoutError(f"a tensor of shape {list(s)} cannot have layout {name!r}")


def gather(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor,
           *, layout: KVLayout | str = "cpu", fmt: str = "block", num_tokens: int | None = None) -> int:
    """One-shot gather; keep a PagedKV for repeated use (it caches the views)."""
    return PagedKV(kv_caches, layout).gather(block_ids, out, fmt, num_tokens)


def scatter(chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int] | torch.Tensor,
            *, layout: KVLayout | str = "cpu", fmt: str = "block", num_tokens: int | None = None) -> int:
    """One-shot scatter; keep a PagedKV for repeated use (it caches the views)."""
    return PagedKV(kv_caches, layout).scatter(chunk, block_ids, fmt, num_tokens)


__all__ = ["PagedKV", "RowTable", "gather", "scatter", "from_tensor", "detect_layout", "KVLayout",
           "LayoutError"]
