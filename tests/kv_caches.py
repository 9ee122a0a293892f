"""Random paged KV caches for tests: one tensor per layer in a named layout (cpu, flash_nhd,
flash_hnd, mla), filled with random bytes from a seed."""

from __future__ import annotations

import torch

from kvferry.kernels.layout import KVLayout


def make_caches(name: str, layers: int, nb: int, bs: int, h: int, d: int, dtype: torch.dtype,
                device: str = "cpu", seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "mla":
        h = 1  # one latent vector per token: no heads
    shape = KVLayout(name, nb, bs, h, d, dtype).expected_shape()
    nbytes = torch.empty((), dtype=dtype).element_size()
    return [torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), dtype=torch.uint8, generator=g)
            .view(dtype).to(device) for _ in range(layers)]
