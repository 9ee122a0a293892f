"""pd_buffer: one NIXL-registered region split into equal pages, handed out in leased reservations.

A reservation is all-or-nothing, carries a generation number and a lease deadline, and moves
RESERVED -> COMMITTED (its data arrived) -> READING (being copied out) -> released. A RESERVED or
COMMITTED reservation whose lease passes is expired: its pages return to the free list and its
handle can never be read again. READING pins the pages (no expiry mid-copy) until release(),
which a reader calls on every exit path. Waiters for pages are served strictly first-in
first-out, so a large request cannot be starved by small ones, and a request larger than the
whole buffer fails at once.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvferry.common.errors import UnavailableError
from kvferry.common.log import get_logger
from kvferry.common.units import fmt_bytes

logger = get_logger(__name__)


class PDBufferError(UnavailableError, RuntimeError):
    """Base of pd_buffer errors; messages name pd_buffer_size or the key to change."""


class BufferTooSmall(PDBufferError):
    """The request can never fit, however long it waits."""


class BufferFullTimeout(PDBufferError):
    """The request could fit but no pages freed up within the timeout."""


class ReservationGone(PDBufferError):
    """The reservation was released or its lease expired: its pages may already be reused."""


class State(enum.Enum):
    RESERVED = "reserved"
    COMMITTED = "committed"
    READING = "reading"


@dataclass(frozen=True)
class Reservation:
    """A handle: which pages, and the generation that proves they are still ours."""

    rid: int
    generation: int
    pages: tuple[int, ...]
    owner: str


@dataclass
class _Record:
    res: Reservation
    state: State
    deadline: float
    lease_seconds: float
    created: float = 0.0


@dataclass
class _Waiter:
    n: int
    owner: str
    lease_seconds: float
    cond: threading.Condition
    granted: Reservation | None = None
    cancelled: bool = False
    aborted: str | None = None  # set by cancel_waiters(): why the wait ended early


@dataclass
class BufferStats:
    pages_total: int = 0
    pages_free: int = 0
    pages_reserved: int = 0
    pages_committed: int = 0
    pages_reading: int = 0
    reservations: int = 0
    leases_expired: int = 0
    too_large: int = 0
    timeouts: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    bytes_committed: int = 0
    bytes_read: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class PDBuffer:
    """A pd_buffer of `size_bytes` on `device` ("cpu" or "cuda[:N]"), in pages of `page_bytes`."""

    def __init__(self, size_bytes: int, device: str, page_bytes: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch

        if page_bytes <= 0:
            raise PDBufferError(f"page size must be positive, got {page_bytes}")
        num_pages = size_bytes // page_bytes
        if num_pages < 1:
            raise BufferTooSmall(
                f"pd_buffer_size {fmt_bytes(size_bytes)} holds no page of {fmt_bytes(page_bytes)} "
                f"(one chunk): raise pd_buffer_size to at least {page_bytes}")
        if num_pages * page_bytes != size_bytes:
            logger.info("pd_buffer_size %d is not a multiple of the %d-byte page: using %d pages (%s)",
                        size_bytes, page_bytes, num_pages, fmt_bytes(num_pages * page_bytes))
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.size_bytes = num_pages * page_bytes
        self.device = device
        self.tensor = torch.empty(self.size_bytes, dtype=torch.uint8, device=device)
        self._clock = clock
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: O(1) pop/push
        self._records: dict[int, _Record] = {}
        # (deadline, rid) of every lease set; stale ones (released, re-set, READING) are skipped when
        # they surface: a reserve finds what expired without scanning every reservation.
        self._deadlines: list[tuple[float, int]] = []
        self._waiters: deque[_Waiter] = deque()
        self._rids = itertools.count(1)
        self._generation = 0
        self._stats = BufferStats(pages_total=num_pages)
        self.on_free: Callable[[int], None] | None = None  # told the free page count on each change
        self._agent: Any = None
        self._reg_descs: Any = None

    # ---- memory ----
    @property
    def base_addr(self) -> int:
        return self.tensor.data_ptr()

    def page_addr(self, page: int) -> int:
        return self.base_addr + page * self.page_bytes

    def page(self, page: int):  # -> torch.Tensor (uint8 view of one page)
        return self.tensor[page * self.page_bytes:(page + 1) * self.page_bytes]

    def register(self, agent: Any) -> Any:
        """Register the whole region with a NIXL agent, once; returns its registration descriptors."""
        if self._agent is not None:
            if self._agent is agent:
                return self._reg_descs
            raise PDBufferError("pd_buffer is already registered with another NIXL agent")
        self._reg_descs = agent.register_memory(self.tensor)
        self._agent = agent
        return self._reg_descs

    def deregister(self) -> None:
        if self._agent is not None:
            self._agent.deregister_memory(self._reg_descs)
            self._agent = self._reg_descs = None

    # ---- reservations ----
    def _check_size(self, n: int) -> None:
        if n > self.num_pages:
            self._stats.too_large += 1
            raise BufferTooSmall(
                f"pd_buffer_size {fmt_bytes(self.size_bytes)} holds {self.num_pages} chunks; this "
                f"request needs {n}: raise pd_buffer_size to at least {n * self.page_bytes} bytes")

    def _grant(self, n: int, owner: str, lease_seconds: float) -> Reservation:
        pages = tuple(self._free.pop() for _ in range(n))
        self._generation += 1
        res = Reservation(next(self._rids), self._generation, pages, owner)
        now = self._clock()
        rec = self._records[res.rid] = _Record(res, State.RESERVED, now + lease_seconds, lease_seconds, now)
        self._push_deadline_locked(rec)
        self._stats.reservations += 1
        self._changed_locked()
        return res

    def _push_deadline_locked(self, rec: _Record) -> None:
        """Heap `rec`'s (new) deadline; rebuilt from the live records when stale entries outnumber them."""
        if len(self._deadlines) > 2 * len(self._records) + 64:
            self._deadlines = [(r.deadline, r.res.rid) for r in self._records.values() if r.state is not State.READING]
            heapq.heapify(self._deadlines)
        else:
            heapq.heappush(self._deadlines, (rec.deadline, rec.res.rid))

    def _earliest_locked(self) -> _Record | None:
        """The expirable record with the earliest deadline (stale heap entries dropped on the way)."""
        heap = self._deadlines
        while heap:
            deadline, rid = heap[0]
            rec = self._records.get(rid)
            if rec is not None and rec.deadline == deadline and rec.state is not State.READING:
                return rec
            heapq.heappop(heap)
        return None

    def _reap_locked(self) -> None:
        now = self._clock()
        while (rec := self._earliest_locked()) is not None and rec.deadline <= now:
            heapq.heappop(self._deadlines)
            logger.warning("lease of %s expired in state %s: %d pages returned",
                           rec.res.owner, rec.state.value, len(rec.res.pages))
            self._stats.leases_expired += 1
            self._drop_locked(rec)

    def _drop_locked(self, rec: _Record) -> None:
        del self._records[rec.res.rid]
        self._free.extend(rec.res.pages)
        self._changed_locked()
        self._serve_waiters_locked()

    def _changed_locked(self) -> None:
        if self.on_free is not None:
            self.on_free(len(self._free))

    def _serve_waiters_locked(self) -> None:
        while self._waiters:
            w = self._waiters[0]
            if w.cancelled:
                self._waiters.popleft()
                continue
            if w.n > len(self._free):
                return  # strict FIFO: nobody overtakes the head
            self._waiters.popleft()
            w.granted = self._grant(w.n, w.owner, w.lease_seconds)
            w.cond.notify()

    def _next_deadline_locked(self) -> float | None:
        rec = self._earliest_locked()
        return None if rec is None else rec.deadline

    def reserve(self, n: int, owner: str, lease_seconds: float, timeout: float = 0.0) -> Reservation:
        """All `n` pages or none; waits FIFO up to `timeout` seconds (0: do not wait)."""
        if n <= 0:
            raise PDBufferError(f"a reservation needs at least one page, got {n}")
        if lease_seconds <= 0:
            raise PDBufferError(f"lease must be positive, got {lease_seconds}")
        with self._lock:
            self._check_size(n)
            self._reap_locked()
            if not self._waiters and n <= len(self._free):
                return self._grant(n, owner, lease_seconds)
            if timeout <= 0:
                self._stats.timeouts += 1
                raise BufferFullTimeout(self._full_msg(n, 0.0))
            start = self._clock()
            deadline = start + timeout
            w = _Waiter(n, owner, lease_seconds, threading.Condition(self._lock))
            self._waiters.append(w)
            self._stats.waits += 1
            try:
                while w.granted is None:
                    if w.aborted is not None:
                        raise PDBufferError(f"wait for {n} pages abandoned: {w.aborted}")
                    now = self._clock()
                    if now >= deadline:
                        w.cancelled = True
                        self._stats.timeouts += 1
                        raise BufferFullTimeout(self._full_msg(n, timeout))
                    # Wake at the next lease deadline too: expiry frees pages without a reaper thread.
                    nxt = self._next_deadline_locked()
                    wake = deadline if nxt is None else min(deadline, max(nxt, now + 0.001))
                    w.cond.wait(max(0.0, wake - now))
                    if w.granted is None:
                        self._reap_locked()
                return w.granted
            finally:
                self._stats.wait_seconds += self._clock() - start
                if w.cancelled:
                    # Our leaving may unblock those behind us.
                    self._serve_waiters_locked()

    def cancel_waiters(self, reason: str) -> int:
        """End every waiting reserve() now with an error (its server is shutting down), so no
        thread stays blocked for the rest of its timeout; returns how many were waiting."""
        with self._lock:
            n = 0
            for w in self._waiters:
                if not w.cancelled:
                    w.cancelled = True
                    w.aborted = reason
                    w.cond.notify()
                    n += 1
            return n

    def _full_msg(self, n: int, waited: float) -> str:
        return (f"pd_buffer full: waited {waited:.1f}s for {n} of {self.num_pages} pages "
                f"({len(self._free)} free, {len(self._waiters)} waiting; pd_buffer_size "
                f"{fmt_bytes(self.size_bytes)}): raise pd_buffer_size or pd_alloc_timeout")

    def _live(self, res: Reservation, *states: State) -> _Record:
        rec = self._records.get(res.rid)
        if rec is None or rec.res.generation != res.generation:
            raise ReservationGone(f"reservation of {res.owner} (generation {res.generation}) was "
                                  "released or its lease expired")
        if rec.state not in states:
            raise PDBufferError(f"reservation of {res.owner} is {rec.state.value}, "
                                f"expected {' or '.join(s.value for s in states)}")
        return rec

    def commit(self, res: Reservation, nbytes: int | None = None, read_within: float | None = None) -> None:
        """Mark the data as arrived; the lease restarts as the time allowed to read it (its
        length, or `read_within` seconds)."""
        with self._lock:
            self._reap_locked()
            rec = self._live(res, State.RESERVED)
            rec.state = State.COMMITTED
            rec.deadline = self._clock() + (rec.lease_seconds if read_within is None else read_within)
            self._push_deadline_locked(rec)
            self._stats.bytes_committed += len(res.pages) * self.page_bytes if nbytes is None else nbytes

    def extend(self, res: Reservation, read_within: float) -> bool:
        """Give arrived data `read_within` more seconds to be read (a reader is known to be coming).
        Only COMMITTED data: a reservation still being written keeps the lease its writer was given."""
        with self._lock:
            self._reap_locked()
            try:
                rec = self._live(res, State.COMMITTED)
            except PDBufferError:
                return False
            rec.deadline = max(rec.deadline, self._clock() + read_within)
            self._push_deadline_locked(rec)
            return True

    def renew(self, res: Reservation, lease_seconds: float, max_hold: float) -> float | None:
        """Restart a RESERVED (not yet written-and-notified) reservation's lease, never past
        `max_hold` seconds from its creation: the new lease's length, or None if it is gone."""
        with self._lock:
            self._reap_locked()
            try:
                rec = self._live(res, State.RESERVED)
            except PDBufferError:
                return None
            now = self._clock()
            rec.deadline = max(rec.deadline, min(now + lease_seconds, rec.created + max_hold))
            self._push_deadline_locked(rec)
            return rec.deadline - now

    def begin_read(self, res: Reservation) -> list:
        """Pin committed pages for reading and return their views; call release() after."""
        with self._lock:
            self._reap_locked()
            rec = self._live(res, State.COMMITTED)
            rec.state = State.READING
            self._stats.bytes_read += len(res.pages) * self.page_bytes
        return [self.page(p) for p in res.pages]

    def release(self, res: Reservation) -> bool:
        """Return the pages; False if they were already gone (released or expired)."""
        with self._lock:
            rec = self._records.get(res.rid)
            if rec is None or rec.res.generation != res.generation:
                return False
            self._drop_locked(rec)
            return True

    def reap(self) -> None:
        """Expire overdue leases now (also done lazily by every other call)."""
        with self._lock:
            self._reap_locked()

    def is_live(self, res: Reservation) -> bool:
        with self._lock:
            rec = self._records.get(res.rid)
            return rec is not None and rec.res.generation == res.generation

    # ---- accounting ----
    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    def fully_free(self) -> bool:
        with self._lock:
            self._reap_locked()
            return len(self._free) == self.num_pages and not self._records

    def stats(self) -> BufferStats:
        with self._lock:
            s = BufferStats(**{k: v for k, v in vars(self._stats).items() if k != "extra"})
            s.pages_free = len(self._free)
            for rec in self._records.values():
                n = len(rec.res.pages)
                if rec.state is State.RESERVED:
                    s.pages_reserved += n
                elif rec.state is State.COMMITTED:
                    s.pages_committed += n
                else:
                    s.pages_reading += n
            s.extra = {"waiting": len(self._waiters)}
            return s
