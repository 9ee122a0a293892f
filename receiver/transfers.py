"""The receiver's table of incoming transfers: reserved -> arrived -> claimed, or gone.

A transfer is readable only once the sender's NIXL notification for it arrived (NIXL delivers a
transfer's data before its notification). The engine claims it by `transfer_id`; the claim pins
the pages while it copies them out and releases them on every exit path. A transfer that is
never written, or written and never read, loses its pages when its lease expires; its owner
calls `sweep()` now and then to notice (the receiver's NIXL thread, every 0.5 s).

No request ever reads another request's KV:

- Transfer ids are single-use: an alloc for an id that is live, has ended, or was aborted before
  its alloc came is refused (the ids of ended transfers are remembered, bounded).
- The pages of a transfer aborted before its data arrived are *quarantined*, not freed: its
  sender may still have a WRITE in flight into them. They come back when that write's
  notification arrives, when the sender that reserved them says it never wrote (a `final`
  abort on the same connection), when that connection closed (`writer_gone`: the sender died or
  dropped it, and a sender posts no write into pages reserved on a closed connection), or at the
  lease's end, after which no sender posts a write. An abort from anyone else (the proxy's: the
  client left) is told to that sender (`on_quarantine`), which then posts no more writes and
  answers with its own abort, final once nothing of it can land: the pages come back within
  milliseconds, not when the prefiller's compute step ends.
- A transfer whose decode request the decoder's scheduler already holds is *pinned*: once its
  data arrived it is kept for `queue_seconds` (pd_queue_seconds) instead of the lease, so a
  request queued behind others loads its KV instead of recomputing the prompt.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from kvferry.buffer.pd_buffer import PDBuffer, PDBufferError, Reservation, ReservationGone
from kvferry.common.errors import UnavailableError
from kvferry.common.log import get_logger

logger = get_logger(__name__)

BEFORE_ALLOC = " before its alloc"  # how an id aborted before its alloc is remembered


class TransferError(UnavailableError, RuntimeError):
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
    num_tokens: int
    res: Reservation
    conn: bytes = b""  # the connection that reserved it: only it may end the quarantine early
    arrived: bool = False
    arrived_at: float = 0.0  # time.monotonic() when the notification was processed


@dataclass
class ReceivedTransfer:
    """What the engine gets: the chunks' page views, in chunk order."""

    transfer_id: str
    chunk_keys: list[bytes]
    num_tokens: int
    pages: dict[int, Any]  # chunk index -> uint8 view (torch.Tensor) of its page
    arrived_at: float = 0.0


class TransferTable:
    """Thread-safe: the ports thread adds, the NIXL thread marks arrivals, engine threads claim."""

    ENDED_MEMORY = 16384  # ended ids remembered: "already read" vs "unknown", and no reuse of an id
    MAX_PINS = 65536
    MAX_LIVE = 65536

    def __init__(self, buffer: PDBuffer, lease_seconds: float = 30.0, queue_seconds: float = 600.0) -> None:
        self.buffer = buffer
        self.lease_seconds, self.queue_seconds = lease_seconds, queue_seconds
        self._cond = threading.Condition()
        self._live: dict[str, Incoming] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # transfer_id -> why it ended
        self._quarantine: dict[str, Incoming] = {}  # aborted, pages held until no WRITE can land
        self._pins: OrderedDict[str, None] = OrderedDict()
        self._gone: OrderedDict[bytes, None] = OrderedDict()  # closed connections: no new transfer on them
        self._expecting = 0  # live transfers not yet arrived; read by the NIXL thread every poll
        self.on_expecting: Callable[[int], None] | None = None  # told each change (a live gauge)
        # Told (under the table's lock: it must not block) each transfer quarantined by an abort
        # that did not come from the connection that reserved it, with the abort's reason.
        self.on_quarantine: Callable[[Incoming, str], None] | None = None
        self.counters = {"quarantined": 0, "late_writes": 0, "refused_ids": 0, "pinned": 0, "writer_gone": 0}

    def __contains__(self, transfer_id: str) -> bool:
        with self._cond:
            return transfer_id in self._live

    def refusal(self, transfer_id: str) -> str | None:
        """Why an alloc for `transfer_id` must be refused now (ids are single-use), or None."""
        with self._cond:
            if transfer_id in self._live:
                return f"transfer {transfer_id} is already in progress"
            why = self._ended.get(transfer_id)
            if why is not None:
                return f"transfer {transfer_id} already ended ({why}): transfer ids are single-use"
            if len(self._live) >= self.MAX_LIVE:
                return f"{len(self._live)} transfers are in progress, the most this receiver tracks"
            return None

    def aborted_before_alloc(self, transfer_id: str) -> bool:
        """Whether `transfer_id` was dropped before any alloc for it came (the proxy's abort: its
        client left while the prefiller had not scheduled the prompt yet)."""
        with self._cond:
            return self._ended.get(transfer_id, "").endswith(BEFORE_ALLOC)

    def add(self, inc: Incoming) -> None:
        """Start tracking `inc`; TransferError (the caller still owns the pages) when its id is
        taken or was aborted meanwhile."""
        with self._cond:
            why = None
            if inc.transfer_id in self._live:
                why = f"transfer {inc.transfer_id} is already in progress"
            elif inc.transfer_id in self._ended:
                why = f"transfer {inc.transfer_id} ended before its pages were granted ({self._ended[inc.transfer_id]})"
            elif inc.conn and inc.conn in self._gone:
                why = f"transfer {inc.transfer_id}: its sender's connection closed while it waited for pages"
            if why is not None:
                self.counters["refused_ids"] += 1
                raise TransferError(why)
            self._live[inc.transfer_id] = inc
            self._expect_locked(1)
            self._cond.notify_all()

    def expecting(self) -> int:
        """Transfers reserved whose data has not arrived yet (the NIXL thread polls fast then)."""
        return self._expecting  # an int read: no lock needed

    def arrived(self, transfer_id: str, generation: int) -> Incoming | None:
        """The sender's notification came: commit the pages. None if the transfer is gone."""
        with self._cond:
            inc = self._live.get(transfer_id)
            if inc is None:
                q = self._quarantine.get(transfer_id)
                if q is not None and q.res.generation == generation:
                    # The aborted transfer's WRITE has landed: nothing more can, the pages are free.
                    del self._quarantine[transfer_id]
                    self.buffer.release(q.res)
                    self.counters["late_writes"] += 1
                    logger.info("transfer %s: the write of an aborted transfer landed; its pages are free again",
                                transfer_id)
                    return None
            if inc is None or inc.res.generation != generation or inc.arrived:
                why = (self._ended.get(transfer_id, "unknown transfer") if inc is None
                       else "duplicate or stale generation")
                logger.warning("notification for transfer %s (generation %d) ignored: %s",
                               transfer_id, generation, why)
                return None
            pinned = transfer_id in self._pins
            try:
                self.buffer.commit(inc.res, read_within=self.queue_seconds if pinned else None)
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
        self._expect_locked(-1)

    def _expect_locked(self, delta: int) -> None:
        self._expecting += delta
        if self.on_expecting is not None:
            self.on_expecting(self._expecting)

    def _forget_locked(self, inc: Incoming, why: str) -> None:
        """Take `inc` out of the table (its pages are the caller's business)."""
        del self._live[inc.transfer_id]
        if not inc.arrived:
            self._expect_locked(-1)
        self._pins.pop(inc.transfer_id, None)
        self._remember_locked(inc.transfer_id, why)
        self._cond.notify_all()

    def _remember_locked(self, transfer_id: str, why: str) -> None:
        self._ended[transfer_id] = why
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > self.ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _end_locked(self, inc: Incoming, why: str) -> None:
        self._forget_locked(inc, why)
        self.buffer.release(inc.res)

    def abort(self, transfer_id: str, generation: int, reason: str, conn: bytes = b"", final: bool = False) -> bool:
        """Drop a transfer nobody will read. Arrived data is freed at once; pages a WRITE may still
        land in are quarantined (see the module docstring); an id not seen yet is remembered, so
        its late alloc is refused. `final` (its sender never wrote) counts only from `conn`, the
        connection that reserved the pages."""
        why = f"aborted ({reason})" if reason else "aborted"
        with self._cond:
            inc = self._live.get(transfer_id)
            if inc is None:
                q = self._quarantine.get(transfer_id)
                if q is not None and final and conn and conn == q.conn and \
                        (not generation or q.res.generation == generation):
                    del self._quarantine[transfer_id]
                    self.buffer.release(q.res)
                    return True
                if transfer_id not in self._ended:
                    self._remember_locked(transfer_id, why + BEFORE_ALLOC)
                    logger.info("transfer %s aborted before its alloc: %s", transfer_id, reason or "no reason")
                return False
            if generation and inc.res.generation != generation:
                return False
            logger.info("transfer %s aborted: %s", transfer_id, reason or "no reason given")
            if inc.arrived or (final and conn and conn == inc.conn):
                self._end_locked(inc, why)
            else:
                self._forget_locked(inc, why)
                self._quarantine[transfer_id] = inc
                self.counters["quarantined"] += 1
                if self.on_quarantine is not None and conn != inc.conn:
                    self.on_quarantine(inc, reason)
            return True

    def writer_gone(self, conn: bytes) -> int:
        """The connection `conn` that reserved pages closed a grace ago (see the module docstring):
        its pages without arrived data come back now; arrived data stays readable. Pages freed."""
        if not conn:
            return 0
        with self._cond:
            self._gone[conn] = None
            while len(self._gone) > self.MAX_PINS:
                self._gone.popitem(last=False)
            freed = 0
            for inc in [i for i in self._live.values() if i.conn == conn and not i.arrived]:
                self._end_locked(inc, "its sender's connection closed before the data arrived")
                freed += len(inc.res.pages)
            for tid in [t for t, q in self._quarantine.items() if q.conn == conn]:
                q = self._quarantine.pop(tid)
                self.buffer.release(q.res)
                freed += len(q.res.pages)
            if freed:
                self.counters["writer_gone"] += 1
                logger.info("a sender's connection closed: %d pages it reserved unwritten are free again", freed)
            return freed

    def quarantine_unarrived(self, why: str) -> int:
        """Abort every transfer whose data has not arrived (vLLM sleep mode): its pages are
        quarantined, as for any abort, until no WRITE can land in them. Returns how many."""
        with self._cond:
            todo = [(i.transfer_id, i.res.generation) for i in self._live.values() if not i.arrived]
        return sum(self.abort(tid, gen, why) for tid, gen in todo)

    def writes_may_land(self) -> bool:
        """Whether a sender may still WRITE into some page: a transfer reserved and not arrived,
        or a quarantined one."""
        with self._cond:
            return self._expecting > 0 or bool(self._quarantine)

    def renew(self, transfer_id: str, generation: int, conn: bytes) -> float | None:
        """Restart the lease of a transfer still being computed (see messages.RenewLease): its
        new length, or None if it is gone, arrived, or not `conn`'s."""
        with self._cond:
            inc = self._live.get(transfer_id)
            if inc is None or inc.arrived or inc.res.generation != generation or not conn or conn != inc.conn:
                return None
            return self.buffer.renew(inc.res, self.lease_seconds, self.queue_seconds)

    def pin(self, transfer_id: str) -> None:
        """The decode request for `transfer_id` is held by this decoder's scheduler: keep its data
        for queue_seconds once it arrived, not the lease (it is read when the request is scheduled)."""
        with self._cond:
            if transfer_id in self._ended:
                return
            self._pins[transfer_id] = None
            self._pins.move_to_end(transfer_id)
            while len(self._pins) > self.MAX_PINS:
                self._pins.popitem(last=False)
            self.counters["pinned"] += 1
            inc = self._live.get(transfer_id)
            if inc is not None and inc.arrived:
                self.buffer.extend(inc.res, self.queue_seconds)

    def unpin(self, transfer_id: str, why: str) -> None:
        """Its request ended: if it was not read, nobody will read it."""
        with self._cond:
            self._pins.pop(transfer_id, None)
        self.abort(transfer_id, 0, why)

    def sweep(self) -> int:
        """Forget transfers whose lease expired (the buffer already took their pages back)."""
        self.buffer.reap()
        with self._cond:
            dead = [i for i in self._live.values() if not self.buffer.is_live(i.res)]
            for inc in dead:
                logger.warning("transfer %s from %s: lease expired %s; its pages are free again",
                               inc.transfer_id, inc.sender_id,
                               "unread" if inc.arrived else "before the data arrived")
                self._end_locked(inc, "lease expired")
            for tid in [t for t, q in self._quarantine.items() if not self.buffer.is_live(q.res)]:
                del self._quarantine[tid]  # the lease ended: its pages are back, no write can come
            return len(dead)

    def wait(self, transfer_id: str, timeout: float) -> bool:
        """True once `transfer_id` arrived; False at the timeout; TransferGone if it ended."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                inc = self._live.get(transfer_id)
                if inc is not None and inc.arrived:
                    return True
                if inc is None and transfer_id in self._ended:
                    raise TransferGone(f"transfer {transfer_id}: {self._ended[transfer_id]}")
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
            return self._ended.get(transfer_id, "pending")

    def wait_any(self, transfer_ids: Collection[str], timeout: float) -> None:
        """Return once one of `transfer_ids` arrived or ended, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for tid in transfer_ids:
                    inc = self._live.get(tid)
                    if (inc is not None and inc.arrived) or (inc is None and tid in self._ended):
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
                raise TransferGone(f"transfer {transfer_id}: {self._ended.get(transfer_id, 'unknown')}")
            # Claimed: nobody else may read it, whatever happens next.
            self._forget_locked(inc, "already read")
        try:
            try:
                views = self.buffer.begin_read(inc.res)
            except PDBufferError as e:
                raise TransferGone(f"transfer {transfer_id}: {e}") from None
            yield ReceivedTransfer(transfer_id, inc.chunk_keys, inc.num_tokens, dict(enumerate(views)),
                                   inc.arrived_at)
        finally:
            self.buffer.release(inc.res)

    def sizes(self) -> dict[str, int]:
        """How much the table holds (for tests and stats: every one of these is bounded)."""
        with self._cond:
            return {"live": len(self._live), "ended": len(self._ended), "quarantine": len(self._quarantine),
                    "pins": len(self._pins)}

    def close(self) -> None:
        with self._cond:
            for inc in list(self._live.values()):
                self._end_locked(inc, "receiver closed")
            for q in self._quarantine.values():
                self.buffer.release(q.res)
            self._quarantine.clear()
