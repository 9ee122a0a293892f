"""The pages of transfers aborted before their data arrived, held until no WRITE can land in them.

Their sender may still have a WRITE in flight into them. They come back when that write's
notification arrives, when the sender that reserved them says it never wrote (a `final` abort on
the same connection), when that connection closed (a sender posts no write into pages reserved
on a closed connection), or at the lease's end, after which no sender posts a write.

Apart from receiver/transfer_table.py, whose table decides what is quarantined (its lock guards every
call here): this module keeps the held pages, the connections that closed, and when each page
may come back.
"""

from __future__ import annotations

from collections import OrderedDict

from kvferry.buffer.pd_buffer import PDBuffer, Reservation
from kvferry.common.log import RateLimitedLog, get_logger

logger = get_logger(__name__)
_refused = RateLimitedLog(logger)  # a peer can send final aborts at will: at most one line per 10 s


class Quarantine:
    """Aborted transfers' reservations by transfer id, each with the connection that reserved it,
    and the most recent `most_closed` alloc connections that closed. Not thread-safe."""

    def __init__(self, buffer: PDBuffer, most_closed: int) -> None:
        self.buffer = buffer
        self._held: dict[str, tuple[Reservation, bytes]] = {}
        self._closed: OrderedDict[bytes, None] = OrderedDict()  # no new transfer on them
        self._most_closed = most_closed

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, transfer_id: str, res: Reservation, conn: bytes) -> None:
        """Keep `res` (reserved on `conn`) until no WRITE can land in it."""
        self._held[transfer_id] = (res, conn)

    def landed(self, transfer_id: str, generation: int) -> bool:
        """A notification of `transfer_id` came: if it is held, its WRITE has landed, nothing more
        can, and its pages are free again. Whether it was held."""
        held = self._held.get(transfer_id)
        if held is None or held[0].generation != generation:
            return False
        self._free(transfer_id)
        logger.info("transfer %s: the write of an aborted transfer landed; its pages are free again", transfer_id)
        return True

    def never_written(self, transfer_id: str, generation: int, conn: bytes) -> bool:
        """A `final` abort of `transfer_id` came on `conn`: if that connection reserved it (and
        `generation`, when given, is its own), nothing of it can land; its pages are free again.
        Whether they were."""
        held = self._held.get(transfer_id)
        if held is None:
            return False
        if not conn or conn != held[1] or (generation and held[0].generation != generation):
            _refused.warning("transfer %s: a final abort %s; its pages stay held until no write can land",
                           transfer_id, "of another generation" if conn == held[1] else
                           "from a connection that did not reserve it")
            return False
        n = self._free(transfer_id)
        logger.info("transfer %s: its sender wrote nothing; its %d pages are free again", transfer_id, n)
        return True

    def writer_gone(self, conn: bytes) -> int:
        """The connection `conn` closed: no new transfer starts on it, and the pages held for it
        are free again. Returns how many."""
        self._closed[conn] = None
        while len(self._closed) > self._most_closed:
            self._closed.popitem(last=False)
        return sum(self._free(tid) for tid in [t for t, (_, c) in self._held.items() if c == conn])

    def closed(self, conn: bytes) -> bool:
        """Whether the connection `conn` closed (recently: the memory is bounded)."""
        return conn in self._closed

    def expire(self) -> None:
        """Forget what the buffer took back at its lease's end: no write can come any more."""
        for tid in [t for t, (res, _) in self._held.items() if not self.buffer.is_live(res)]:
            del self._held[tid]

    def release_all(self) -> None:
        for res, _ in self._held.values():
            self.buffer.release(res)
        self._held.clear()

    def _free(self, transfer_id: str) -> int:
        res, _ = self._held.pop(transfer_id)
        self.buffer.release(res)
        return len(res.pages)
