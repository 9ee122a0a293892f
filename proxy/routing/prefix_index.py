"""What one instance holds, learned from its KV events, keyed by the proxy's own hash chain over
token ids (vLLM's block hashes depend on its hash seed; ours do not), with presence kept per
medium: the GPU prefix cache ("GPU", vLLM's own events) and kvferry's offload tiers ("CPU",
"DISK", the connector's events), so a removal from one medium leaves the others' copies.

A (medium, vLLM block hash) is mapped to our keys so a BlockRemoved can find what it removes. An
event block of a coarser size (a kvferry chunk: `chunk_size` tokens, a multiple of vLLM's block
size) is split into the index's blocks. The index is bounded (least recently stored or matched
blocks go first): a block forgotten this way only costs routing quality. An index attached to the
cluster's Holders keeps there which blocks it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import xxhash

from kvferry.common.hashing import token_bytes
from kvferry.proxy.routing.holders import Holders

ROOT = xxhash.xxh3_128_digest(b"kvferry-proxy-prefix")
GPU, CPU, DISK = "GPU", "CPU", "DISK"
_MEDIA = {None: GPU, GPU: GPU, CPU: CPU, DISK: DISK, "STORAGE": DISK}  # vLLM calls a storage tier STORAGE


def medium_of(name: str | None) -> str:
    """The index's medium for an event's: GPU when unnamed; any tier it does not know counts as disk."""
    return _MEDIA.get(name.upper() if name else None, DISK)


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
        self._blocks: OrderedDict[bytes, dict[str, Hashable]] = OrderedDict()  # our key -> medium -> vLLM hash
        self._by_vllm: dict[tuple[str, Hashable], list[bytes]] = {}  # (medium, vLLM hash) -> our keys
        self.orphans = 0  # stored blocks whose parent the index does not know (events missed)
        self._holders: Holders | None = None
        self._owner = ""

    def attach(self, holders: Holders, owner: str) -> None:
        """Keep `holders` told which blocks this index (instance `owner`) holds."""
        self.detach()
        self._holders, self._owner = holders, owner
        for k in self._blocks:
            holders.add(k, owner)
        holders.sized(owner, self.block_size)

    def detach(self) -> None:
        """Out of the holders (the instance left): none of its blocks is found there again."""
        h = self._holders
        if h is not None:
            for k in self._blocks:
                h.drop(k, self._owner)
            h.sized(self._owner, None)
            self._holders = None

    def _gone(self, key: bytes) -> None:
        if self._holders is not None:
            self._holders.drop(key, self._owner)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        """Whether a block keyed `key` is held, in any medium."""
        return key in self._blocks

    def _split(self, block_size: int, medium: str) -> int:
        """Index blocks per event block; sets (or, for a finer GPU block, resets) the index's size."""
        if self.block_size is None or (medium == GPU and block_size != self.block_size):
            if self.block_size is not None:
                self.clear()  # keys of another block size never match: start over
            self.block_size = block_size
            if self._holders is not None:
                self._holders.sized(self._owner, block_size)
        if block_size % self.block_size:
            raise ValueError(f"{medium} blocks of {block_size} tokens do not split into this instance's "
                             f"blocks of {self.block_size}")
        return block_size // self.block_size

    def _parent(self, medium: str, parent: Hashable) -> bytes | None:
        keys = self._by_vllm.get((medium, parent))
        if keys is None:  # a chunk's parent may live in another medium by now
            keys = next((self._by_vllm[(m, parent)] for m in (GPU, CPU, DISK) if (m, parent) in self._by_vllm), None)
        return keys[-1] if keys else None

    def stored(self, parent: Hashable | None, hashes: Sequence[Hashable], tokens: Sequence[int],
               block_size: int, medium: str | None = None) -> int:
        """Apply a BlockStored; returns the index blocks added."""
        m = medium_of(medium)
        if block_size <= 0 or len(tokens) < len(hashes) * block_size:
            raise ValueError(f"BlockStored with {len(hashes)} blocks of {block_size} but {len(tokens)} tokens")
        sub = self._split(block_size, m)
        bs = self.block_size
        assert bs is not None  # _split set it
        prev = ROOT if parent is None else self._parent(m, parent)
        if prev is None:
            self.orphans += 1
            return 0
        for i, h in enumerate(hashes):
            keys = []
            for j in range(sub):
                start = (i * sub + j) * bs
                prev = link(prev, tokens[start:start + bs])
                entry = self._blocks.pop(prev, None)
                if entry is None:
                    entry = {}
                    if self._holders is not None:
                        self._holders.add(prev, self._owner)
                entry[m] = h  # a removal of an older hash for this medium then leaves it (see removed)
                self._blocks[prev] = entry
                keys.append(prev)
            self._by_vllm[(m, h)] = keys
        while len(self._blocks) > self.max_blocks:
            key, entry = self._blocks.popitem(last=False)
            self._gone(key)
            for em, eh in entry.items():
                self._unmap(em, eh)
        if len(self._by_vllm) > 4 * self.max_blocks + 1024:  # hashes whose keys were all re-stored under others
            self._by_vllm = {mh: ks for mh, ks in self._by_vllm.items()
                             if any(self._blocks.get(k, {}).get(mh[0]) == mh[1] for k in ks)}
        return len(hashes) * sub

    def _unmap(self, medium: str, h: Hashable) -> None:
        for k in self._by_vllm.pop((medium, h), ()):
            entry = self._blocks.get(k)
            if entry is not None and entry.get(medium) == h:
                del entry[medium]
                if not entry:
                    del self._blocks[k]
                    self._gone(k)

    def removed(self, hashes: Sequence[Hashable], medium: str | None = None) -> None:
        """Apply a BlockRemoved: only that medium's copy goes."""
        m = medium_of(medium)
        for h in hashes:
            self._unmap(m, h)

    def clear(self, medium: str | None = None) -> None:
        """Forget everything, or one medium's copies (vLLM's AllBlocksCleared: its GPU prefix cache)."""
        if medium is None:
            if self._holders is not None:
                for k in self._blocks:
                    self._holders.drop(k, self._owner)
            self._blocks.clear()
            self._by_vllm.clear()
            return
        for m, h in [mh for mh in self._by_vllm if mh[0] == medium]:
            self._unmap(m, h)

    def cached(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Tokens of the longest prefix of `keys` (keys of self.block_size) this instance holds, by
        the medium it would come from: the GPU while its run lasts (vLLM's prefix cache stops at
        its first miss), then the CPU, then the disk tier."""
        out = {GPU: 0, CPU: 0, DISK: 0}
        gpu_run = True
        m: str | None
        for k in keys:
            entry = self._blocks.get(k)
            if not entry:
                break
            if gpu_run and GPU in entry:
                m = GPU
            else:
                gpu_run = False
                m = CPU if CPU in entry else DISK if DISK in entry else None
                if m is None:
                    break
            self._blocks.move_to_end(k)
            out[m] += self.block_size or 0
        return out

    def cached_tokens(self, keys: Sequence[bytes]) -> int:
        """Tokens of the longest prefix of `keys` held in any medium."""
        return sum(self.cached(keys).values())
