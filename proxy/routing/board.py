"""The load every worker of one proxy sees (`kvferry-proxy --workers N`): each instance's requests in
flight and queued prompt tokens, and its requests served and failed, per worker, in memory the
workers share.

A table made once by the supervisor before it forks its workers (an anonymous shared mapping:
every child sees the same pages). An instance has a row (found by its URL, claimed under a lock
the first time any worker registers it); a row has one column per worker, and each worker writes
only its own column: no two processes write one cell, so no atomic operations are needed, and a
reader sums the row (a sum read while another worker moves on is one request stale, as a
single proxy's count is the moment after it is read). A dead worker's column is zeroed by the
supervisor before its replacement starts: its requests died with it (its served and failed counts
stay: the replacement goes on from them).
"""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing as mp

from kvferry.common.errors import UnavailableError

ROWS = 1024  # instances one proxy can route to over its life (a removed one keeps its row)
KEY = 16  # bytes of the URL's hash that name a row
_CELLS = 4  # in flight, queued prompt tokens, served, failed
ROLES = ("prefiller", "decoder")


class BoardFull(UnavailableError, RuntimeError):
    """Every row is taken."""


class LoadBoard:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.worker = 0  # the column this process writes (set in each worker after the fork)
        self._keys = mmap.mmap(-1, ROWS * KEY)
        self._mem = mmap.mmap(-1, ROWS * workers * _CELLS * 8)
        self._cells = memoryview(self._mem).cast("q")
        self._lock = mp.get_context("fork").Lock()
        self._rows: dict[str, int] = {}  # url -> row, this process's cache
        self._turns = memoryview(mmap.mmap(-1, 8 * len(ROLES))).cast("q")  # round robin, per role
        self._clients = memoryview(mmap.mmap(-1, 8 * workers)).cast("q")  # client requests in flight, per worker

    def row(self, url: str) -> int:
        """The instance's row, claimed when no worker has claimed it yet."""
        r = self._rows.get(url)
        if r is not None:
            return r
        key = hashlib.blake2b(url.encode(), digest_size=KEY).digest()
        start = int.from_bytes(key[:4], "little") % ROWS
        # A worker killed while it held the lock must not stop the others adding instances: after
        # a second, go on without it (at worst two rows for one URL: its load not shared).
        locked = self._lock.acquire(timeout=1.0)
        try:
            for i in range(ROWS):
                r = (start + i) % ROWS
                at = self._keys[r * KEY:(r + 1) * KEY]
                if at == key:
                    break
                if at == bytes(KEY):
                    self._keys[r * KEY:(r + 1) * KEY] = key
                    break
            else:
                raise BoardFull(f"more than {ROWS} instances over this proxy's life: restart it")
        finally:
            if locked:
                self._lock.release()
        self._rows[url] = r
        return r

    def put(self, row: int, active: int, queued: int) -> None:
        """This worker's load on the instance."""
        self._put(row, 0, active, queued)

    def put_done(self, row: int, served: int, errors: int) -> None:
        """This worker's requests served by the instance and its failures, since the proxy started."""
        self._put(row, 2, served, errors)

    def _put(self, row: int, cell: int, a: int, b: int) -> None:
        at = (row * self.workers + self.worker) * _CELLS + cell
        self._cells[at] = a
        self._cells[at + 1] = b

    def own_done(self, row: int) -> tuple[int, int]:
        """This worker's column's (served, failed): where a replaced worker's count stopped."""
        at = (row * self.workers + self.worker) * _CELLS + 2
        return self._cells[at], self._cells[at + 1]

    def done(self, row: int) -> tuple[int, int]:
        """(served, failed) on the instance from every worker."""
        return self._sums(row, 2)

    def total(self, row: int) -> tuple[int, int]:
        """(in flight, queued prompt tokens) on the instance from every worker."""
        return self._sums(row, 0)

    def _sums(self, row: int, cell: int) -> tuple[int, int]:
        """Cells `cell` and `cell + 1` of the row, summed over the workers' columns."""
        c, at = self._cells, row * self.workers * _CELLS + cell
        a = b = 0
        for _ in range(self.workers):
            a += c[at]
            b += c[at + 1]
            at += _CELLS
        return a, b

    def put_clients(self, n: int) -> None:
        """This worker's client requests in flight (--max-in-flight holds for all workers together)."""
        self._clients[self.worker] = n

    def clients(self) -> int:
        return sum(self._clients)

    def turn(self, role: str) -> int:
        """The next round-robin turn for `role`, counted across the workers (one rotation, as one process's)."""
        i = ROLES.index(role)
        n = self._turns[i]  # no lock: two workers taking one turn at once only repeat it
        self._turns[i] = n + 1
        return n

    def clear_worker(self, worker: int) -> None:
        """A dead worker's load: its requests died with it (what it served stays counted)."""
        for row in range(ROWS):
            at = (row * self.workers + worker) * _CELLS
            self._cells[at] = self._cells[at + 1] = 0
        self._clients[worker] = 0
