"""Gauges one process sets as they change and another reads when scraped, through a small file.

vLLM serves /metrics from its API server, while the pd_buffer lives in the engine's worker
processes, and vLLM's stats reach the API server only with an engine step's outputs: an idle
decoder whose pages a prefiller just reserved would report them free until its next step. The
worker writes each change into a file of int64 slots (one store into shared memory, no system
call); the API server reads the file when /metrics is scraped.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import tempfile

SLOTS = ("pd_buffer_free_pages", "pd_transfers_in_flight", "pd_buffer_pages")
_SIZE = 8 * len(SLOTS)


def gauge_path(engine_id: str, rank: int) -> str:
    """The file of one engine's TP rank (vLLM's engine_id is the same in its API server and workers)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:128]
    return os.path.join(tempfile.gettempdir(), f"kvferry-live-{os.getuid()}-{safe}-{rank}")


class LiveGauges:
    """The writing side; `close()` removes the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._mm: mmap.mmap | None = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    def set(self, name: str, value: int) -> None:
        mm = self._mm
        if mm is not None:
            struct.pack_into("<q", mm, 8 * SLOTS.index(name), value)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def read(path: str, name: str) -> int | None:
    """The gauge's value now, or None when no process writes that file (yet, or any more)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_SIZE)
    except OSError:
        return None
    if len(data) != _SIZE:
        return None
    return struct.unpack_from("<q", data, 8 * SLOTS.index(name))[0]
