"""KV cache layouts as strided views, and the byte size of each chunk format.

Every supported per-layer layout is described by two views of logical shape
``[num_blocks, block_size, kv_heads, head_size]`` (K and V) over the layer's memory, plus the
"block planes" whose rows are whole blocks. Copies never care which physical order a layout has:
they index these views.

- ``cpu``: vLLM's CPU cache ``[num_blocks, kv_heads, block_size, 2*head_size]``; per head the
  first ``block_size`` rows of ``head_size`` are K, the next ``block_size`` are V.
- ``flash_nhd``: FlashAttention ``[2, num_blocks, block_size, kv_heads, head_size]``.
- ``flash_hnd``: its permutation ``[2, num_blocks, kv_heads, block_size, head_size]``.
- ``mla``: MLA models (DeepSeek-V2/V3): ``[num_blocks, block_size, head_size]``, one latent vector
  per token (kv_lora_rank + qk_rope_head_dim wide) and no K/V split: one "K" view with one head,
  no V. The latent is the same on every TP rank. vLLM's CUDA backends use this shape; its CPU_MLA
  backend adds a head dimension of 1 (``[num_blocks, 1, block_size, head_size]``, the same memory
  order), which :meth:`KVLayout.canonical` squeezes away.

Chunk formats:
- ``block``: ``[layers, planes, blocks, block_bytes]`` bytes, whole blocks as they lie in memory.
- ``token``: ``[kv_planes, layers, tokens, kv_heads*head_size]`` in the cache dtype (portable);
  ``kv_planes`` is 2 (K, V) or 1 (the MLA latent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvferry.common.errors import ConfigurationError

LAYOUTS = ("cpu", "flash_nhd", "flash_hnd", "mla")
FORMATS = ("block", "token")


class LayoutError(ConfigurationError, ValueError):
    """A KV cache tensor kvferry cannot describe; the message names the shape it saw."""


@dataclass(frozen=True)
class KVLayout:
    name: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def is_mla(self) -> bool:
        return self.name == "mla"

    @property
    def kv_planes(self) -> int:
        """Logical tensors per layer: 2 (K and V), or 1 (the MLA latent)."""
        return 1 if self.is_mla else 2

    @property
    def planes(self) -> int:
        """Block rows per layer per block: 1 when K and V share a block (or MLA), 2 when split."""
        return 1 if self.name in ("cpu", "mla") else 2

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane."""
        per_block = self.block_size * self.num_kv_heads * self.head_size * self.elem_bytes
        return per_block * self.kv_planes // self.planes

    @property
    def token_row_bytes(self) -> int:
        return self.num_kv_heads * self.head_size * self.elem_bytes

    def expected_shape(self) -> tuple[int, ...]:
        nb, bs, h, d = self.num_blocks, self.block_size, self.num_kv_heads, self.head_size
        return {"cpu": (nb, h, bs, 2 * d), "flash_nhd": (2, nb, bs, h, d),
                "flash_hnd": (2, nb, h, bs, d), "mla": (nb, bs, d)}[self.name]

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in this layout's expected shape: vLLM CPU's 4-D MLA cache loses its 1-wide head dim."""
        if self.is_mla and t.dim() == 4 and t.shape[1] == 1:
            return t.squeeze(1)
        return t

    def kv_views(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """K and V (or the MLA latent alone) as [num_blocks, block_size, kv_heads, head_size] views."""
        nb, bs, h, d = self.num_blocks, self.block_size, self.num_kv_heads, self.head_size
        if self.name == "mla":
            return (t.view(nb, bs, 1, d),)
        if self.name == "cpu":
            v = t.view(nb, h, 2 * bs, d)
            return v[:, :, :bs].permute(0, 2, 1, 3), v[:, :, bs:].permute(0, 2, 1, 3)
        if self.name == "flash_nhd":
            return t[0], t[1]
        return t[0].permute(0, 2, 1, 3), t[1].permute(0, 2, 1, 3)

    def chunk_kv(self, chunk: torch.Tensor, num_layers: int, isa: str = "") -> list[torch.Tensor]:
        """Each KV plane (K and V, or MLA's latent) of a flat uint8 "block" chunk of `num_blocks`
        blocks as a [layers, num_blocks, block_size, kv_heads, head_size] view. vLLM CPU's `vec`
        kernels (`isa` vec/vec16) keep K transposed in each block ([head_size, block_size] per head)
        and V as rows; its `amx` kernels pack both in 16-token tiles, which no view reads as tokens."""
        nb, bs, h, d = self.num_blocks, self.block_size, self.num_kv_heads, self.head_size
        t = chunk.view(self.dtype)
        if self.name == "mla":
            return [t.view(num_layers, nb, bs, 1, d)]
        if self.name == "cpu":
            if isa == "amx":
                raise LayoutError("vLLM CPU's amx attention packs K and V in 16-token tiles: its blocks cannot be "
                                  "read token by token")
            rows = t.view(num_layers, nb, h, 2, bs * d)
            return [rows[:, :, :, 0].unflatten(-1, (d, bs)).permute(0, 1, 4, 2, 3),
                    rows[:, :, :, 1].unflatten(-1, (bs, d)).permute(0, 1, 3, 2, 4)]
        if self.name == "flash_nhd":
            kv = t.view(num_layers, 2, nb, bs, h, d)
        else:
            kv = t.view(num_layers, 2, nb, h, bs, d).permute(0, 1, 2, 4, 3, 5)
        return [kv[:, 0], kv[:, 1]]

    def block_planes(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The layer as `planes` tensors whose dim 0 is the block index."""
        return [t] if self.planes == 1 else [t[0], t[1]]

    def num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def chunk_nbytes(self, fmt: str, num_layers: int, num_tokens: int) -> int:
        """Bytes a chunk of `num_tokens` takes in format `fmt` (the pd_buffer page size for a full one)."""
        if fmt == "block":
            return num_layers * self.planes * self.num_blocks_for(num_tokens) * self.block_bytes
        if fmt == "token":
            return self.kv_planes * num_layers * num_tokens * self.token_row_bytes
        raise LayoutError(f"chunk format {fmt!r} is not one of {FORMATS}")


def detect_layout(t: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int) -> KVLayout:
    """Name the layout of one layer's KV cache tensor from its shape, or fail clearly."""
    shape = tuple(t.shape)
    for name in LAYOUTS:
        if name == "mla" and num_kv_heads != 1:
            continue  # an MLA cache has one latent "head"; a 3-D tensor of a multi-head model is no layout
        nb = shape[0] if name in ("cpu", "mla") else (shape[1] if len(shape) > 1 else 0)
        lay = KVLayout(name, nb, block_size, num_kv_heads, head_size, t.dtype)
        if tuple(lay.canonical(t).shape) == lay.expected_shape():
            return lay
    raise LayoutError(
        f"KV cache tensor of shape {list(shape)} ({t.dtype}) matches none of kvferry's layouts for "
        f"block_size={block_size}, kv_heads={num_kv_heads}, head_size={head_size}: cpu "
        f"[blocks, kv_heads, block_size, 2*head_size], flash_nhd [2, blocks, block_size, kv_heads, "
        f"head_size], flash_hnd [2, blocks, kv_heads, block_size, head_size], mla [blocks, (1,) block_size, "
        f"head_size] (kv_heads 1)")
