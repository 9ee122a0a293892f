"""A sender's grants: pages a receiver reserved for one transfer, and what keeps or ends them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvferry.buffer import peering
from kvferry.common.log import get_logger
from kvferry.common.wire import messages as m
from kvferry.sender.addr import ReceiverAddr
from kvferry.sender.errors import ChunkError, LeaseExpired, SendError, TransferDropped

logger = get_logger(__name__)

LEASE_MARGIN = 0.1  # fraction of the lease kept free at its end: no write may start there
MAX_EARLY_DROPS = 1024  # receiver aborts remembered for grants not made yet (a peer may send any number)


@dataclass
class AllocLink:
    """What a sender keeps per receiver: its address, the alloc and renew replies it waits for (by
    transfer id), the task that reads them off the data port, the grants made on it that have not
    ended (by transfer id), and the receiver's aborts that came before their grant was made."""

    addr: ReceiverAddr | None = None
    pending: dict[str, asyncio.Future] = field(default_factory=dict)
    reader: asyncio.Task | None = None
    grants: dict[str, Grant] = field(default_factory=dict)
    early_drops: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def dropped_early(self, transfer_id: str, reason: str) -> None:
        """The receiver dropped `transfer_id` before its grant was made here (its alloc reply and the
        abort came in one read): remembered, bounded, for the grant to be cut as it is made."""
        self.early_drops[transfer_id] = reason
        while len(self.early_drops) > MAX_EARLY_DROPS:
            self.early_drops.popitem(last=False)


@dataclass
class Grant:
    """Pages a receiver reserved for one transfer: written into with `KVSender.write` until `deadline`."""

    transfer_id: str
    addr: ReceiverAddr
    peer: peering.Peer[AllocLink]
    generation: int
    pages: list[int]
    deadline: float  # no write may be posted after this (the lease, less LEASE_MARGIN)
    requested: float
    phases: dict[str, float]
    handshook: bool
    lease_seconds: float = 0.0
    posted: bool = False  # a write was posted: an abort is final only if every write ended DONE
    writes: set = field(default_factory=set)  # posted writes not yet ended (NIXL futures)
    clean: bool = True  # every write that ended, ended DONE
    written: int = 0  # bytes written so far
    chunks: int = 0
    finishing: bool = False  # the notifying write was asked for: no more renewals
    ended: bool = False  # finished, failed or given back: nothing more is written into its pages
    # The receiver dropped the transfer (its request's client left): the reason. No write is posted
    # from then on; once none is in flight the sender's own abort (final when clean) frees the pages.
    cut: str = ""
    # Held between a write's check and its entry in `writes`, and while `cut` is set and `writes`
    # read: a write is either in `writes` before the cut looks, or refused.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    share: tuple[int, int] = (1, 0)  # (prefiller ranks writing into these pages, which one this is)
    # The notifying write's NIXL notification, encoded when the pages are granted: one step
    # fewer between the caller's write and its post.
    notice: bytes = field(init=False, default=b"")
    prepared: Any = None  # sender/prepared.py: the descriptors of a write built ahead (KVSender.prepare)

    def __post_init__(self) -> None:
        self.notice = m.encode(m.ArrivalNotice(transfer_id=self.transfer_id, generation=self.generation,
                                               writer=self.share[1]))


async def send_abort(peer: peering.Peer, transfer_id: str, generation: int, reason: str, final: bool) -> None:
    """Tell the receiver; `final` only when no write can still land (its pages are free at once then)."""
    try:
        await peer.sock.send(m.encode(m.AbortTransfer(transfer_id=transfer_id, generation=generation,
                                                      reason=reason[:4000], final=final)), flags=zmq.NOBLOCK)
    except zmq.ZMQError as e:  # its pages come back when the connection's close is seen, or the lease ends
        logger.warning("transfer %s: abort not sent to receiver %s: %s", transfer_id, peer.state.addr, e)


async def renew(grant: Grant, timeout: float) -> None:
    """Ask the receiver to restart the grant's lease; move its deadline if it does."""
    pending = grant.peer.state.pending
    fut = asyncio.get_running_loop().create_future()
    pending[grant.transfer_id] = fut
    sent_at = time.monotonic()
    try:
        await asyncio.wait_for(grant.peer.sock.send(m.encode(m.RenewLease(
            transfer_id=grant.transfer_id, generation=grant.generation))), timeout)
        reply = await asyncio.wait_for(fut, timeout)
    except (TimeoutError, zmq.ZMQError, SendError) as e:  # no answer, or the connection was dropped meanwhile
        pending.pop(grant.transfer_id, None)
        logger.warning("transfer %s: receiver %s did not answer a lease renewal: %s", grant.transfer_id, grant.addr,
                       e or type(e).__name__)
        return
    if isinstance(reply, m.LeaseRenewed) and reply.generation == grant.generation:
        grant.deadline = max(grant.deadline, sent_at + reply.lease_seconds * (1 - LEASE_MARGIN))
    else:
        logger.warning("transfer %s: receiver %s refused a lease renewal: %s", grant.transfer_id, grant.addr,
                       getattr(reply, "message", reply))


async def renew_until_done(grant: Grant, timeout: float) -> None:
    """Renew the grant's lease every quarter of it until its notifying write or its end: one
    forward step of a large batch can take longer than the lease."""
    while True:
        await asyncio.sleep(max(0.05, grant.lease_seconds / 4))
        if grant.ended or grant.finishing or grant.cut:
            return
        await renew(grant, timeout)


def check_ranges(ranges: list[tuple[int, int]], chunks: Sequence[tuple[int, int]]) -> None:
    """Every chunk lies inside one registered range. A plain loop, with no generator per chunk: it
    runs on the caller's thread before each write's post."""
    for addr, n in chunks:
        for lo, hi in ranges:
            if lo <= addr and addr + n <= hi:
                break
        else:
            raise ChunkError(f"chunk at {addr:#x} (+{n}) is not in memory registered with this sender")


def nothing_in_flight(grant: Grant) -> bool:
    """No write of `grant` can land any more: none posted, or every one ended DONE (a write that
    failed or was cut short by its lease may have left bytes on the way)."""
    return not grant.posted or (not grant.writes and grant.clean)


def refusal(grant: Grant, widest: int, now: float) -> tuple[SendError, str] | None:
    """Why a write reaching `widest` bytes into its pages may not go into `grant` now, and the
    reason to abort it with ("" if it ended already), or None. A few plain checks: this runs on the
    caller's thread before each write's post."""
    if grant.cut:
        return TransferDropped(f"transfer {grant.transfer_id}: receiver {grant.addr} dropped it ({grant.cut}); "
                               "nothing more is written into its pages"), ""
    if grant.ended:
        return SendError(f"transfer {grant.transfer_id}: its pages were given back or its write failed; nothing "
                         "more may be written into them"), ""
    if grant.peer.dropped:
        return SendError(f"transfer {grant.transfer_id}: the connection to receiver {grant.addr} closed; the "
                         "receiver gives the pages it reserved on it back, so nothing more may be written into "
                         "them"), "the connection to the receiver closed"
    page_bytes = pd_region(grant.peer).page_bytes
    if widest > page_bytes:
        return SendError(f"a {widest}-byte chunk does not fit receiver {grant.addr}'s {page_bytes}-byte "
                         "pages"), "chunk too large"
    if now >= grant.deadline:
        return LeaseExpired(f"transfer {grant.transfer_id}: the lease ran out before the write could start; raise "
                            "pd_lease_seconds"), "lease ran out before the write"
    return None


def pd_region(peer: peering.Peer) -> m.Region:
    """The receiver's pd_buffer region: every receiver's Welcome has one (the sender checks it at the
    handshake), a P2P holder's has none."""
    region = peer.welcome.region
    assert region is not None, f"receiver {peer.welcome.peer_id} sent no pd_buffer region"
    return region
