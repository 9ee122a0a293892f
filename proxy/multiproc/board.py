"""The load every worker of one proxy sees (`kvferry-proxy --workers N`): each instance's requests in
flight and queued prompt tokens, and its requests served and failed, per worker, in memory the
workers share.

A table made once by the supervisor before it forks its workers (an anonymous shared mapping:
every child sees the same pages). An instance has a row, found by its URL and named by an id
every worker uses for it (so instance ids agree between workers). A row has one column per
worker, and each worker writes only its own column: no two processes write one cell, so no
atomic operations are needed, and a reader sums the row (a sum read while another worker moves
on is one request stale, as a single proxy's count is the moment after it is read).

Rows are reused: a worker that registers an instance marks its column of the row as holding it,
and clears its cells and then that mark when the instance goes; from then on that worker never
writes the row again (the instance's requests still in flight count on in the worker alone). A
row no worker holds is free, and is claimed (its cells zeroed, a new URL and id written) under
a lock. So a freed row cannot still receive an old instance's load: only holders write, and a
claim needs every holder gone. The lock is an flock: the kernel releases it when its holder
dies. A dead worker's column is cleared by the supervisor before its replacement starts: its
requests died with it, and it holds nothing (its served and failed counts stay: the replacement
goes on from them where it registers the same instance again).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
from collections.abc import Iterator

from kvferry.common.errors import UnavailableError

ROWS = 1024  # instances one proxy routes to at once with shared load (a row is reused when its instance goes)
KEY = 16  # bytes of the URL's hash that name a row
_CELLS = 5  # in flight, queued prompt tokens, served, failed, holds (1 while this worker has the instance)
_HOLDS = 4
ROLES = ("prefiller", "decoder")


class BoardFull(UnavailableError, RuntimeError):
    """Every row is held."""


class LoadBoard:
    def __init__(self, workers: int, lock_path: str) -> None:
        """`lock_path`: a file the workers flock while they claim a row (made if missing)."""
        self.workers = workers
        self.worker = 0  # the column this process writes (set in each worker after the fork)
        self._keys = mmap.mmap(-1, ROWS * KEY)
        self._mem = mmap.mmap(-1, ROWS * workers * _CELLS * 8)
        self._cells = memoryview(self._mem).cast("q")
        # Each row's instance id, and the next id to give (index ROWS): ids are never reused.
        self._ids = memoryview(mmap.mmap(-1, (ROWS + 1) * 8)).cast("q")
        self._lock_path = lock_path
        self._lock_fd: tuple[int, int] | None = None  # (pid, fd): flock needs each process's own open file
        self._turns = memoryview(mmap.mmap(-1, 8 * len(ROLES))).cast("q")  # round robin, per role
        self._clients = memoryview(mmap.mmap(-1, 8 * workers)).cast("q")  # client requests in flight, per worker

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        pid = os.getpid()
        if self._lock_fd is None or self._lock_fd[0] != pid:
            self._lock_fd = (pid, os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        fd = self._lock_fd[1]
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def claim(self, url: str) -> tuple[int, int]:
        """(row, instance id number) of the instance at `url`, which this worker now holds: the row
        another worker holds for it, else a free one claimed for it. BoardFull when every row is held."""
        key = hashlib.blake2b(url.encode(), digest_size=KEY).digest()
        with self._locked():
            r = self._find(key)
            if r < 0 or not self._held(r):
                r = r if r >= 0 else next((i for i in range(ROWS) if not self._held(i)), -1)
                if r < 0:
                    raise BoardFull(f"all {ROWS} rows of the load board are held by instances")
                start = r * self.workers * _CELLS
                self._cells[start:start + self.workers * _CELLS] = memoryview(
                    bytes(self.workers * _CELLS * 8)).cast("q")
                self._keys[r * KEY:(r + 1) * KEY] = key
                self._ids[r] = self._take_id()
            self._cells[self._at(r, _HOLDS)] = 1
            return r, self._ids[r]

    def release(self, row: int) -> None:
        """This worker's instance at `row` is gone: its cells are cleared and it never writes the row
        again (no lock: only this worker writes its column, and clearing the mark last frees the row)."""
        at = self._at(row, 0)
        for i in range(_HOLDS):
            self._cells[at + i] = 0
        self._cells[at + _HOLDS] = 0

    def next_id(self) -> int:
        """An instance id number no other instance of this proxy has (one added without a row)."""
        with self._locked():
            return self._take_id()

    def _take_id(self) -> int:
        n = self._ids[ROWS]
        self._ids[ROWS] = n + 1
        return n

    def _find(self, key: bytes) -> int:
        """The row whose key is `key` (held or not), or -1."""
        at = self._keys.find(key)
        while at >= 0 and at % KEY:
            at = self._keys.find(key, at + 1)
        return -1 if at < 0 else at // KEY

    def _held(self, row: int) -> bool:
        at = row * self.workers * _CELLS + _HOLDS
        return any(self._cells[at + w * _CELLS] for w in range(self.workers))

    def held_rows(self) -> int:
        """Rows some worker holds now."""
        return sum(1 for r in range(ROWS) if self._held(r))

    def live_ids(self) -> set[int]:
        """The id numbers of the instances some worker holds now."""
        return {self._ids[r] for r in range(ROWS) if self._held(r)}

    def _at(self, row: int, cell: int) -> int:
        return (row * self.workers + self.worker) * _CELLS + cell

    def put(self, row: int, active: int, queued: int) -> None:
        """This worker's load on the instance."""
        self._put(row, 0, active, queued)

    def put_done(self, row: int, served: int, errors: int) -> None:
        """This worker's requests served by the instance and its failures, since the proxy started."""
        self._put(row, 2, served, errors)

    def _put(self, row: int, cell: int, a: int, b: int) -> None:
        at = self._at(row, cell)
        self._cells[at] = a
        self._cells[at + 1] = b

    def own_done(self, row: int) -> tuple[int, int]:
        """This worker's column's (served, failed): where a replaced worker's count stopped."""
        at = self._at(row, 2)
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
        """A dead worker's load and holds: its requests died with it (what it served stays counted)."""
        for row in range(ROWS):
            at = (row * self.workers + worker) * _CELLS
            self._cells[at] = self._cells[at + 1] = self._cells[at + _HOLDS] = 0
        self._clients[worker] = 0
