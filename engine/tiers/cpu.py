"""The local CPU tier's data: chunk bytes in host memory (pinned when the KV lives on a GPU)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from kvferry.common.units import fmt_bytes
from kvferry.engine.tiers.host_arena import HostArena
from kvferry.engine.tiers.interface import LoadRequest

logger = logging.getLogger(__name__)

# (event, key, data): "put" or "delete", for the P2P side's reports and NIXL registrations.
Listener = Callable[[str, bytes, torch.Tensor], None]


class CPUTier:
    """Chunks by key. What stays and what goes is the index's decision (engine/offload/index.py).

    Thread-safe: the P2P side serves, adopts and drops chunks from its own thread."""

    name = "cpu"

    def __init__(self, pin: bool = False, capacity: int = 0, slot_bytes: int = 0) -> None:
        """`slot_bytes` (a full chunk's size) > 0 on host KV: chunks live in one HostArena."""
        self.pin, self.capacity = pin, capacity
        self._data: dict[bytes, torch.Tensor] = {}
        self.used = 0
        self.listener: Listener | None = None
        self._lock = threading.Lock()
        self.arena: HostArena | None = None
        # Pinned (CUDA KV) chunks keep torch's pinned allocator: one pinned arena would need
        # cudaHostRegister of all of max_local_cpu_size at start, untested without a GPU here.
        if slot_bytes and not pin and capacity >= slot_bytes:
            try:
                self.arena = HostArena(capacity, slot_bytes)
            except RuntimeError as e:  # e.g. more than the machine will reserve at once
                logger.warning("CPU tier: cannot reserve max_local_cpu_size %s at once (%s); chunks get their "
                               "own memory (slower P2P reads)", fmt_bytes(capacity), e)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Memory for a chunk: an arena slot while one is free, else its own."""
        t = self.arena.alloc(nbytes) if self.arena is not None else None
        if t is None:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return t

    def put(self, key: bytes, data: torch.Tensor) -> None:
        with self._lock:
            old = self._data.get(key)
            if old is data:
                return
            self._pop(key)
            self._data[key] = data
            self.used += data.numel()
            if self.listener is not None:  # under the lock: events arrive in the order they happened
                self.listener("put", key, data)

    def get(self, key: bytes) -> torch.Tensor | None:
        return self._data.get(key)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            old = self._pop(key)
        return old is not None

    def _pop(self, key: bytes) -> torch.Tensor | None:
        old = self._data.pop(key, None)
        if old is not None:
            self.used -= old.numel()
            if self.listener is not None:
                self.listener("delete", key, old)
        return old

    # ---- the Tier interface (engine/tiers/interface.py) ----
    def prefetch(self, req: LoadRequest) -> None:
        pass

    def fetch(self, key: bytes, tokens: int, nbytes: int) -> torch.Tensor | None:
        return self.get(key)

    def store(self, key: bytes, data: torch.Tensor, tokens: int) -> None:
        self.put(key, data)

    def remove(self, key: bytes) -> None:
        self.delete(key)

    def take_lost(self) -> set[bytes]:
        return set()

    def stats(self) -> dict[str, float]:
        return {}

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        self.clear()

    def clear(self) -> int:
        with self._lock:
            keys = list(self._data)
            for k in keys:
                self._pop(k)
        return len(keys)
