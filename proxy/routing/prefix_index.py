"""What one instance holds, learned from its KV events, keyed by the proxy's own hash chain over
token ids (vLLM's block hashes depend on its hash seed; ours do not), with presence kept per
medium: the GPU prefix cache ("GPU", vLLM's own events) and kvferry's offload tiers ("CPU",
"DISK", the connector's events), so a removal from one medium leaves the others' copies.

A (medium, vLLM block hash) is mapped to our keys so a BlockRemoved can find what it removes. An
event block of a coarser size (a kvferry chunk: `chunk_size` tokens, a multiple of vLLM's block
size) is split into the index's blocks. The index is bounded (least recently stored or matched
blocks go first): a block forgotten this way only costs routing quality. An index attached to the
cluster's Holders keeps there which blocks it holds.

A chain starts from a root that names the prompt's identity as the engines key it: the LoRA
adapter (an event's ``lora_name``; a request's ``model`` when it names an adapter seen in the
events) and ``cache_salt`` (the first block's extra key; the request's field), so a prediction
never counts another adapter's or another salt's blocks. A block whose extra keys hold a
multimodal input or prompt embeddings is indexed under a link no request's prediction makes: the
proxy cannot hash those inputs, so it predicts no hit for them (a routing miss, never a wrong
answer: the engines key them themselves).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import msgspec
import xxhash

from kvferry.common.hashing import token_bytes
from kvferry.proxy.routing.holders import Holders

ROOT = xxhash.xxh3_128_digest(b"kvferry-proxy-prefix")
GPU, CPU, DISK = "GPU", "CPU", "DISK"
_MEDIA = {None: GPU, GPU: GPU, CPU: CPU, DISK: DISK, "STORAGE": DISK}  # vLLM calls a storage tier STORAGE


def medium_of(name: str | None) -> str:
    """The index's medium for an event's: GPU when unnamed; any tier it does not know counts as disk."""
    return _MEDIA.get(name.upper() if name else None, DISK)


MAX_ADAPTERS = 4096  # adapter names remembered from events (a request naming one is keyed by it)


def identity_root(lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
    """The root of the chains of prompts of one LoRA adapter and cache_salt (ROOT for neither)."""
    if not lora_name and not cache_salt:
        return ROOT
    return xxhash.xxh3_128_digest(ROOT + msgspec.msgpack.encode([lora_name or None, cache_salt or None]))


def link(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block of `tokens` after the block keyed `prev` (a root for the first block)."""
    return xxhash.xxh3_128_digest(prev + token_bytes(tokens))


def opaque_link(prev: bytes, tokens: Sequence[int]) -> bytes:
    """A block that depends on inputs the proxy cannot hash: a key no prediction makes."""
    return xxhash.xxh3_128_digest(b"opaque" + prev + token_bytes(tokens))


def event_identity(lora_name: str | None, keys: Sequence[object] | None) -> tuple[str | None, bool]:
    """(cache_salt, opaque) from one event block's untagged extra keys (vLLM's order: the LoRA
    name if lora_name is set, (mm identifier, offset) pairs, the cache_salt, prompt-embeds digests)."""
    if not keys:
        return None, False
    rest = list(keys)
    if lora_name is not None and rest and rest[0] == lora_name:
        rest = rest[1:]
    salt, opaque = None, False
    for k in rest:
        if isinstance(k, str) and salt is None:
            salt = k
        else:
            opaque = True  # a multimodal pair, prompt-embeds bytes, or a form this proxy does not know
    return salt, opaque


def prefix_keys(tokens: Sequence[int], block_size: int, limit: int | None = None, root: bytes = ROOT) -> list[bytes]:
    """One key per full block of `tokens` (at most `limit` blocks), chained from `root`."""
    keys: list[bytes] = []
    prev = root
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, limit)
    for i in range(n):
        prev = link(prev, tokens[i * block_size:(i + 1) * block_size])
        keys.append(prev)
    return keys


class PrefixIndex:
    def __init__(self, max_blocks: int, adapters: set[str] | None = None) -> None:
        self.max_blocks = max_blocks
        # LoRA adapter names seen in events (shared by a cluster's indexes: CacheView)
        self.adapters: set[str] = adapters if adapters is not None else set()
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
               block_size: int, medium: str | None = None, lora_name: str | None = None,
               extra_keys: Sequence[Sequence[object] | None] | None = None) -> int:
        """Apply a BlockStored (`extra_keys`: one entry per block, vLLM's untagged form); returns
        the index blocks added."""
        m = medium_of(medium)
        if block_size <= 0 or len(tokens) < len(hashes) * block_size:
            raise ValueError(f"BlockStored with {len(hashes)} blocks of {block_size} but {len(tokens)} tokens")
        if extra_keys is not None and len(extra_keys) > len(hashes):
            raise ValueError(f"BlockStored with {len(hashes)} blocks but {len(extra_keys)} extra keys")
        sub = self._split(block_size, m)
        bs = self.block_size
        assert bs is not None  # _split set it
        if lora_name and lora_name not in self.adapters and len(self.adapters) < MAX_ADAPTERS:
            self.adapters.add(lora_name)
        extras = list(extra_keys or ())
        extras += [None] * (len(hashes) - len(extras))
        if parent is None:
            prev: bytes | None = identity_root(lora_name, event_identity(lora_name, extras[0] if extras else None)[0])
        else:
            prev = self._parent(m, parent)
        if prev is None:
            self.orphans += 1
            return 0
        for i, h in enumerate(hashes):
            keys = []
            opaque = event_identity(lora_name, extras[i])[1]
            for j in range(sub):
                start = (i * sub + j) * bs
                prev = (opaque_link if opaque else link)(prev, tokens[start:start + bs])
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
