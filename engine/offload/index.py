"""Which chunk lives in which tier: LRU bookkeeping with byte limits, no data.

The connector's scheduler side owns one :class:`ChunkIndex` and decides every admission and
eviction; the worker side only carries them out, in the same order, on the data (see
``engine/offload/``). Both sides therefore agree on what each tier holds without a lookup
round trip per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvferry.common.counters import Counters
from kvferry.engine.offload.tier_events import TierEventLog


@dataclass
class TierCounters(Counters):
    """One indexed tier's decisions, exported as ``<name>|<tier>`` (kvferry:cache_*{tier})."""

    hit_chunks: int = 0
    hit_tokens: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    evicted_chunks: int = 0
    evicted_bytes: int = 0
    rejected_chunks: int = 0


@dataclass
class LookupCounters(Counters):
    """Every prompt looked up, whichever tier answered (kvferry:cache_lookup_tokens, ...)."""

    lookups: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    miss_tokens: int = 0
    unkeyable_requests: int = 0  # prompts with an input the connector cannot key: neither stored nor looked up


@dataclass
class TierIndex:
    """One tier's keys in LRU order (oldest first) with their sizes, capped at `capacity` bytes."""

    name: str
    capacity: int
    entries: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    used: int = 0
    counters: TierCounters = field(default_factory=TierCounters)
    events: TierEventLog | None = None  # removals are logged here; the planner logs what it stores (it has the tokens)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, key: bytes) -> None:
        self.entries.move_to_end(key)

    def admit(self, key: bytes, nbytes: int) -> tuple[bool, list[bytes]]:
        """Add `key` (most recent), evicting least recently used keys until it fits.

        Returns (admitted, evicted keys). A chunk larger than the whole tier is not admitted and
        nothing is evicted."""
        if key in self.entries:
            self.touch(key)
            return True, []
        if nbytes > self.capacity:
            self.counters.rejected_chunks += 1
            return False, []
        need = self.used + nbytes - self.capacity
        victims: list[bytes] = []
        freed = 0
        for k, n in self.entries.items():
            if freed >= need:
                break
            victims.append(k)
            freed += n
        for k in victims:
            self.counters.evicted_bytes += self.entries[k]
            self.drop(k)
        self.counters.evicted_chunks += len(victims)
        self.entries[key] = nbytes
        self.used += nbytes
        self.counters.stored_chunks += 1
        self.counters.stored_bytes += nbytes
        return True, victims

    def drop(self, key: bytes) -> bool:
        n = self.entries.pop(key, None)
        if n is None:
            return False
        self.used -= n
        if self.events is not None:
            self.events.removed(self.name, key)
        return True

    def clear(self) -> list[bytes]:
        keys = list(self.entries)
        self.entries.clear()
        self.used = 0
        if self.events is not None:
            for k in keys:
                self.events.removed(self.name, k)
        return keys


class ChunkIndex:
    """The tiers in lookup order (e.g. cpu, then disk)."""

    def __init__(self, tiers: Sequence[TierIndex]) -> None:
        self.tiers = list(tiers)
        self.by_name = {t.name: t for t in self.tiers}
        self.counters = LookupCounters()

    def locate(self, key: bytes) -> str | None:
        """The first tier holding `key`, or None."""
        for t in self.tiers:
            if key in t:
                return t.name
        return None

    def prefix(self, keys: Sequence[bytes]) -> list[str]:
        """The tier of each chunk of the longest cached prefix of `keys` (stops at the first miss)."""
        out: list[str] = []
        for k in keys:
            where = self.locate(k)
            if where is None:
                break
            out.append(where)
        return out

    def record_lookup(self, total_tokens: int, hit_tokens: int) -> None:
        self.counters.lookups += 1
        self.counters.lookup_tokens += total_tokens
        self.counters.lookup_hit_tokens += hit_tokens
        self.counters.miss_tokens += total_tokens - hit_tokens

    def forget(self, key: bytes, tier: str | None = None) -> None:
        """Drop `key` from one tier (or all): its data was found missing or corrupt."""
        for t in self.tiers:
            if tier is None or t.name == tier:
                t.drop(key)
