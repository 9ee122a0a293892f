"""Admin changes made on one worker of `kvferry-proxy --workers N`, applied on every other.

The supervisor makes, before it forks: an append-only file of changes (one JSON line each, written
with one O_APPEND write: lines never interleave) and a version number in shared memory. A worker
that changes its instances through the admin API appends the change and bumps the version; every
worker compares the version with the last it applied before each request (one read of shared
memory) and applies the lines it has not seen. So a change answered by one worker holds on every
worker for any request that starts after the answer, and a replacement worker replays the whole
file at its start. Changes are named by instance URL (ids are per worker)."""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
from collections.abc import Callable


class Peers:
    def __init__(self, path: str) -> None:
        self.path = path
        self._version = memoryview(mmap.mmap(-1, 8)).cast("q")
        self._lock = mp.get_context("fork").Lock()
        self._seen = -1  # version applied by this process (-1: nothing yet: the whole file)
        self._offset = 0  # bytes of the file applied by this process
        self._mine: set[int] = set()  # offsets of this process's own lines (applied when made)

    def publish(self, change: dict) -> None:
        """A change this worker made (and applied): every other worker applies it before its next request."""
        line = (json.dumps(change, separators=(",", ":")) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                self._mine.add(os.fstat(fd).st_size)
                os.write(fd, line)
            finally:
                os.close(fd)
            self._version[0] += 1

    def sync(self, apply: Callable[[dict], None]) -> None:
        """Apply the changes other workers made since the last call (cheap when there are none)."""
        v = self._version[0]
        if v == self._seen:
            return
        with self._lock:  # no half-written line, and the version read matches the file read
            v = self._version[0]
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        at = self._offset
        for line in data.splitlines(keepends=True):
            if at not in self._mine:
                apply(json.loads(line))
            at += len(line)
        self._offset, self._seen = at, v
