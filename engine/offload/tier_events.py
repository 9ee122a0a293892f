"""What the indexed tiers (cpu, disk) took in and let go of since the last step, for the
connector to publish as vLLM KV cache events (connector/vllm_kv_events.py) so that a router counts
kvferry's copies too. Bounded: an event dropped here only costs the router's accuracy."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.common.log import RateLimitedLog, get_logger

logger = get_logger(__name__)

MAX_PENDING = 65_536  # events kept between two scheduler steps


@dataclass(frozen=True)
class ChunkStored:
    tier: str
    key: bytes
    parent: bytes | None  # the previous chunk's key (None for a prompt's first chunk)
    tokens: tuple[int, ...]
    lora_name: str | None = None  # the prompt's LoRA adapter, as vLLM's events name it
    extra_keys: tuple[Any, ...] | None = None  # what else keyed the chunk, in vLLM's untagged event form


@dataclass(frozen=True)
class ChunkRemoved:
    tier: str
    key: bytes


TierEvent = ChunkStored | ChunkRemoved


class TierEventLog:
    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._events: deque[TierEvent] = deque(maxlen=max_pending)
        self.dropped = 0
        self._warn = RateLimitedLog(logger, 60.0)

    def __len__(self) -> int:
        return len(self._events)

    def _add(self, ev: TierEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
            self._warn.warning("more than %d offload tier events in one step: the oldest are dropped "
                               "(the router's view of this instance's tiers is less exact)", self._events.maxlen)
        self._events.append(ev)

    def stored(self, tier: str, key: bytes, parent: bytes | None, tokens: Sequence[int],
               lora_name: str | None = None, extra_keys: tuple[Any, ...] | None = None) -> None:
        self._add(ChunkStored(tier, key, parent, tuple(tokens), lora_name, extra_keys))

    def removed(self, tier: str, key: bytes) -> None:
        self._add(ChunkRemoved(tier, key))

    def take(self) -> list[TierEvent]:
        out = list(self._events)
        self._events.clear()
        return out
