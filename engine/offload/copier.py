"""The copier: offload's worker side (one per TP rank, in vLLM's worker process), the planner's
decisions carried out on the data.

Loads run before the forward pass, evictions and stores after it, in the order the planner made
them. Each chunk goes to or comes from a tier by the name the planner gave it; the tiers
themselves (engine/tiers/) hide how they keep it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvferry.common import zsock
from kvferry.common.config import KVFerryConfig
from kvferry.common.counters import Counters
from kvferry.common.log import get_logger
from kvferry.common.units import fmt_bytes
from kvferry.engine.chunking import loaded_blocks, scatter_chunks
from kvferry.engine.offload.ops import GB, CacheEvict, CacheLoad, CacheStore
from kvferry.engine.p2p.service import P2PService
from kvferry.engine.p2p.tier import P2PTier
from kvferry.engine.remote import cachegen, mooncake_settings, redis_settings
from kvferry.engine.remote.serde import ChunkShape, Serde
from kvferry.engine.tiers import nixl_storage
from kvferry.engine.tiers.cpu import CPUTier
from kvferry.engine.tiers.disk import DiskTier, rank_root
from kvferry.engine.tiers.interface import LoadRequest, Tier
from kvferry.engine.tiers.nixl_posix import NixlPosixDiskTier
from kvferry.engine.tiers.remote import RemoteTier
from kvferry.kernels.paged_copy import PagedKV

logger = get_logger(__name__)

LOOKUP_ORDER = ("cpu", "disk", "p2p", "remote")  # also the order of the load log line


@dataclass
class CopierCounters(Counters):
    """The copies between vLLM's KV cache and the tiers (kvferry:cache_retrieved_bytes, ...)."""

    retrieved_tokens: int = 0
    retrieved_bytes: int = 0
    offloaded_tokens: int = 0
    offloaded_bytes: int = 0
    load_errors: int = 0


class OffloadCopier:
    """Worker side for one TP rank: the tiers' data and the copies in and out of vLLM's blocks."""

    def __init__(self, cfg: KVFerryConfig, kv: PagedKV, tp_rank: int, layout_digest: bytes, isa: str = "") -> None:
        """`isa`: vLLM CPU's attention kernel family, which orders K within a block (cachegen reads it)."""
        self.kv, self.chunk_size = kv, cfg.chunk_size
        posix = nixl_storage.posix(cfg)
        cfg = nixl_storage.effective(cfg, kv.chunk_nbytes("block", cfg.chunk_size))
        self.cpu: CPUTier | None = None
        self.disk: DiskTier | None = None
        self.remote: RemoteTier | None = None
        if cfg.remote_url:
            lay = kv.layout
            serde = Serde(cfg.remote_serde, ChunkShape(lay.dtype, kv.num_layers, lay.num_kv_heads, lay.head_size,
                                                       layout_digest, lay.name, lay.block_size, isa),
                          cachegen.Bins.for_model(kv.num_layers, lay.kv_planes,
                                                  key=(cfg.cachegen_key_bins[0], cfg.cachegen_key_bins[1]),
                                                  value=(cfg.cachegen_value_bins[0], cfg.cachegen_value_bins[1])))
            self.remote = RemoteTier(cfg.remote_url, cfg.blocking_timeout_secs, serde, tp_rank,
                                     secret=zsock.trust_of(cfg).secret, redis=redis_settings.from_config(cfg),
                                     mooncake=mooncake_settings.from_config(cfg))
        if cfg.local_cpu and cfg.max_local_cpu_size > 0:
            self.cpu = CPUTier(pin=kv.device.type == "cuda", capacity=int(cfg.max_local_cpu_size * GB),
                               slot_bytes=kv.chunk_nbytes("block", cfg.chunk_size))
        if cfg.local_disk:
            self.disk = (NixlPosixDiskTier if posix else DiskTier)(rank_root(cfg.local_disk, tp_rank), layout_digest)
        self.tiers: dict[str, Tier] = {}
        self._p2p: P2PService | None = None
        self._order_tiers()
        self._lost: dict[str, set[bytes]] = {}
        self.counters = CopierCounters()

    def _order_tiers(self) -> None:
        have = {"cpu": self.cpu, "disk": self.disk, "remote": self.remote,
                "p2p": P2PTier(self._p2p) if self._p2p is not None else None}
        self.tiers = {name: t for name in LOOKUP_ORDER if (t := have[name]) is not None}

    @property
    def p2p(self) -> P2PService | None:
        return self._p2p

    @p2p.setter
    def p2p(self, service: P2PService | None) -> None:
        """Set by the connector when enable_p2p (the P2P service lends this rank's CPU tier)."""
        self._p2p = service
        self._order_tiers()

    def load(self, op: CacheLoad) -> list[int]:
        """Copy the op's chunks into its blocks; on any miss or failure load nothing and return
        the blocks vLLM must recompute. Runs in vLLM's worker: never raises."""
        t0 = time.monotonic()
        bs = self.kv.layout.block_size
        try:
            nbytes = self._load(op)
        except Exception as e:  # noqa: BLE001 - vLLM's worker boundary: a tier's bad data costs a recompute
            self.counters.load_errors += 1
            self._lost.setdefault("cpu", set()).update(k for k, p in zip(op.keys, op.promote, strict=True) if p)
            logger.warning("request %s: loading its cached KV failed (%s: %s); recomputing its prompt from token %d",
                           op.req_id, type(e).__name__, e, op.skip_tokens)
            return loaded_blocks(op.block_ids, op.skip_tokens, op.num_tokens, bs)
        if nbytes is None:
            return loaded_blocks(op.block_ids, op.skip_tokens, op.num_tokens, bs)
        dt = time.monotonic() - t0
        n = op.num_tokens - op.skip_tokens
        self.counters.retrieved_tokens += n
        self.counters.retrieved_bytes += nbytes
        where = ", ".join(f"{op.tiers.count(t)} from {t}" for t in LOOKUP_ORDER if t in op.tiers)
        logger.info("Retrieved %d out of %d required tokens (from %d total tokens). size: %s, cost %.4f ms, "
                    "throughput: %.4f GB/s; chunks: %s", n, n, op.total_tokens, fmt_bytes(nbytes), dt * 1e3,
                    nbytes / max(dt, 1e-9) / 1e9, where)
        return []

    def _prefetch(self, op: CacheLoad) -> None:
        """Tiers that read in batches (a peer) read their share of the op now."""
        for name in dict.fromkeys(op.tiers):
            tier = self.tiers.get(name)
            if tier is None:
                continue
            idx = [i for i, t in enumerate(op.tiers) if t == name]
            tier.prefetch(LoadRequest([op.keys[i] for i in idx],
                                      [self.kv.chunk_nbytes("block", op.tokens[i]) for i in idx],
                                      op.peer_id, op.peers))

    def _load(self, op: CacheLoad) -> int | None:
        """The op's chunks, each checked for its size, scattered into its blocks: bytes copied, or
        None on a miss (counted, and the chunks reported lost)."""
        datas = []
        self._prefetch(op)
        for key, name, promote, n in zip(op.keys, op.tiers, op.promote, op.tokens, strict=True):
            want = self.kv.chunk_nbytes("block", n)
            tier = self.tiers.get(name)
            data = tier.fetch(key, n, want) if tier is not None else None
            bad = data is not None and (data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != want)
            if data is None or bad:
                self._missed(op, key, name, data if bad else None, want)
                return None
            if promote and self.cpu is not None:
                self.cpu.put(key, data)
            datas.append(self._host_to_device(data))
        return scatter_chunks(self.kv, "block", self.chunk_size, datas, op.tokens, op.first_chunk, op.block_ids,
                              op.skip_tokens, op.num_tokens)

    def _missed(self, op: CacheLoad, key: bytes, name: str, bad: torch.Tensor | None, want: int) -> None:
        self._lost.setdefault(name, set()).add(key)
        # The index counted the rest as promoted to the CPU tier: they are not there.
        j = op.keys.index(key)
        self._lost.setdefault("cpu", set()).update(k for k, p in zip(op.keys[j:], op.promote[j:], strict=True) if p)
        self.counters.load_errors += 1
        if bad is not None:  # e.g. a chunk a move brought in from a peer of another build
            if name == "cpu" and self.cpu is not None:
                self.cpu.delete(key)
            logger.warning("request %s: chunk %s from the %s tier is %d bytes (%s), not %d; recomputing its "
                           "prompt from token %d", op.req_id, key.hex()[:12], name, bad.numel(), bad.dtype,
                           want, op.skip_tokens)
        else:
            logger.warning("request %s: chunk %s missing from the %s tier; recomputing its prompt from "
                           "token %d", op.req_id, key.hex()[:12], name, op.skip_tokens)

    def save(self, ops: Sequence[CacheStore | CacheEvict]) -> None:
        """Evictions and stores in the order the planner made them."""
        for op in ops:
            if isinstance(op, CacheEvict):
                tier = self.tiers.get(op.tier)
                if tier is not None:
                    tier.remove(op.key)
            else:
                self._store(op)

    def _store(self, op: CacheStore) -> None:
        t0 = time.monotonic()
        bs, per = self.kv.layout.block_size, self.chunk_size // self.kv.layout.block_size
        nbytes = 0
        for c, key, dest, n in zip(op.chunks, op.keys, op.tiers, op.tokens, strict=True):
            data = self.cpu.get(key) if self.cpu is not None and "cpu" not in dest else None
            if data is None:
                data = self._gather(op.block_ids[c * per:c * per + -(-n // bs)], n)
                nbytes += data.numel()
            for name in dest:
                tier = self.tiers.get(name)
                if tier is not None:
                    tier.store(key, data, n)
        dt = time.monotonic() - t0
        n = sum(op.tokens)
        self.counters.offloaded_tokens += n
        self.counters.offloaded_bytes += nbytes
        logger.info("Stored %d out of total %d tokens. size: %s, cost %.4f ms, throughput: %.4f GB/s",
                    n, op.total_tokens, fmt_bytes(nbytes), dt * 1e3, nbytes / max(dt, 1e-9) / 1e9)

    def _gather(self, block_ids: list[int], n: int) -> torch.Tensor:
        size = self.kv.chunk_nbytes("block", n)
        host = self.cpu.alloc(size) if self.cpu is not None else torch.empty(size, dtype=torch.uint8)
        if self.kv.device.type == "cpu":
            self.kv.copy_batch([block_ids], [host], "block", [n], to_chunk=True)
        else:  # GPU: gather on the device, then one copy to (pinned) host memory
            dev = torch.empty(size, dtype=torch.uint8, device=self.kv.device)
            self.kv.copy_batch([block_ids], [dev], "block", [n], to_chunk=True)
            host.copy_(dev)
        return host

    def _host_to_device(self, data: torch.Tensor) -> torch.Tensor:
        if self.kv.device.type == "cpu":
            return data
        return data.to(self.kv.device, non_blocking=data.is_pinned())

    def take_lost(self) -> dict[str, set[bytes]]:
        lost, self._lost = self._lost, {}
        for name, tier in self.tiers.items():
            more = tier.take_lost()
            if more:
                lost.setdefault(name, set()).update(more)
        return lost

    def stats(self) -> dict[str, float]:
        out = self.counters.as_dict()
        for tier in self.tiers.values():
            out.update(tier.stats())
        return out

    def close(self) -> None:
        # The P2P side lends the CPU tier: it goes first, the CPU tier last.
        for name in ("p2p", "remote", "disk", "cpu"):
            tier = self.tiers.get(name)
            if tier is not None:
                tier.close()
