"""One host allocation carved into chunk-sized slots, for the CPU tier.

Why one allocation: NIXL (UCX) moves data out of a registration it has used before much faster
than out of a new one, so the P2P side registers the arena once and never per chunk. LMCache also
reserves its CPU buffer up front.

A slot is free again when the last tensor viewing it is gone (its storage holds the slot object),
so a chunk that left the tier but is still being read — by a peer's lease, a load — is never
handed out for new data while in use.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections import deque

import torch

WARM_BYTES = 256 << 20


class HostArena:
    """`nbytes` of host memory (virtual until used) in slots of `slot_bytes`. Thread-safe."""

    def __init__(self, nbytes: int, slot_bytes: int, warm_bytes: int = WARM_BYTES) -> None:
        n = nbytes // slot_bytes
        if n < 1:
            raise ValueError(f"an arena of {nbytes} bytes holds no slot of {slot_bytes} bytes")
        self.slot_bytes, self.num_slots = slot_bytes, n
        self.buf = torch.empty(n * slot_bytes, dtype=torch.uint8)  # pages are only touched when used
        self.base = self.buf.data_ptr()
        arena = self

        class _Slot(ctypes.c_uint8 * slot_bytes):  # type: ignore[misc]  # a ctypes array type made at run time
            """The buffer behind one slot's tensors; collected with the last of them."""

            def __del__(self) -> None:
                arena._warm.append(self.idx)  # deque.append is atomic: no lock in a finalizer
                arena._refill.set()

        self._slot_type = _Slot
        self._cold: deque[int] = deque(range(n))  # never touched
        self._warm: deque[int] = deque()  # touched: writing into it costs no page fault
        self._warm_target = max(1, min(warm_bytes, nbytes // 4) // slot_bytes)
        self._refill = threading.Event()
        self._cv = threading.Condition()
        self._touching = 0  # slots the warm thread holds while touching them: free, in neither deque
        self._quiet = 0  # > 0: transfers in or out of the arena are running; touching waits
        self._stop = False
        threading.Thread(target=self._keep_warm, name="kvf-arena-warm", daemon=True).start()

    def alloc(self, nbytes: int) -> torch.Tensor | None:
        """A tensor of `nbytes` in a free slot, or None (empty, too big, or every slot in use)."""
        if not 0 < nbytes <= self.slot_bytes:
            return None
        deadline = time.monotonic() + 1.0
        with self._cv:
            while True:
                idx = self._pop()
                if idx is not None or not self._touching or time.monotonic() > deadline:
                    break
                self._cv.wait(0.05)  # a touch of one slot takes milliseconds
        if idx is None:
            return None
        self._refill.set()
        slot = self._slot_type.from_address(self.base + idx * self.slot_bytes)
        slot.idx = idx  # its class holds the arena: the memory stays while any view of it does
        return torch.frombuffer(slot, dtype=torch.uint8, count=nbytes)

    def _pop(self) -> int | None:
        for free in (self._warm, self._cold):
            try:
                return free.popleft()
            except IndexError:
                pass
        return None

    def holds(self, t: torch.Tensor) -> bool:
        return self.base <= t.data_ptr() < self.base + self.buf.numel()

    @property
    def free_slots(self) -> int:
        return len(self._warm) + len(self._cold) + self._touching

    def _keep_warm(self) -> None:
        """Touch free slots ahead of use: a fresh page's fault can cost more than the copy into it.
        Only on otherwise idle cores: the touching must not slow the copies and forward passes it is
        meant to speed up."""
        # Safe with the GIL: this thread holds it only between memsets (microseconds), and a thread
        # waiting for it leaves the core idle, so this one runs and lets go.
        with contextlib.suppress(AttributeError, OSError):  # Linux: this thread only
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while not self._stop:
            self._refill.clear()  # before looking: a set() from now on wakes the wait below
            while len(self._warm) < self._warm_target and not self._quiet and not self._stop:
                with self._cv:
                    try:
                        idx = self._cold.pop()
                    except IndexError:
                        break
                    self._touching += 1
                try:
                    ctypes.memset(self.base + idx * self.slot_bytes, 0, self.slot_bytes)  # GIL released
                finally:
                    with self._cv:
                        self._warm.append(idx)
                        self._touching -= 1
                        self._cv.notify_all()
            self._refill.wait(1.0)

    def pause(self) -> None:
        """Touch nothing until resume(): a NIXL transfer in or out of the arena runs on the same
        cores, and touching 48 MiB ahead costs as much CPU as the transfer, which it would slow
        down. Pauses nest."""
        with self._cv:
            self._quiet += 1

    def resume(self) -> None:
        with self._cv:
            self._quiet = max(0, self._quiet - 1)
        self._refill.set()

    def close(self) -> None:
        self._stop = True
        self._refill.set()
