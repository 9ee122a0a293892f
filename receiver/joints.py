"""Transfers that several prefiller ranks write into: a prefiller of larger TP than this decoder
rank, each of its ranks slicing its K/V heads into the same pages (docs/pd.md, "Different TP
with K/V heads"). The first writer's alloc reserves the pages; the others join it and get the
same pages and generation; the transfer is readable only once every writer's notification came.

The rules of receiver/transfer_table.py hold for the whole transfer, with one connection key for it
that no ZMQ identity equals (`conn_key`), so no single writer's `final` abort or closed
connection frees pages another writer may still write into:

- a joining writer restarts the lease (its own deadline then starts no earlier than the
  receiver's), and only a live transfer whose data has not all arrived can be joined;
- any writer's abort, or its connection closing, ends the transfer for all (the decoder stops
  waiting and recomputes); its pages stay quarantined until every writer that joined *settled*
  (notified, said `final`, or its connection closed) or the lease ends;
- a writer that never comes leaves the transfer unread: its lease ends it (the decoder's wait
  is bounded by pd_kv_ready_timeout and the lease), and a late alloc for the ended id is refused.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.wire import messages as m
from kvferry.receiver.transfer_table import TransferTable

logger = get_logger(__name__)
_stray = RateLimitedLog(logger)  # a peer can send stray notifications at will: at most one line per 10 s

Reserve = Callable[[m.AllocRequest, bytes, float], Awaitable[m.Msg]]


def conn_key(transfer_id: str) -> bytes:
    """The table's connection key of a jointly written transfer (ZMQ identities never start so)."""
    return b"\x01kvf-joint:" + transfer_id.encode()


@dataclass
class _Joint:
    writers: int
    num_chunks: int
    num_tokens: int
    reply: asyncio.Future  # the first writer's alloc answer (on the ports loop), shared by the others
    created: float
    generation: int = 0
    joined: dict[bytes, int] = field(default_factory=dict)  # connection -> writer index
    notified: set[int] = field(default_factory=set)
    settled: set[int] = field(default_factory=set)  # writers whose WRITEs can no longer land


class Joints:
    """Thread-safe: allocs, aborts and closed connections come on the ports loop, notifications on
    the NIXL thread."""

    MAX = 4096

    def __init__(self, table: TransferTable, keep_seconds: float) -> None:
        self.table = table
        self.keep_seconds = keep_seconds  # an entry outlives any lease of its transfer by then
        self._lock = threading.Lock()
        self._joints: OrderedDict[str, _Joint] = OrderedDict()

    def __contains__(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._joints

    def sizes(self) -> int:
        with self._lock:
            return len(self._joints)

    async def first(self, req: m.AllocRequest, ident: bytes, arrival: float, reserve: Reserve) -> m.Msg:
        """The first writer's alloc: reserve the pages for all writers (`reserve` as for one writer,
        with the transfer's own connection key)."""
        tid = req.transfer_id
        if req.writer >= req.writers:
            return _error("bad_message", tid, f"writer {req.writer} of {req.writers} does not exist")
        j = _Joint(req.writers, len(req.chunk_keys), req.num_tokens, asyncio.get_running_loop().create_future(),
                   time.monotonic(), joined={ident: req.writer})
        with self._lock:
            self._prune_locked()
            self._joints[tid] = j
        try:
            reply = await reserve(req, conn_key(tid), arrival)
        except BaseException:
            reply = _error("aborted", tid, f"transfer {tid}: the receiver could not reserve its pages")
            raise
        finally:
            if isinstance(reply, m.AllocResponse):
                j.generation = reply.generation
            else:
                with self._lock:
                    if self._joints.get(tid) is j:
                        del self._joints[tid]
            j.reply.set_result(reply)
        return reply

    async def join(self, req: m.AllocRequest, ident: bytes, wait: float) -> m.Msg:
        """Another writer's alloc: the first writer's pages, with the lease restarted."""
        tid = req.transfer_id
        with self._lock:
            j = self._joints.get(tid)
            why = _mismatch(j, req, ident)
            if why is None:
                assert j is not None  # _mismatch says so when there is none
                j.joined[ident] = req.writer  # held before the wait: the same writer cannot join twice
        if why is not None or j is None:
            return _error("duplicate", tid, f"transfer {tid}: {why}")
        try:
            reply = await asyncio.wait_for(asyncio.shield(j.reply), wait)
        except TimeoutError:
            reply = _error("buffer_full", tid, f"transfer {tid}: its first writer's pages were not granted within "
                                               f"{wait:.1f}s (pd_alloc_timeout)")
        left = self.table.renew(tid, j.generation, conn_key(tid)) if isinstance(reply, m.AllocResponse) else None
        if left is None:
            with self._lock:
                j.joined.pop(ident, None)  # it was refused: it writes nothing
            self._settle(tid, j)
            return reply if isinstance(reply, m.ErrorReply) else _error(
                "aborted", tid, f"transfer {tid} ended or its data arrived before this writer joined")
        return m.AllocResponse(transfer_id=tid, generation=reply.generation, pages=reply.pages, lease_seconds=left)

    def writers(self, transfer_id: str) -> list[bytes]:
        """The connections of the writers that joined `transfer_id` (none: not a joint transfer)."""
        with self._lock:
            j = self._joints.get(transfer_id)
            return list(j.joined) if j is not None else []

    def conn(self, transfer_id: str, ident: bytes) -> bytes:
        """The table's connection key for `ident`'s requests about `transfer_id` (a lease renewal)."""
        with self._lock:
            j = self._joints.get(transfer_id)
            return conn_key(transfer_id) if j is not None and ident in j.joined else ident

    def notified(self, transfer_id: str, generation: int, writer: int) -> bool | None:
        """A writer's notification (NIXL thread): None if the transfer is not a joint one (handle
        it as usual), True when it was the last writer's (commit the transfer now), else False."""
        with self._lock:
            j = self._joints.get(transfer_id)
            if j is None:
                return None
            if generation != j.generation or writer not in j.joined.values():
                _stray.warning("notification for transfer %s from writer %d (generation %d) ignored: not a writer "
                               "that joined it", transfer_id, writer, generation)
                return False
            j.notified.add(writer)
            j.settled.add(writer)
            done = len(j.notified) == j.writers
            if done:
                del self._joints[transfer_id]
        if not done:
            self._settle(transfer_id, j)
        return done

    def abort(self, req: m.AbortTransfer, ident: bytes) -> bool:
        """A writer's abort ends the transfer for every writer; False if it is not a joint one's."""
        tid = req.transfer_id
        with self._lock:
            j = self._joints.get(tid)
            if j is None or ident not in j.joined:
                return False
            if req.final:
                j.settled.add(j.joined[ident])
        self.table.abort(tid, req.generation, f"a prefiller rank aborted: {req.reason}")
        self._settle(tid, j)
        return True

    def writer_gone(self, conn: bytes) -> None:
        """A writer's connection closed (a grace ago): it writes no more, and the transfer cannot
        complete without it."""
        with self._lock:
            hit = [(tid, j) for tid, j in self._joints.items() if conn in j.joined]
            for _, j in hit:
                j.settled.add(j.joined[conn])
        for tid, j in hit:
            if self.table.status(tid) == "pending":
                self.table.abort(tid, j.generation, "a prefiller rank's connection closed")
            self._settle(tid, j)

    def _settle(self, tid: str, j: _Joint) -> None:
        """Once the transfer ended and no joined writer can write any more, its quarantined pages
        are free at once (a `final` abort from the transfer's own connection key)."""
        with self._lock:
            if not set(j.joined.values()) <= j.settled or tid in self.table or not j.reply.done():
                return
            if self._joints.get(tid) is j:
                del self._joints[tid]
        self.table.abort(tid, j.generation, "every prefiller rank settled", conn=conn_key(tid), final=True)

    def _prune_locked(self) -> None:
        now = time.monotonic()
        while self._joints and (len(self._joints) >= self.MAX or
                                now - next(iter(self._joints.values())).created > self.keep_seconds):
            self._joints.popitem(last=False)


def _mismatch(j: _Joint | None, req: m.AllocRequest, ident: bytes) -> str | None:
    if j is None:
        return "no first writer to join"
    if req.writers != j.writers or len(req.chunk_keys) != j.num_chunks or req.num_tokens != j.num_tokens:
        return (f"writer {req.writer} asks for {len(req.chunk_keys)} chunks of {req.num_tokens} tokens from "
                f"{req.writers} writers; the first asked {j.num_chunks} of {j.num_tokens} from {j.writers}")
    if req.writer >= j.writers or req.writer in j.joined.values() or ident in j.joined:
        return f"writer {req.writer} of {j.writers} joined already (or does not exist)"
    return None


def _error(code: str, tid: str, message: str) -> m.ErrorReply:
    return m.ErrorReply(code=code, message=message[:4000], transfer_id=tid)
