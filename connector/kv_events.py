"""kvferry's offload tiers as vLLM KV cache events: vLLM publishes what the scheduler-side
connector's ``take_events`` returns on its own KV event stream (``--kv-events-config``), next to
the GPU prefix cache's events, as its own offloading connectors do. A router (kvferry's proxy,
or any consumer of vLLM's events) then counts a prefix held in the CPU or disk tier.

One event block is one kvferry chunk: ``chunk_size`` tokens (a multiple of vLLM's block size),
its hash the chunk's key (a hash chain, so the parent is the previous chunk's key). Only the
events' token ids are meant to be matched on: the keys are kvferry's, not vLLM's block hashes.
"""

from __future__ import annotations

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent

from kvferry.engine.offload.tier_events import ChunkStored, TierEvent

# vLLM names a storage tier "STORAGE"; kvferry's disk tier is announced as "DISK" (the proxy
# reads both as a disk copy).
MEDIUM = {"cpu": MEDIUM_CPU, "disk": "DISK"}


def to_vllm(events: list[TierEvent], chunk_size: int) -> list[KVCacheEvent]:
    """vLLM's events for `events`, in order; a tier without a medium name is left out."""
    out: list[KVCacheEvent] = []
    for ev in events:
        medium = MEDIUM.get(ev.tier)
        if medium is None:
            continue
        if isinstance(ev, ChunkStored):
            if len(ev.tokens) != chunk_size:
                continue
            out.append(BlockStored(block_hashes=[ev.key], parent_block_hash=ev.parent, token_ids=list(ev.tokens),
                                   block_size=chunk_size, lora_id=None, medium=medium, lora_name=None,
                                   locality="LOCAL"))
        else:
            out.append(BlockRemoved(block_hashes=[ev.key], medium=medium, locality="LOCAL"))
    return out
