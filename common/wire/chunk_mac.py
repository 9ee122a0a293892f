"""Keyed MACs on KV chunks that cross a process boundary (remote stores, P2P peers).

With a cluster secret, a chunk is stored with a tag over its cache key and its bytes, made with
keyed BLAKE3 (the `blake3` package: the reference implementation, SIMD and multi-threaded). A
reader recomputes it before using the chunk; a chunk whose tag does not match (forged, corrupted,
or another key's) is a miss. Binding the cache key stops a store from answering key A with a
valid chunk of key B.
"""

from __future__ import annotations

import hmac

import blake3

from kvferry.common.secret import ClusterSecret

TAG_BYTES = 16
_PURPOSE = "kv-chunk-mac-v1"
# Above this many bytes BLAKE3 hashes with every core (it splits the input into a tree).
_THREADED_FROM = 1 << 20


class ChunkMAC:
    """Tags chunks with the cluster's chunk key; its repr shows nothing of the key."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._key = secret.key(_PURPOSE)

    def __repr__(self) -> str:
        return "ChunkMAC(<hidden>)"

    def tag(self, key: bytes, *parts: bytes | memoryview) -> bytes:
        """The tag over the cache `key` and the chunk's bytes (`parts`, in order, length-prefixed)."""
        total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        h = blake3.blake3(key=self._key, max_threads=blake3.blake3.AUTO if total >= _THREADED_FROM else 1)
        h.update(len(key).to_bytes(4, "big"))
        h.update(key)
        for p in parts:
            n = len(p) if isinstance(p, bytes) else p.nbytes
            h.update(n.to_bytes(8, "big"))
            h.update(p)
        return h.digest(TAG_BYTES)

    def check(self, tag: bytes | memoryview, key: bytes, *parts: bytes | memoryview) -> bool:
        """True only when `tag` is this chunk's tag (compared in constant time)."""
        return len(tag) == TAG_BYTES and hmac.compare_digest(bytes(tag), self.tag(key, *parts))


def for_secret(secret: ClusterSecret | None) -> ChunkMAC | None:
    """The chunk MAC of a cluster, or None without a secret (chunks then carry no tag)."""
    return ChunkMAC(secret) if secret is not None else None
