"""What the offload planner decides and the copier carries out: loads, stores and evictions of chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvferry.common.hashing import salt_for
from kvferry.common.wire import messages as m

GB = 1 << 30  # LMCache's max_local_cpu_size / max_local_disk_size "GB" are GiB


def offload_salt(model: str, dtype: str, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                 chunk_size: int, tp_size: int) -> bytes:
    """Keys of different models, shapes or shardings never match."""
    return salt_for("offload-v1", model, dtype, num_layers, num_kv_heads, head_size, block_size, chunk_size, tp_size)


@dataclass(frozen=True)
class PromptIdentity:
    """What keys a prompt's chunks besides its tokens and the salt: one extra per chunk
    (common/hashing.py; None where the chunk has none) and, for routers, the same facts as vLLM's
    KV events publish them (the LoRA adapter's name, each chunk's untagged extra keys)."""

    extras: tuple[bytes | None, ...] = ()
    lora_name: str | None = None
    event_keys: tuple[tuple[Any, ...] | None, ...] = ()

    def event_keys_of(self, i: int) -> tuple[Any, ...] | None:
        return self.event_keys[i] if i < len(self.event_keys) else None


PLAIN = PromptIdentity()  # tokens alone: no adapter, no cache_salt, no multimodal or embedding input


@dataclass
class CacheLoad:
    req_id: str
    keys: list[bytes]
    tiers: list[str]
    promote: list[bool]  # also keep this disk chunk in the CPU tier
    first_chunk: int
    tokens: list[int]  # tokens in each chunk
    block_ids: list[int]  # the request's blocks from token 0
    skip_tokens: int  # computed locally (vLLM's prefix cache): not written
    num_tokens: int  # load up to here
    total_tokens: int  # the prompt's length (for the log line)
    peer_id: str | None = None  # the instance "p2p" chunks come from
    peers: list[m.PeerAddr] = field(default_factory=list)  # its workers, by TP rank


@dataclass
class CacheStore:
    req_id: str
    chunks: list[int]  # chunk numbers within the prompt
    keys: list[bytes]
    tiers: list[list[str]]  # where each chunk goes
    tokens: list[int]
    block_ids: list[int]
    total_tokens: int


@dataclass
class CacheEvict:
    tier: str
    key: bytes


def layout_digest(fp_bytes: bytes) -> bytes:
    """16 bytes naming a worker's KV layout (written into and checked against every disk file)."""
    return xxhash.xxh3_128_digest(fp_bytes)
