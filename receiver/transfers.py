"""The receiver's table of incoming transfers: reserved -> arrived -> claimed, or gone.

A transfer is readable only once the sender's NIXL notification for it arrived (NIXL delivers a
transfer's data before its notification). The engine claims it by `transfer_id`; the claim pins
the pages while it copies them out and releases them on every exit path. A transfer that is
never written, or written and never read, loses its pages when its lease expires; its owner
calls `sweep()` now and then to notice (the receiver's NIXL thread, every 0.5 s).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from kvferry.buffer.pd_buffer import PDBuffer, PDBufferError, Reservation, ReservationGone
from kvferry.common.log import get_logger

logger = get_logger(__name__)


class TransferError(RuntimeError):
    """A transfer cannot be handed over; the message says why and which key bounds it."""


class TransferTimeout(TransferError):
    """The KV did not arrive within pd_kv_ready_timeout."""


class TransferGone(TransferError):
    """Already read, aborted, or its lease expired."""


@dataclass
class Incoming:
    transfer_id: str
    sender_id: str
    chunk_keys: list[bytes]
    skip: list[int]  # chunk indices the receiver already held: not sent
    num_tokens: int
    res: Reservation | None  # None when every chunk was skipped
    arrived: bool = False
    arrived_at: float = 0.0  # time.monotonic() when the notification was processed

    @property
    def sent_indices(self) -> list[int]:
        skipped = set(self.skip)
        return [i for i in range(len(self.chunk_keys)) if i not in skipped]


@dataclass
class ReceivedTransfer:
    """What the engine gets: the sent chunks' page views, in chunk order, and what was skipped."""

    transfer_id: str
    chunk_keys: list[bytes]
    num_tokens: int
    skip: list[int]
    pages: dict[int, object]  # chunk index -> uint8 view of its page (sent chunks only)
    arrived_at: float = 0.0


class TransferTable:
    """Thread-safe: the ports thread adds, the NIXL thread marks arrivals, engine threads claim."""

    _FINISHED_MEMORY = 4096  # recently finished ids, to tell "already read" from "unknown"

    def __init__(self, buffer: PDBuffer) -> None:
        self.buffer = buffer
        self._cond = threading.Condition()
        self._live: dict[str, Incoming] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()  # transfer_id -> why it ended
        self._by_key: dict[bytes, str] = {}
        self._expecting = 0  # live transfers not yet arrived; read by the NIXL thread every poll

    def __contains__(self, transfer_id: str) -> bool:
        with self._cond:
            return transfer_id in self._live

    def add(self, inc: Incoming) -> None:
        with self._cond:
            if inc.transfer_id in self._live:
                raise TransferError(f"transfer {inc.transfer_id} is already in progress")
            self._live[inc.transfer_id] = inc
            self._expecting += 1
            if inc.res is None:  # nothing to send: complete at once
                self._arrive_locked(inc)
            self._cond.notify_all()

    def expecting(self) -> int:
        """Transfers reserved whose data has not arrived yet (the NIXL thread polls fast then)."""
        return self._expecting  # an int read: no lock needed

    def arrived(self, transfer_id: str, generation: int) -> Incoming | None:
        """The sender's notification came: commit the pages. None if the transfer is gone."""
        with self._cond:
            inc = self._live.get(transfer_id)
            if inc is None or inc.res is None or inc.res.generation != generation or inc.arrived:
                why = (self._finished.get(transfer_id, "unknown transfer") if inc is None
                       else "duplicate or stale generation")
                logger.warning("notification for transfer %s (generation %d) ignored: %s",
                               transfer_id, generation, why)
                return None
            try:
                self.buffer.commit(inc.res)
            except ReservationGone:
                self._end_locked(inc, "lease expired before the data arrived")
                logger.warning("transfer %s arrived after its lease expired: dropped; raise "
                               "pd_lease_seconds if writes take that long", transfer_id)
                return None
            self._arrive_locked(inc)
            self._cond.notify_all()
            return inc

    def _arrive_locked(self, inc: Incoming) -> None:
        inc.arrived = True
        inc.arrived_at = time.monotonic()
        self._expecting -= 1
        for i in inc.sent_indices:
            self._by_key[inc.chunk_keys[i]] = inc.transfer_id

    def _forget_locked(self, inc: Incoming, why: str) -> None:
        """Take `inc` out of the table (its pages are the caller's business)."""
        del self._live[inc.transfer_id]
        if not inc.arrived:
            self._expecting -= 1
        for k in inc.chunk_keys:
            if self._by_key.get(k) == inc.transfer_id:
                del self._by_key[k]
        self._finished[inc.transfer_id] = why
        while len(self._finished) > self._FINISHED_MEMORY:
            self._finished.popitem(last=False)
        self._cond.notify_all()

    def _end_locked(self, inc: Incoming, why: str) -> None:
        self._forget_locked(inc, why)
        if inc.res is not None:
            self.buffer.release(inc.res)

    def abort(self, transfer_id: str, generation: int, reason: str) -> bool:
        with self._cond:
            inc = self._live.get(transfer_id)
            if inc is None or (generation and inc.res is not None and inc.res.generation != generation):
                return False
            logger.info("transfer %s aborted by its sender: %s", transfer_id, reason or "no reason given")
            self._end_locked(inc, f"aborted by the sender ({reason})" if reason else "aborted by the sender")
            return True

    def sweep(self) -> int:
        """Forget transfers whose lease expired (the buffer already took their pages back)."""
        self.buffer.reap()
        with self._cond:
            dead = [i for i in self._live.values() if i.res is not None and not self.buffer.is_live(i.res)]
            for inc in dead:
                logger.warning("transfer %s from %s: lease expired %s; its pages are free again",
                               inc.transfer_id, inc.sender_id,
                               "unread" if inc.arrived else "before the data arrived")
                self._end_locked(inc, "lease expired")
            return len(dead)

    def lookup(self, key: bytes) -> str | None:
        """The arrived, unread transfer holding the chunk `key`, if any."""
        with self._cond:
            return self._by_key.get(key)

    def wait(self, transfer_id: str, timeout: float) -> bool:
        """True once `transfer_id` arrived; False at the timeout; TransferGone if it ended."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                inc = self._live.get(transfer_id)
                if inc is not None and inc.arrived:
                    return True
                if inc is None and transfer_id in self._finished:
                    raise TransferGone(f"transfer {transfer_id}: {self._finished[transfer_id]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)  # arrivals and sweep()'s expiries notify

    def status(self, transfer_id: str) -> str:
        """'arrived', 'pending' (reserved, or not announced yet) or why it ended; never blocks."""
        with self._cond:
            inc = self._live.get(transfer_id)
            if inc is not None:
                return "arrived" if inc.arrived else "pending"
            return self._finished.get(transfer_id, "pending")

    def wait_any(self, transfer_ids: Collection[str], timeout: float) -> None:
        """Return once one of `transfer_ids` arrived or ended, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for tid in transfer_ids:
                    inc = self._live.get(tid)
                    if (inc is not None and inc.arrived) or (inc is None and tid in self._finished):
                        return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    @contextlib.contextmanager
    def claim(self, transfer_id: str, timeout: float) -> Iterator[ReceivedTransfer]:
        """Wait (bounded) for the transfer, pin its pages, hand them over, release on exit."""
        if not self.wait(transfer_id, timeout):
            raise TransferTimeout(f"KV of transfer {transfer_id} did not arrive within {timeout:.1f}s "
                                  "(pd_kv_ready_timeout): is the prefiller reaching this decoder's ports?")
        with self._cond:
            inc = self._live.get(transfer_id)
            if inc is None:
                raise TransferGone(f"transfer {transfer_id}: {self._finished.get(transfer_id, 'unknown')}")
            # Claimed: nobody else may read it, whatever happens next.
            self._forget_locked(inc, "already read")
        views: list = []
        try:
            if inc.res is not None:
                try:
                    views = self.buffer.begin_read(inc.res)
                except PDBufferError as e:
                    raise TransferGone(f"transfer {transfer_id}: {e}") from None
            yield ReceivedTransfer(transfer_id, inc.chunk_keys, inc.num_tokens, inc.skip,
                                   dict(zip(inc.sent_indices, views, strict=True)), inc.arrived_at)
        finally:
            if inc.res is not None:
                self.buffer.release(inc.res)

    def close(self) -> None:
        with self._cond:
            for inc in list(self._live.values()):
                self._end_locked(inc, "receiver closed")
