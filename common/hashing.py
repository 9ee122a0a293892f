"""Chunk keys: a hash chain over token-id bytes, identical in every process and on every machine.

Link i is ``xxh3_128(key[i-1] || int32-le(tokens of chunk i))``; the first link starts from a
salt (e.g. a model fingerprint) so caches of different models never collide. Python's ``hash``
is never used, so ``PYTHONHASHSEED`` does not matter.

What else determines a chunk's KV (a LoRA adapter, a ``cache_salt``, a multimodal input or
prompt embeddings at its position) enters as that chunk's *extra*: a 32-byte digest appended to
the link's input with one tag byte, ``xxh3_128(key[i-1] || tokens || extra || 0x01)``. A plain
link hashes ``16 + 4n`` bytes and a link with an extra ``16 + 4n + 33``: the two lengths differ
modulo 4, so no link of one form is ever the input of the other, and a chain that had an extra
anywhere never meets a chain without it (keys written before extras existed stay valid for
requests that have none, and are never read for requests that do).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

import xxhash

KEY_BYTES = 16
EXTRA_BYTES = 32
_EXTRA_TAG = b"\x01"


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (the portable form that is hashed)."""
    arr = array("i", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def chunk_keys(tokens: Sequence[int], chunk_size: int, salt: bytes = b"",
               include_partial: bool = True, extras: Sequence[bytes | None] | None = None) -> list[bytes]:
    """One key per chunk of `chunk_size` tokens; the last partial chunk gets one if asked.
    `extras[i]` (EXTRA_BYTES, or None) is mixed into chunk i's link; chunks past its end have none."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = token_bytes(tokens)
    step = chunk_size * 4
    end = len(data) if include_partial else len(data) - len(data) % step
    keys: list[bytes] = []
    prev = xxhash.xxh3_128_digest(salt)
    for i, start in enumerate(range(0, end, step)):
        extra = extras[i] if extras is not None and i < len(extras) else None
        if extra is None:
            prev = xxhash.xxh3_128_digest(prev + data[start:start + step])
        else:
            if len(extra) != EXTRA_BYTES:
                raise ValueError(f"chunk {i}'s extra is {len(extra)} bytes; an extra is a {EXTRA_BYTES}-byte digest")
            prev = xxhash.xxh3_128_digest(prev + data[start:start + step] + extra + _EXTRA_TAG)
        keys.append(prev)
    return keys


def extra_digest(identity: bytes) -> bytes:
    """One chunk's extra: a digest of a canonical encoding of what its KV depends on besides its
    tokens (the connector's job to make that encoding unambiguous)."""
    return hashlib.blake2b(identity, digest_size=EXTRA_BYTES, person=b"kvferry-extra-1").digest()


def salt_for(*parts: object) -> bytes:
    """A salt from model name, dtype, layout...: keys of different setups never collide."""
    return "|".join(str(p) for p in parts).encode()
