"""kvferry's offload tiers as vLLM KV cache events: vLLM publishes what the scheduler-side
connector's ``take_events`` returns on its own KV event stream (``--kv-events-config``), next to
the GPU prefix cache's events, as its own offloading connectors do. A router (kvferry's proxy,
or any consumer of vLLM's events) then counts a prefix held in the CPU or disk tier.

One event block is one kvferry chunk: ``chunk_size`` tokens (a multiple of vLLM's block size),
its hash the chunk's key (a hash chain, so the parent is the previous chunk's key). Only the
events' token ids are meant to be matched on: the keys are kvferry's, not vLLM's block hashes.
The chunk's LoRA adapter and extra keys are published as vLLM publishes its own blocks' (the
adapter's name, the untagged keys), so a router keys both alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent

from kvferry.common import zsock
from kvferry.common.config import ConfigError, KVFerryConfig
from kvferry.common.kv_events_relay import KVEventsRelay, RelaySpec, dialable
from kvferry.common.log import get_logger
from kvferry.common.netutil import is_loopback
from kvferry.engine.api import ChunkStored, TierEvent

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)

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
                                   block_size=chunk_size, lora_id=None, medium=medium, lora_name=ev.lora_name,
                                   extra_keys=None if ev.extra_keys is None else [ev.extra_keys],
                                   locality="LOCAL"))
        else:
            out.append(BlockRemoved(block_hashes=[ev.key], medium=medium, locality="LOCAL"))
    return out


def start_relay(cfg: KVFerryConfig, vc: VllmConfig) -> KVEventsRelay | None:
    """kvferry's authenticated relay of this instance's KV events (config keys kv_events_relay_*,
    common/kv_events_relay.py), started next to vLLM's publisher; None when not configured."""
    if cfg.kv_events_relay_port is None:
        return None
    ev = getattr(vc, "kv_events_config", None)
    if ev is None or not ev.enable_kv_cache_events or ev.publisher != "zmq":
        raise ConfigError("config key kv_events_relay_port relays vLLM's KV events, but vLLM publishes none: start "
                          "vLLM with --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                          "\"endpoint\": \"ipc:///PATH/ev.sock\", \"replay_endpoint\": \"ipc:///PATH/replay.sock\"}' "
                          "(or remove kv_events_relay_port)")
    for name in ("endpoint", "replay_endpoint"):
        ep = getattr(ev, name, None) or ""
        if ep.startswith("tcp://") and not is_loopback(ep[6:].rsplit(":", 1)[0]):
            logger.warning("vLLM's KV events %s %s listens beyond loopback, unauthenticated, next to kvferry's "
                           "relay: bind it to ipc:// or 127.0.0.1 so only the relay reads it", name, ep)
    spec = RelaySpec(dialable(ev.endpoint), dialable(ev.replay_endpoint) if ev.replay_endpoint else None,
                     cfg.kv_events_relay_host or "127.0.0.1", cfg.kv_events_relay_port,
                     cfg.kv_events_relay_replay_port)
    try:
        return KVEventsRelay(spec, zsock.trust_of(cfg)).start()
    except (zsock.BindError, zsock.ExposureError) as e:
        raise ConfigError(str(e)) from None
