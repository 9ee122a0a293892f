"""Chunk keys: a hash chain over token-id bytes, identical in every process and on every machine.

Link i is ``xxh3_128(key[i-1] || int32-le(tokens of chunk i))``; the first link starts from a
salt (e.g. a model fingerprint) so caches of different models never collide. Python's ``hash``
is never used, so ``PYTHONHASHSEED`` does not matter.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

KEY_BYTES = 16


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (the portable form that is hashed)."""
    arr = array("i", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def chunk_keys(tokens: Sequence[int], chunk_size: int, salt: bytes = b"",
               include_partial: bool = True) -> list[bytes]:
    """One key per chunk of `chunk_size` tokens; the last partial chunk gets one if asked."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = token_bytes(tokens)
    step = chunk_size * 4
    end = len(data) if include_partial else len(data) - len(data) % step
    keys: list[bytes] = []
    prev = xxhash.xxh3_128_digest(salt)
    for start in range(0, end, step):
        prev = xxhash.xxh3_128_digest(prev + data[start:start + step])
        keys.append(prev)
    return keys


def salt_for(*parts: object) -> bytes:
    """A salt from model name, dtype, layout...: keys of different setups never collide."""
    return "|".join(str(p) for p in parts).encode()
