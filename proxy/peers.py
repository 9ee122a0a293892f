"""Admin changes made on one worker of `kvferry-proxy --workers N`, applied on every other.

The supervisor makes, before it forks: an append-only file of changes (one JSON line each, written
with one O_APPEND write: lines never interleave) and a change counter per worker in shared memory.
A worker that changes its instances through the admin API appends the change and bumps its
counter; every worker compares the counters' sum with the last it saw before each request (a few
reads of shared memory) and applies the lines it has not seen (those of its own process it made
already). So a change answered by one worker holds on every
worker for any request that starts after the answer, and a replacement worker replays the whole
file at its start. Changes are named by instance URL (ids are per worker)."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable


class Peers:
    def __init__(self, path: str, workers: int) -> None:
        self.path = path
        self.worker = 0  # this process's cell (set in each worker after the fork)
        # One change counter per worker, each written by its worker alone: no lock (a worker killed
        # while it held one would stop every other), and no increment lost to a race.
        self._versions = memoryview(mmap.mmap(-1, 8 * workers)).cast("q")
        self._seen = -1  # sum of the counters when this process last read the file (-1: never)
        self._offset = 0  # bytes of the file applied by this process (whole lines only)

    def publish(self, change: dict) -> None:
        """A change this worker made (and applied): every other worker applies it before its next request."""
        line = (json.dumps({"pid": os.getpid(), **change}, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line)  # one append of a short line: never interleaved with another's
        finally:
            os.close(fd)
        self._versions[self.worker] += 1

    def sync(self, apply: Callable[[dict], None]) -> None:
        """Apply the changes other workers made since the last call (cheap when there are none)."""
        v = sum(self._versions)
        if v == self._seen:
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        me = os.getpid()
        for line in data[:end].splitlines():
            change = json.loads(line)
            if change.pop("pid", None) != me:  # this process applied its own when it made them
                apply(change)
        self._offset += end
        self._seen = v if end == len(data) else -1
