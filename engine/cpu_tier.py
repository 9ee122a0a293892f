"""The local CPU tier's data: chunk bytes in host memory (pinned when the KV lives on a GPU)."""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable

import torch

# (event, key, data): "put" or "delete", for the P2P side's reports and NIXL registrations.
Listener = Callable[[str, bytes, torch.Tensor], None]


class CPUTier:
    """Chunks by key. What stays and what goes is the index's decision (engine/index.py).

    Thread-safe: the P2P side serves, adopts and drops chunks from its own thread."""

    def __init__(self, pin: bool = False, capacity: int = 0) -> None:
        self.pin, self.capacity = pin, capacity
        self._data: dict[bytes, torch.Tensor] = {}
        self.used = 0
        self.listener: Listener | None = None
        self._lock = threading.Lock()
        self._warm: deque[torch.Tensor] = deque()
        self._warm_size = self._warm_count = 0
        self._refill = threading.Event()
        self._stop = False

    def alloc(self, nbytes: int) -> torch.Tensor:
        if nbytes == self._warm_size:
            try:
                t = self._warm.popleft()
            except IndexError:
                pass
            else:
                self._refill.set()
                return t
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def keep_warm(self, nbytes: int, max_bytes: int) -> None:
        """Keep up to `max_bytes` of `nbytes`-sized buffers touched ahead of use.

        The first touch of fresh memory costs page faults; on a VM that is slower than the copy
        into it (here: 48 MiB of fresh pages take 10-30 ms, a NIXL READ of them 6 ms). A background
        thread pays that before a chunk arrives rather than while a request waits for it."""
        self._warm_size, self._warm_count = nbytes, max(1, max_bytes // nbytes)
        threading.Thread(target=self._keep_warm, name="kvf-cpu-warm", daemon=True).start()

    def _keep_warm(self) -> None:
        while not self._stop:
            while len(self._warm) < self._warm_count and not self._stop:
                t = torch.empty(self._warm_size, dtype=torch.uint8, pin_memory=self.pin)
                ctypes.memset(t.data_ptr(), 0, self._warm_size)  # one thread, GIL released
                self._warm.append(t)
            self._refill.wait(1.0)
            self._refill.clear()

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

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def close(self) -> None:
        self._stop = True
        self._refill.set()
        self._warm.clear()
        self.clear()

    def clear(self) -> int:
        with self._lock:
            keys = list(self._data)
            for k in keys:
                self._pop(k)
        return len(keys)
