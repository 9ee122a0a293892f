"""Where each of a receiver's transfers stands: reserved, arrived, or ended (and why), under one
condition that every change notifies, so that engine threads can wait for an arrival.

The table (receiver/transfer_table.py) makes every change, by its rules (single-use ids, quarantine,
pins, leases), holding `cond`; this module records the changes, counts the transfers whose data
is still expected, and answers, or waits for, where a transfer stands. Apart so that the rules
read without the bookkeeping, and a reader's wait without the rules.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvferry.buffer.pd_buffer import Reservation
from kvferry.receiver.errors import TransferGone


@dataclass
class Incoming:
    transfer_id: str
    sender_id: str
    chunk_keys: list[bytes]
    num_tokens: int
    res: Reservation
    conn: bytes = b""  # the connection that reserved it: only it may end the quarantine early
    arrived: bool = False
    arrived_at: float = 0.0  # time.monotonic() when the notification was processed


class TransferStates:
    """Live transfers by id, and the ids that ended with why. Hold `cond` around `track`, `arrive`,
    `forget` and `remember`, and any read of `live` or `ended`; `wait`, `status` and `wait_any`
    take it themselves. `on_expecting` is told each change of `expecting` (under `cond`: it must
    not block)."""

    ENDED_MEMORY = 16384  # ended ids remembered: "already read" vs "unknown", and no reuse of an id

    def __init__(self, on_expecting: Callable[[int], None]) -> None:
        self.cond = threading.Condition()
        self.live: dict[str, Incoming] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # transfer_id -> why it ended
        self.expecting = 0  # live transfers not yet arrived; an int, read without the lock
        self._on_expecting = on_expecting

    def track(self, inc: Incoming) -> None:
        self.live[inc.transfer_id] = inc
        self._expect(1)
        self.cond.notify_all()

    def arrive(self, inc: Incoming) -> None:
        inc.arrived = True
        inc.arrived_at = time.monotonic()
        self._expect(-1)
        self.cond.notify_all()

    def forget(self, inc: Incoming, why: str) -> None:
        """Take `inc` out (its pages are the caller's business); `why` it ended is remembered."""
        del self.live[inc.transfer_id]
        if not inc.arrived:
            self._expect(-1)
        self.remember(inc.transfer_id, why)
        self.cond.notify_all()

    def remember(self, transfer_id: str, why: str) -> None:
        self.ended[transfer_id] = why
        self.ended.move_to_end(transfer_id)
        while len(self.ended) > self.ENDED_MEMORY:
            self.ended.popitem(last=False)

    def _expect(self, delta: int) -> None:
        self.expecting += delta
        self._on_expecting(self.expecting)

    def wait(self, transfer_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                inc = self.live.get(transfer_id)
                if inc is not None and inc.arrived:
                    return True
                if inc is None and transfer_id in self.ended:
                    raise TransferGone(f"transfer {transfer_id}: {self.ended[transfer_id]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)  # arrivals and the table's expiries notify

    def status(self, transfer_id: str) -> str:
        with self.cond:
            inc = self.live.get(transfer_id)
            if inc is not None:
                return "arrived" if inc.arrived else "pending"
            return self.ended.get(transfer_id, "pending")

    def wait_any(self, transfer_ids: Collection[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for tid in transfer_ids:
                    inc = self.live.get(tid)
                    if (inc is not None and inc.arrived) or (inc is None and tid in self.ended):
                        return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)
