"""kvferry-server's memory: chunk bytes by key in an LRU with a byte limit."""

from __future__ import annotations

from collections import OrderedDict


class ChunkLRU:
    """Chunk bytes by key, least recently used first out, at most `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data: OrderedDict[bytes, bytes | bytearray] = OrderedDict()
        self.used = 0
        self.evictions = 0

    def put(self, key: bytes, value: bytes | bytearray) -> bool:
        if len(value) > self.limit:
            return False
        old = self.data.pop(key, None)
        if old is not None:
            self.used -= len(old)
        while self.used + len(value) > self.limit:
            _, gone = self.data.popitem(last=False)
            self.used -= len(gone)
            self.evictions += 1
        self.data[key] = value
        self.used += len(value)
        return True

    def get(self, key: bytes) -> bytes | bytearray | None:
        value = self.data.get(key)
        if value is not None:
            self.data.move_to_end(key)
        return value
