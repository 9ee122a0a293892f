"""How a sender's grant ends, once: its notifying write landed, a write failed, the caller gave it
up (`KVSender.release`), or the receiver dropped it (the proxy's abort: its client left).

Each end tells the receiver what it needs to take the pages back: an abort, final only when no
write of the grant can still land (grants.nothing_in_flight), and then the pages are free at
once; otherwise the write's notification or the lease's end frees them. A dropped grant takes no
write from then on, and ends as soon as none is in flight, without waiting for the prompt's
compute to end.

Apart from sender/kv_sender.py, which makes the grants and posts their writes: the two share the
sender's loop, peer table, prepared handles and counters, and nothing else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any

from kvferry.buffer import nixl_agent, peering
from kvferry.common.log import get_logger
from kvferry.common.wire import messages as m
from kvferry.sender import prepared
from kvferry.sender.errors import LeaseExpired, SendError, WriteFailed
from kvferry.sender.grants import AllocLink, Grant, nothing_in_flight, send_abort
from kvferry.sender.results import SenderCounters, SendResult, grant_result

logger = get_logger(__name__)


class GrantEnds:
    """Ends one sender's grants. `end`, `cut` and `dropped` run on the sender's loop; `written` on
    its NIXL thread, `fail` on any thread: both hand the end to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, peers: peering.PeerTable[AllocLink],
                 preps: prepared.Handles, counters: SenderCounters) -> None:
        self._loop, self._peers, self._preps, self._counters = loop, peers, preps, counters

    def written(self, grant: Grant, nchunks: int, nbytes: int, called: float, notify: bool,
                f: concurrent.futures.Future[nixl_agent.XferDone], out: concurrent.futures.Future[SendResult]) -> None:
        """On the NIXL thread: a write of `grant` ended; `out` gets its result, whatever happens
        here (a caller waiting on it must not wait forever)."""
        try:
            self._written(grant, nchunks, nbytes, called, notify, f, out)
        except Exception as e:
            logger.exception("transfer %s: ending its write failed", grant.transfer_id)
            if not out.done():
                out.set_exception(SendError(f"transfer {grant.transfer_id}: ending its write failed: {e!r}"))

    def _written(self, grant: Grant, nchunks: int, nbytes: int, called: float, notify: bool,
                 f: concurrent.futures.Future[nixl_agent.XferDone], out: concurrent.futures.Future[SendResult]) -> None:
        x = f.result()
        with grant.lock:  # `clean` before `writes` shrinks: a drop that then finds none in flight reads it
            if x.state != "DONE":
                grant.clean = False
            grant.writes.discard(f)
            settled = bool(grant.cut) and not grant.writes
        if settled and x.state == "DONE" and not notify:  # the last write in flight of a dropped grant
            self._to_loop(self.end(grant, f"dropped by the receiver ({grant.cut})", abort=True))
        if x.state != "DONE":
            # A write was posted: it may still land until the lease ends, so the abort is not final.
            err = (LeaseExpired(f"transfer {grant.transfer_id} to {grant.addr}: the write did not finish within "
                                "the lease; raise pd_lease_seconds") if x.state == "EXPIRED"
                   else WriteFailed(f"transfer {grant.transfer_id} to {grant.addr}: NIXL write failed: {x.state}"))
            # An error may mean a broken connection: handshake afresh next time. A write the lease
            # cut short says nothing about the connection, which other grants may still use.
            self.fail(grant, out, err, f"write {x.state}", drop=x.state != "EXPIRED")
            return
        grant.chunks += nchunks
        grant.written += nbytes
        res = grant_result(grant, called, x.posted, x.done)
        if notify:
            self._to_loop(self.end(grant, "", abort=False, sent=res.bytes))
        out.set_result(res)

    def fail(self, grant: Grant, out: concurrent.futures.Future[SendResult], err: SendError, reason: str,
             drop: bool = False) -> None:
        """`out` fails with `err`; the grant ends with an abort saying `reason` (and, with `drop`,
        the connection to its receiver is dropped)."""
        self._to_loop(self.end(grant, reason, abort=True, drop=drop, failed=True))
        out.set_exception(err)

    def _to_loop(self, end: Coroutine[Any, Any, None]) -> None:
        """Run an end on the loop; once the sender closed its loop, the end is dropped (the
        receiver's lease frees the pages, and the connection is gone anyway)."""
        try:
            asyncio.run_coroutine_threadsafe(end, self._loop)
        except RuntimeError:  # the loop is closed
            end.close()

    def dropped(self, peer: peering.Peer[AllocLink], msg: m.AbortTransfer) -> None:
        """The receiver dropped one of this connection's transfers (the proxy's abort: its client
        left); on the loop, while the prompt may still be computing."""
        grant = peer.state.grants.get(msg.transfer_id)
        if grant is None:
            peer.state.dropped_early(msg.transfer_id, msg.reason or "no reason given")
        elif not msg.generation or msg.generation == grant.generation:
            self.cut(grant, msg.reason or "no reason given")

    def cut(self, grant: Grant, reason: str) -> None:
        """No write into `grant` is posted from now on; once none is in flight, the pages are given
        back (final when every write ended DONE), without waiting for the prompt's compute to end."""
        with grant.lock:
            if grant.cut or grant.ended:
                return
            grant.cut = reason[:200]
            idle = not grant.writes
        logger.info("transfer %s: receiver %s dropped it (%s); nothing more is written", grant.transfer_id,
                    grant.addr, grant.cut)
        if idle:  # else the last write's end gives the pages back (`written`)
            asyncio.ensure_future(self.end(grant, f"dropped by the receiver ({grant.cut})", abort=True))

    async def end(self, grant: Grant, reason: str, abort: bool, drop: bool = False, failed: bool = False,
                  sent: int = 0) -> None:
        """On the loop: the grant is over (finished, failed or given up); once per grant."""
        if grant.ended:
            return
        self._preps.close(grant.prepared)
        peer = grant.peer
        if peer.state.grants.get(grant.transfer_id) is grant:
            del peer.state.grants[grant.transfer_id]
        if abort:
            final = nothing_in_flight(grant)
            await send_abort(peer, grant.transfer_id, grant.generation, reason, final=final)
            if grant.cut:
                logger.info("transfer %s: abort sent to receiver %s (%s)", grant.transfer_id, grant.addr,
                            "final: no write can land" if final else "a write may still land")
        if drop:
            self._peers.drop(peer, reason)  # the connection may be broken: handshake afresh next time
        grant.ended = True
        peer.busy -= 1
        if failed:
            self._counters.failed += 1
        elif not abort:
            self._counters.transfers += 1
            self._counters.bytes += sent
