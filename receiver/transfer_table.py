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
  sender may still have a WRITE in flight into them (receiver/quarantine.py says when they come
  back; `writer_gone`: the connection that reserved them closed). An abort from anyone else (the
  proxy's: the client left) is told to that sender (`on_quarantine`), which then posts no more
  writes and answers with its own abort, final once nothing of it can land: the pages come back
  within milliseconds, not when the prefiller's compute step ends.
- A transfer whose decode request the decoder's scheduler already holds is *pinned*: once its
  data arrived it is kept for `queue_seconds` (pd_queue_seconds) instead of the lease, so a
  request queued behind others loads its KV instead of recomputing the prompt.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from kvferry.buffer.pd_buffer import PDBuffer, PDBufferError, ReservationGone
from kvferry.common.log import get_logger
from kvferry.receiver.errors import TransferError, TransferGone, TransferTimeout
from kvferry.receiver.quarantine import Quarantine
from kvferry.receiver.transfer_states import Incoming, TransferStates

logger = get_logger(__name__)

BEFORE_ALLOC = " before its alloc"  # how an id aborted before its alloc is remembered


@dataclass
class ReceivedTransfer:
    """What the engine gets: the chunks' page views, in chunk order."""

    transfer_id: str
    chunk_keys: list[bytes]
    num_tokens: int
    pages: dict[int, Any]  # chunk index -> uint8 view (torch.Tensor) of its page
    arrived_at: float = 0.0


class TransferTable:
    """Thread-safe: the ports thread adds, the NIXL thread marks arrivals, engine threads claim. Where
    each transfer stands is kept in its `TransferStates` (receiver/transfer_states.py), whose
    condition is the table's lock."""

    MAX_PINS = 65536
    MAX_LIVE = 65536

    def __init__(self, buffer: PDBuffer, lease_seconds: float = 30.0, queue_seconds: float = 600.0) -> None:
        self.buffer = buffer
        self.lease_seconds, self.queue_seconds = lease_seconds, queue_seconds
        self._states = TransferStates(self._expecting_changed)
        self._cond = self._states.cond
        self._quarantine = Quarantine(buffer, self.MAX_PINS)  # aborted, pages held until no WRITE can land
        self._pins: OrderedDict[str, None] = OrderedDict()
        self.on_expecting: Callable[[int], None] | None = None  # told each change (a live gauge)
        # Told (under the table's lock: it must not block) each transfer quarantined by an abort
        # that did not come from the connection that reserved it, with the abort's reason.
        self.on_quarantine: Callable[[Incoming, str], None] | None = None
        self.counters = {"quarantined": 0, "late_writes": 0, "refused_ids": 0, "pinned": 0, "writer_gone": 0}

    def __contains__(self, transfer_id: str) -> bool:
        with self._cond:
            return transfer_id in self._states.live

    def refusal(self, transfer_id: str) -> str | None:
        """Why an alloc for `transfer_id` must be refused now (ids are single-use), or None."""
        with self._cond:
            if transfer_id in self._states.live:
                return f"transfer {transfer_id} is already in progress"
            why = self._states.ended.get(transfer_id)
            if why is not None:
                return f"transfer {transfer_id} already ended ({why}): transfer ids are single-use"
            if len(self._states.live) >= self.MAX_LIVE:
                return f"{len(self._states.live)} transfers are in progress, the most this receiver tracks"
            return None

    def aborted_before_alloc(self, transfer_id: str) -> bool:
        """Whether `transfer_id` was dropped before any alloc for it came (the proxy's abort: its
        client left while the prefiller had not scheduled the prompt yet)."""
        with self._cond:
            return self._states.ended.get(transfer_id, "").endswith(BEFORE_ALLOC)

    def add(self, inc: Incoming) -> None:
        """Start tracking `inc`; TransferError (the caller still owns the pages) when its id is
        taken or was aborted meanwhile."""
        with self._cond:
            why = None
            if inc.transfer_id in self._states.live:
                why = f"transfer {inc.transfer_id} is already in progress"
            elif inc.transfer_id in self._states.ended:
                why = (f"transfer {inc.transfer_id} ended before its pages were granted "
                       f"({self._states.ended[inc.transfer_id]})")
            elif inc.conn and self._quarantine.closed(inc.conn):
                why = f"transfer {inc.transfer_id}: its sender's connection closed while it waited for pages"
            if why is not None:
                self.counters["refused_ids"] += 1
                raise TransferError(why)
            self._states.track(inc)

    def expecting(self) -> int:
        """Transfers reserved whose data has not arrived yet (the NIXL thread polls often then)."""
        return self._states.expecting  # an int read: no lock needed

    def _expecting_changed(self, n: int) -> None:
        if self.on_expecting is not None:
            self.on_expecting(n)

    def arrived(self, transfer_id: str, generation: int) -> Incoming | None:
        """The sender's notification came: commit the pages. None if the transfer is gone."""
        with self._cond:
            inc = self._states.live.get(transfer_id)
            if inc is None and self._quarantine.landed(transfer_id, generation):
                self.counters["late_writes"] += 1
                return None
            if inc is None or inc.res.generation != generation or inc.arrived:
                why = (self._states.ended.get(transfer_id, "unknown transfer") if inc is None
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
            self._states.arrive(inc)
            return inc

    def _forget_locked(self, inc: Incoming, why: str) -> None:
        """Take `inc` out of the table (its pages are the caller's business)."""
        self._pins.pop(inc.transfer_id, None)
        self._states.forget(inc, why)

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
            inc = self._states.live.get(transfer_id)
            if inc is None:
                if final and self._quarantine.never_written(transfer_id, generation, conn):
                    return True
                if transfer_id not in self._states.ended:
                    self._states.remember(transfer_id, why + BEFORE_ALLOC)
                    logger.info("transfer %s aborted before its alloc: %s", transfer_id, reason or "no reason")
                return False
            if generation and inc.res.generation != generation:
                return False
            logger.info("transfer %s aborted: %s", transfer_id, reason or "no reason given")
            if inc.arrived or (final and conn and conn == inc.conn):
                self._end_locked(inc, why)
            else:
                self._forget_locked(inc, why)
                self._quarantine.hold(transfer_id, inc.res, inc.conn)
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
            freed = self._quarantine.writer_gone(conn)
            for inc in [i for i in self._states.live.values() if i.conn == conn and not i.arrived]:
                self._end_locked(inc, "its sender's connection closed before the data arrived")
                freed += len(inc.res.pages)
            if freed:
                self.counters["writer_gone"] += 1
                logger.info("a sender's connection closed: %d pages it reserved unwritten are free again", freed)
            return freed

    def quarantine_unarrived(self, why: str) -> int:
        """Abort every transfer whose data has not arrived (vLLM sleep mode): its pages are
        quarantined, as for any abort, until no WRITE can land in them. Returns how many."""
        with self._cond:
            todo = [(i.transfer_id, i.res.generation) for i in self._states.live.values() if not i.arrived]
        return sum(self.abort(tid, gen, why) for tid, gen in todo)

    def writes_may_land(self) -> bool:
        """Whether a sender may still WRITE into some page: a transfer reserved and not arrived,
        or a quarantined one."""
        with self._cond:
            return self._states.expecting > 0 or len(self._quarantine) > 0

    def renew(self, transfer_id: str, generation: int, conn: bytes) -> float | None:
        """Restart the lease of a transfer still being computed (see messages.RenewLease): its
        new length, or None if it is gone, arrived, or not `conn`'s."""
        with self._cond:
            inc = self._states.live.get(transfer_id)
            if inc is None or inc.arrived or inc.res.generation != generation or not conn or conn != inc.conn:
                return None
            return self.buffer.renew(inc.res, self.lease_seconds, self.queue_seconds)

    def pin(self, transfer_id: str) -> None:
        """The decode request for `transfer_id` is held by this decoder's scheduler: keep its data
        for queue_seconds once it arrived, not the lease (it is read when the request is scheduled)."""
        with self._cond:
            if transfer_id in self._states.ended:
                return
            self._pins[transfer_id] = None
            self._pins.move_to_end(transfer_id)
            while len(self._pins) > self.MAX_PINS:
                self._pins.popitem(last=False)
            self.counters["pinned"] += 1
            inc = self._states.live.get(transfer_id)
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
            dead = [i for i in self._states.live.values() if not self.buffer.is_live(i.res)]
            for inc in dead:
                logger.warning("transfer %s from %s: lease expired %s; its pages are free again",
                               inc.transfer_id, inc.sender_id,
                               "unread" if inc.arrived else "before the data arrived")
                self._end_locked(inc, "lease expired")
            self._quarantine.expire()
            return len(dead)

    def wait(self, transfer_id: str, timeout: float) -> bool:
        """True once `transfer_id` arrived; False at the timeout; TransferGone if it ended."""
        return self._states.wait(transfer_id, timeout)

    def status(self, transfer_id: str) -> str:
        """'arrived', 'pending' (reserved, or not announced yet) or why it ended; never blocks."""
        return self._states.status(transfer_id)

    def wait_any(self, transfer_ids: Collection[str], timeout: float) -> None:
        """Return once one of `transfer_ids` arrived or ended, or after `timeout` seconds."""
        self._states.wait_any(transfer_ids, timeout)

    @contextlib.contextmanager
    def claim(self, transfer_id: str, timeout: float) -> Iterator[ReceivedTransfer]:
        """Wait (bounded) for the transfer, pin its pages, hand them over, release on exit."""
        if not self.wait(transfer_id, timeout):
            raise TransferTimeout(f"KV of transfer {transfer_id} did not arrive within {timeout:.1f}s "
                                  "(pd_kv_ready_timeout): is the prefiller reaching this decoder's ports?")
        with self._cond:
            inc = self._states.live.get(transfer_id)
            if inc is None:
                raise TransferGone(f"transfer {transfer_id}: {self._states.ended.get(transfer_id, 'unknown')}")
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
            return {"live": len(self._states.live), "ended": len(self._states.ended),
                    "quarantine": len(self._quarantine), "pins": len(self._pins)}

    def close(self) -> None:
        with self._cond:
            for inc in list(self._states.live.values()):
                self._end_locked(inc, "receiver closed")
            self._quarantine.release_all()
