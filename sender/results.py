"""What a sender reports: each write's `SendResult`, and its counters since it started.

Apart from sender/kv_sender.py so that the modules that finish its writes and count its
transfers (sender/grant_ends.py) need not import the sender itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvferry.common.counters import Counters
from kvferry.sender.grants import Grant

# The histogram of alloc round trips (alloc request sent -> answer or timeout), one sample per
# SenderCounters.waited: a KVSender's `samples` (connector/stats.py exports it).
ALLOC_SAMPLES = "pd_alloc_latency_seconds"


@dataclass
class SenderCounters(Counters):
    """What one sender did since it started; the pd tier exports these as metrics."""

    transfers: int = 0
    failed: int = 0
    bytes: int = 0
    handshakes: int = 0
    alloc_wait_seconds: float = 0.0  # alloc request sent -> pages granted or refused
    alloc_waits: int = 0

    def waited(self, sent_at: float) -> float:
        """One alloc answered (or timed out) now, asked at `sent_at`: counted; returns the wait."""
        dt = time.monotonic() - sent_at
        self.alloc_wait_seconds += dt
        self.alloc_waits += 1
        return dt


@dataclass
class SendResult:
    transfer_id: str
    sent_chunks: int
    bytes: int
    seconds: float
    handshook: bool = False
    # Where the time went, in seconds (transfer_bench.py prints them): "alloc" (request sent ->
    # pages granted), "to_nixl" (write asked -> posted by the NIXL thread), "write" (posted ->
    # NIXL done, which includes the notification's send), and "handshake" when one was made.
    phases: dict[str, float] = field(default_factory=dict)
    posted_at: float = 0.0  # time.monotonic() when the NIXL thread posted the (last) write


def grant_result(grant: Grant, called: float, posted: float, done: float) -> SendResult:
    """The result of a write into `grant` asked at `called`, posted and done at those times."""
    phases = dict(grant.phases, to_nixl=posted - called, write=done - posted)
    return SendResult(grant.transfer_id, grant.chunks, grant.written, done - grant.requested, grant.handshook,
                      phases, posted)
