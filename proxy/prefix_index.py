"""What one instance's prefix cache holds, learned from its KV events, keyed by the proxy's own
hash chain over token ids (vLLM's block hashes depend on its hash seed; ours do not).

A vLLM block hash is mapped to our key so a BlockRemoved can find what it removes. The index
is bounded (least recently stored or matched blocks go first): a block forgotten this way only
costs routing quality.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import xxhash

from kvferry.common.hashing import token_bytes

ROOT = xxhash.xxh3_128_digest(b"kvferry-proxy-prefix")


def link(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block of `tokens` after the block keyed `prev` (ROOT for the first block)."""
    return xxhash.xxh3_128_digest(prev + token_bytes(tokens))


def prefix_keys(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """One key per full block of `tokens` (at most `limit` blocks)."""
    keys: list[bytes] = []
    prev = ROOT
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, limit)
    for i in range(n):
        prev = link(prev, tokens[i * block_size:(i + 1) * block_size])
        keys.append(prev)
    return keys


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self._blocks: OrderedDict[bytes, Hashable] = OrderedDict()  # our key -> vLLM's block hash
        self._by_vllm: dict[Hashable, bytes] = {}
        self.orphans = 0  # stored blocks whose parent the index does not know (events missed)

    def __len__(self) -> int:
        return len(self._blocks)

    def stored(self, parent: Hashable | None, hashes: Sequence[Hashable], tokens: Sequence[int],
               block_size: int) -> int:
        """Apply a BlockStored; returns the blocks added."""
        if block_size <= 0 or len(tokens) < len(hashes) * block_size:
            raise ValueError(f"BlockStored with {len(hashes)} blocks of {block_size} but {len(tokens)} tokens")
        if self.block_size != block_size:
            if self.block_size is not None:
                self.clear()  # keys of another block size never match: start over
            self.block_size = block_size
        if parent is None:
            prev = ROOT
        else:
            prev = self._by_vllm.get(parent)
            if prev is None:
                self.orphans += 1
                return 0
        for i, h in enumerate(hashes):
            prev = link(prev, tokens[i * block_size:(i + 1) * block_size])
            old = self._blocks.pop(prev, None)
            if old is not None and old != h:
                self._by_vllm.pop(old, None)
            self._blocks[prev] = h
            self._by_vllm[h] = prev
        while len(self._blocks) > self.max_blocks:
            _, h = self._blocks.popitem(last=False)
            self._by_vllm.pop(h, None)
        return len(hashes)

    def removed(self, hashes: Sequence[Hashable]) -> None:
        for h in hashes:
            key = self._by_vllm.pop(h, None)
            if key is not None:
                self._blocks.pop(key, None)

    def clear(self) -> None:
        self._blocks.clear()
        self._by_vllm.clear()

    def cached_tokens(self, keys: Sequence[bytes]) -> int:
        """Tokens of the longest prefix of `keys` this instance holds (keys of self.block_size)."""
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            self._blocks.move_to_end(k)
            n += 1
        return n * (self.block_size or 0)
