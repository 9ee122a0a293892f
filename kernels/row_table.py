"""A row table: where a KV cache's chunk rows sit in memory, the one input every copy path (torch,
the compiled row copy, Triton) takes; and the check every chunk buffer passes first."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RowTable:
    """Planes whose rows are chunk rows: byte address of row 0, byte stride, bytes per row."""

    bases: list[int]
    strides: list[int]
    row_bytes: int
    word: int = 1  # widest integer word dividing every base, stride and row size
    base_words: torch.Tensor | None = None  # relative to the span start, in words (CPU)
    stride_words: torch.Tensor | None = None
    base_addr: torch.Tensor | None = None  # absolute, in bytes, for the compiled row copy (CPU)
    stride_bytes: torch.Tensor | None = None
    device_planes: torch.Tensor | None = None  # bases and strides on the GPU (Triton), built once

    def finish(self, span_lo: int | None) -> RowTable:
        g = math.gcd(self.row_bytes, 16, *self.strides, *self.bases)
        self.word = 1 << (g.bit_length() - 1)
        if span_lo is not None:  # [planes, 1] columns: offsets = base + row * stride, one addcmul
            self.base_words = torch.tensor([[(b - span_lo) // self.word] for b in self.bases])
            self.stride_words = torch.tensor([[s // self.word] for s in self.strides])
            self.base_addr = torch.tensor(self.bases, dtype=torch.int64)
            self.stride_bytes = torch.tensor(self.strides, dtype=torch.int64)
        return self

    @property
    def row_words(self) -> int:
        return self.row_bytes // self.word


def check_chunk_buf(buf: torch.Tensor, nbytes: int) -> None:
    """A ValueError naming what is wrong unless `buf` is contiguous and holds `nbytes`."""
    # reshape() of a strided tensor would copy: a gather would then fill a temporary.
    if not buf.is_contiguous():
        raise ValueError("chunk buffer must be contiguous (e.g. a pd_buffer page)")
    have = buf.numel() * buf.element_size()
    if have < nbytes:
        raise ValueError(f"chunk buffer holds {have} bytes, this chunk needs {nbytes}")
