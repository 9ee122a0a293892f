"""The local CPU tier's data: chunk bytes in host memory (pinned when the KV lives on a GPU)."""

from __future__ import annotations

import torch


class CPUTier:
    """Chunks by key. What stays and what goes is the index's decision (engine/index.py)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._data: dict[bytes, torch.Tensor] = {}
        self.used = 0

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def put(self, key: bytes, data: torch.Tensor) -> None:
        self.delete(key)
        self._data[key] = data
        self.used += data.numel()

    def get(self, key: bytes) -> torch.Tensor | None:
        return self._data.get(key)

    def delete(self, key: bytes) -> None:
        old = self._data.pop(key, None)
        if old is not None:
            self.used -= old.numel()

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()
        self.used = 0
