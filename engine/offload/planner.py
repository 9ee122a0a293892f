"""The offload tiers of the KV engine (local CPU, local disk) behind vLLM's scheduler and worker.

- :class:`OffloadPlanner` (scheduler side) keys each prompt's chunks, finds the longest cached
  prefix, and decides every load, store, promotion and eviction on its :class:`ChunkIndex`.
- :class:`OffloadWorker` (worker side, one per TP rank) carries those decisions out on the data
  in the order they were made: loads before the forward pass, evictions and stores after it.
  Stores copy the chunks to host memory in the step (a memcpy); disk writes happen behind it.

Neither knows vLLM: the connector maps requests and blocks onto these calls, and the standalone
engine (launcher/standalone.py) uses the same tiers without vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from kvferry.common import messages as m
from kvferry.common import zsock
from kvferry.common.config import KVFerryConfig
from kvferry.common.hashing import chunk_keys, salt_for
from kvferry.common.log import get_logger
from kvferry.common.units import fmt_bytes
from kvferry.engine.chunking import chunk_tokens, loaded_blocks, scatter_chunks
from kvferry.engine.offload.index import ChunkIndex, TierIndex
from kvferry.engine.p2p import ControllerLookup, P2PWorker, PlannerNotices
from kvferry.engine.remote import redis_settings
from kvferry.engine.remote import serde as remote_serde
from kvferry.engine.remote.serde import ChunkShape, Serde
from kvferry.engine.tiers import disk as disk_tier
from kvferry.engine.tiers.cpu import CPUTier
from kvferry.engine.tiers.remote import RemoteTier, parse_url
from kvferry.kernels.paged_copy import PagedKV

logger = get_logger(__name__)

GB = 1 << 30  # LMCache's max_local_cpu_size / max_local_disk_size "GB" are GiB


def offload_salt(model: str, dtype: str, num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                 chunk_size: int, tp_size: int) -> bytes:
    """Keys of different models, shapes or shardings never match."""
    return salt_for("offload-v1", model, dtype, num_layers, num_kv_heads, head_size, block_size, chunk_size, tp_size)


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


@dataclass
class _Lookup:
    keys: list[bytes]
    where: list[str] = field(default_factory=list)  # tier of each chunk of the cached prefix
    local: int = 0  # tokens vLLM's own prefix cache had at the last match
    remote: dict[int, bool] = field(default_factory=dict)  # chunk -> the remote store has it (asked once)
    p2p: tuple[int, m.LookupResponse] | None = None  # (first chunk asked, the controller's answer)
    sources: dict[str, int] = field(default_factory=dict)  # tokens of the planned load, by tier


class OffloadPlanner:
    """Scheduler side: the index and every decision about it."""

    def __init__(self, cfg: KVFerryConfig, salt: bytes, block_size: int, block_bytes: int,
                 notice_addr: str | None = None) -> None:
        if cfg.chunk_size % block_size:
            raise ValueError(f"chunk_size {cfg.chunk_size} is not a multiple of vLLM's block_size {block_size}: "
                             f"set chunk_size to a multiple of {block_size} (e.g. 256), or vLLM's --block-size "
                             f"to a divisor of {cfg.chunk_size}")
        self.cfg, self.salt = cfg, salt
        self.chunk_size, self.block_size, self.block_bytes = cfg.chunk_size, block_size, block_bytes
        tiers = []
        if cfg.local_cpu and cfg.max_local_cpu_size > 0:
            tiers.append(TierIndex("cpu", int(cfg.max_local_cpu_size * GB)))
        self._save_ops: list[CacheStore | CacheEvict] = []
        if cfg.local_disk:
            disk = TierIndex("disk", int(cfg.max_local_disk_size * GB))
            found = disk_tier.scan(disk_tier.rank_root(cfg.local_disk, 0))
            for key, nbytes in found:  # oldest first: the newest stay if the limit shrank
                _, victims = disk.admit(key, nbytes)
                self._save_ops += [CacheEvict("disk", v) for v in victims]
            disk.counters.update(stored_chunks=0, stored_bytes=0)
            if found:
                logger.info("disk tier %s: %d chunks (%s) from earlier runs", disk_tier.disk_path(cfg.local_disk),
                            len(disk), fmt_bytes(disk.used))
            tiers.append(disk)
        self.index = ChunkIndex(tiers)
        # The remote store is shared, so it is asked (bounded) rather than indexed; the scheduler
        # waits on that answer, hence the short limit.
        self.remote: RemoteTier | None = None
        # Hits of the tiers that are asked rather than indexed here.
        self.shared_counters = {t: {"hit_chunks": 0, "hit_tokens": 0} for t in ("p2p", "remote")}
        if cfg.remote_url:
            parse_url(cfg.remote_url)
            remote_serde.check_name(cfg.remote_serde)
            self.remote = RemoteTier(cfg.remote_url, min(1.0, cfg.blocking_timeout_secs),
                                     secret=zsock.trust_of(cfg).secret, redis=redis_settings.from_config(cfg))
        # P2P: the controller says which instance holds a prefix; the worker's notices say what a
        # controller's move put into or took out of this instance's CPU tier.
        self.p2p: ControllerLookup | None = None
        self.notices: PlannerNotices | None = None
        if cfg.enable_p2p:
            self.p2p = ControllerLookup(cfg, min(1.0, cfg.blocking_timeout_secs))
            if notice_addr:
                self.notices = PlannerNotices(notice_addr, self.p2p.trust)
        self._lookups: dict[str, _Lookup] = {}
        self._loads: list[CacheLoad] = []

    @property
    def enabled(self) -> bool:
        return bool(self.index.tiers) or self.remote is not None

    def _apply_notices(self) -> None:
        if self.notices is None:
            return
        adopted, dropped = self.notices.drain()
        cpu = self.index.by_name.get("cpu")
        for key in dropped:
            self.index.forget(key, "cpu")
        for key, nbytes in adopted:
            if cpu is None:
                continue
            ok, victims = cpu.admit(key, nbytes)
            self._save_ops += [CacheEvict("cpu", v) for v in victims]
            if not ok:
                self._save_ops.append(CacheEvict("cpu", key))

    def nbytes(self, tier: str, tokens: int) -> int:
        data = -(-tokens // self.block_size) * self.block_bytes
        return data + disk_tier.HEADER_BYTES if tier == "disk" else data

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return chunk_keys(tokens, self.chunk_size, self.salt, include_partial=self.cfg.save_unfull_chunk)

    def match(self, req_id: str, tokens: Sequence[int], num_computed: int, leave_one: bool = True) -> int:
        """Tokens past `num_computed` that a tier holds (vLLM computes at least the last one)."""
        look = self._lookups.get(req_id)
        if look is None:
            look = self._lookups[req_id] = _Lookup(self.keys(tokens))
        self._apply_notices()
        look.where = self.index.prefix(look.keys)
        look.local = num_computed
        if self.p2p is not None and len(look.where) < len(look.keys):
            start = len(look.where)
            if look.p2p is None or look.p2p[0] != start:
                ans = self.p2p.lookup(look.keys[start:])
                look.p2p = (start, ans if ans is not None else m.LookupResponse())
            ans = look.p2p[1]
            if ans.instance_id is not None and ans.instance_id != self.cfg.lmcache_instance_id:
                look.where += ["p2p"] * min(ans.num_chunks, len(look.keys) - start)
        if self.remote is not None and len(look.where) < len(look.keys):
            ask = [i for i in range(len(look.where), len(look.keys)) if i not in look.remote]
            look.remote.update(zip(ask, self.remote.exists([look.keys[i] for i in ask]), strict=True))
            for i in range(len(look.where), len(look.keys)):
                if not look.remote[i]:
                    break
                look.where.append("remote")
        hit = min(len(look.where) * self.chunk_size, len(tokens))
        return max(0, min(hit, len(tokens) - leave_one) - num_computed)

    def after_alloc(self, req_id: str, tokens: Sequence[int], block_ids: Sequence[int], num_external: int) -> None:
        """vLLM admitted the request with `num_external` tokens from us (after its own prefix
        cache's, as given to the last `match`): plan their load."""
        look = self._lookups.get(req_id)
        if look is None:
            return
        num_computed = look.local
        look.sources = {}
        hit = min(len(look.where) * self.chunk_size, len(tokens))
        self.index.record_lookup(len(tokens), hit)
        logger.info("request %s: total tokens %d, hit tokens %d, need to load %d", req_id, len(tokens), hit,
                    max(num_external, 0))
        if num_external <= 0:
            return
        end = num_computed + num_external
        c0, c1 = num_computed // self.chunk_size, -(-end // self.chunk_size)
        sizes = chunk_tokens(len(tokens), self.chunk_size)
        op = CacheLoad(req_id, look.keys[c0:c1], look.where[c0:c1], [], c0, sizes[c0:c1], list(block_ids),
                       num_computed, end, len(tokens))
        if "p2p" in op.tiers and look.p2p is not None:
            op.peer_id, op.peers = look.p2p[1].instance_id, list(look.p2p[1].peers)
        cpu = self.index.by_name.get("cpu")
        for i, (key, tier) in enumerate(zip(op.keys, op.tiers, strict=True)):
            t = self.index.by_name.get(tier)
            if t is not None:
                t.touch(key)
            counters = t.counters if t is not None else self.shared_counters[tier]
            n = min(end, (c0 + i + 1) * self.chunk_size) - max(num_computed, (c0 + i) * self.chunk_size)
            counters["hit_chunks"] += 1
            counters["hit_tokens"] += n
            look.sources[tier] = look.sources.get(tier, 0) + n
            promote = False
            if tier != "cpu" and cpu is not None:
                promote, victims = cpu.admit(key, self.nbytes("cpu", op.tokens[i]))
                self._save_ops += [CacheEvict("cpu", v) for v in victims]
            op.promote.append(promote)
        self._loads.append(op)

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """Tokens of the load `after_alloc` planned, by the tier that supplies them."""
        look = self._lookups.get(req_id)
        return dict(look.sources) if look is not None else {}

    def store(self, req_id: str, tokens: Sequence[int], block_ids: Sequence[int]) -> None:
        """The prompt's KV is complete in `block_ids` after this step: store what no tier has."""
        look = self._lookups.get(req_id)
        keys = look.keys if look is not None else self.keys(tokens)
        sizes = chunk_tokens(len(tokens), self.chunk_size)
        op = CacheStore(req_id, [], [], [], [], list(block_ids), len(tokens))
        pos: dict[bytes, int] = {}
        evicts: list[CacheEvict] = []
        for i, key in enumerate(keys):
            dest: list[str] = []
            # Chunks a local tier already had were sent to the remote store when first stored.
            if self.remote is not None and not self.index.locate(key) and not (look and look.remote.get(i)):
                dest.append("remote")
            for t in self.index.tiers:
                if key in t:
                    t.touch(key)
                    continue
                ok, victims = t.admit(key, self.nbytes(t.name, sizes[i]))
                for v in victims:
                    j = pos.get(v)
                    if j is not None and t.name in op.tiers[j]:
                        op.tiers[j].remove(t.name)  # evicted before it was written: not written
                    else:
                        evicts.append(CacheEvict(t.name, v))
                if ok:
                    dest.append(t.name)
            if dest:
                pos[key] = len(op.chunks)
                op.chunks.append(i)
                op.keys.append(key)
                op.tiers.append(dest)
                op.tokens.append(sizes[i])
        keep = [j for j, d in enumerate(op.tiers) if d]
        op.chunks, op.keys, op.tiers, op.tokens = ([lst[j] for j in keep] for lst in
                                                   (op.chunks, op.keys, op.tiers, op.tokens))
        self._save_ops += evicts
        if op.chunks:
            self._save_ops.append(op)

    def take(self) -> tuple[list[CacheLoad], list[CacheStore | CacheEvict]]:
        """This step's loads (before the forward pass) and saves (after it), in decision order."""
        self._apply_notices()
        loads, self._loads = self._loads, []
        saves, self._save_ops = self._save_ops, []
        return loads, saves

    def finished(self, req_id: str) -> None:
        self._lookups.pop(req_id, None)

    def forget(self, lost: dict[str, set[bytes]]) -> None:
        """A worker found these chunks missing or corrupt: later lookups miss them."""
        for tier, keys in lost.items():
            for key in keys:
                self.index.forget(key, tier)
            if tier == "remote":  # the store dropped them since it was asked: later matches miss
                for look in self._lookups.values():
                    look.remote.update((i, False) for i, k in enumerate(look.keys) if k in keys)
            if tier == "p2p":  # the peer failed: ask the controller again next time
                for look in self._lookups.values():
                    if any(k in keys for k in look.keys):
                        look.p2p = None

    def stats(self) -> dict[str, float]:
        """Counters (cumulative) and usage, flat: ``name`` or ``name|tier``."""
        out: dict[str, float] = dict(self.index.counters)
        for t in self.index.tiers:
            for name, v in t.counters.items():
                out[f"{name}|{t.name}"] = v
            out[f"usage_bytes|{t.name}"] = t.used
            out[f"chunks|{t.name}"] = len(t)
        if self.remote is not None:
            out.update({f"{k}|remote": v for k, v in self.shared_counters["remote"].items()})
            out["remote_errors"] = self.remote.stats()["remote_errors"]
        if self.p2p is not None:
            out.update({f"{k}|p2p": v for k, v in self.shared_counters["p2p"].items()})
            out["p2p_lookup_errors"] = self.p2p.errors
        return out

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.p2p is not None:
            self.p2p.close()
        if self.notices is not None:
            self.notices.close()


class OffloadWorker:
    """Worker side for one TP rank: the tiers' data and the copies in and out of vLLM's blocks."""

    def __init__(self, cfg: KVFerryConfig, kv: PagedKV, tp_rank: int, layout_digest: bytes) -> None:
        self.kv, self.chunk_size = kv, cfg.chunk_size
        self.remote = None
        if cfg.remote_url:
            lay = kv.layout
            serde = Serde(cfg.remote_serde, ChunkShape(lay.dtype, kv.num_layers, lay.num_kv_heads, lay.head_size,
                                                       layout_digest))
            self.remote = RemoteTier(cfg.remote_url, cfg.blocking_timeout_secs, serde, tp_rank,
                                     secret=zsock.trust_of(cfg).secret, redis=redis_settings.from_config(cfg))
        self.cpu = CPUTier(pin=kv.device.type == "cuda", capacity=int(cfg.max_local_cpu_size * GB),
                           slot_bytes=kv.chunk_nbytes("block", cfg.chunk_size)) \
            if cfg.local_cpu and cfg.max_local_cpu_size > 0 else None
        self.p2p: P2PWorker | None = None  # set by the connector when enable_p2p
        self.disk = disk_tier.DiskTier(disk_tier.rank_root(cfg.local_disk, tp_rank), layout_digest) \
            if cfg.local_disk else None
        self._lost: dict[str, set[bytes]] = {}
        self.counters = {"retrieved_tokens": 0, "retrieved_bytes": 0, "offloaded_tokens": 0, "offloaded_bytes": 0,
                         "load_errors": 0}

    def _tier(self, name: str) -> CPUTier | disk_tier.DiskTier | None:
        return self.cpu if name == "cpu" else self.disk if name == "disk" else None

    def load(self, op: CacheLoad) -> list[int]:
        """Copy the op's chunks into its blocks; on any miss or failure load nothing and return
        the blocks vLLM must recompute. Runs in vLLM's worker: never raises."""
        t0 = time.monotonic()
        bs = self.kv.layout.block_size
        try:
            nbytes = self._load(op)
        except Exception as e:  # noqa: BLE001 - a tier's bad data must cost a recompute, not the worker
            self.counters["load_errors"] += 1
            self._lost.setdefault("cpu", set()).update(k for k, p in zip(op.keys, op.promote, strict=True) if p)
            logger.warning("request %s: loading its cached KV failed (%s: %s); recomputing its prompt from token %d",
                           op.req_id, type(e).__name__, e, op.skip_tokens)
            return loaded_blocks(op.block_ids, op.skip_tokens, op.num_tokens, bs)
        if nbytes is None:
            return loaded_blocks(op.block_ids, op.skip_tokens, op.num_tokens, bs)
        dt = time.monotonic() - t0
        n = op.num_tokens - op.skip_tokens
        self.counters["retrieved_tokens"] += n
        self.counters["retrieved_bytes"] += nbytes
        where = ", ".join(f"{op.tiers.count(t)} from {t}" for t in ("cpu", "disk", "p2p", "remote") if t in op.tiers)
        logger.info("Retrieved %d out of %d required tokens (from %d total tokens). size: %s, cost %.4f ms, "
                    "throughput: %.4f GB/s; chunks: %s", n, n, op.total_tokens, fmt_bytes(nbytes), dt * 1e3,
                    nbytes / max(dt, 1e-9) / 1e9, where)
        return []

    def _load(self, op: CacheLoad) -> int | None:
        """The op's chunks, each checked for its size, scattered into its blocks: bytes copied, or
        None on a miss (counted, and the chunks reported lost)."""
        datas = []
        from_peer = self._fetch_p2p(op)
        for key, tier, promote, n in zip(op.keys, op.tiers, op.promote, op.tokens, strict=True):
            want = self.kv.chunk_nbytes("block", n)
            if tier == "p2p":
                data = from_peer.get(key)
            elif tier == "remote":
                data = self.remote.get(key, n, want) if self.remote else None
            elif tier == "disk":
                data = self.disk.get(key, want) if self.disk else None
            else:
                store = self._tier(tier)
                data = store.get(key) if store is not None else None
            bad = data is not None and (data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != want)
            if data is None or bad:
                self._lost.setdefault(tier, set()).add(key)
                # The index counted the rest as promoted to the CPU tier: they are not there.
                j = op.keys.index(key)
                self._lost.setdefault("cpu", set()).update(k for k, p in zip(op.keys[j:], op.promote[j:], strict=True)
                                                           if p)
                self.counters["load_errors"] += 1
                if bad:  # e.g. a chunk a move brought in from a peer of another build
                    if tier == "cpu" and self.cpu is not None:
                        self.cpu.delete(key)
                    logger.warning("request %s: chunk %s from the %s tier is %d bytes (%s), not %d; recomputing its "
                                   "prompt from token %d", op.req_id, key.hex()[:12], tier, data.numel(), data.dtype,
                                   want, op.skip_tokens)
                else:
                    logger.warning("request %s: chunk %s missing from the %s tier; recomputing its prompt from "
                                   "token %d", op.req_id, key.hex()[:12], tier, op.skip_tokens)
                return None
            if promote and self.cpu is not None:
                self.cpu.put(key, data)
            datas.append(self._host_to_device(data))
        return scatter_chunks(self.kv, "block", self.chunk_size, datas, op.tokens, op.first_chunk, op.block_ids,
                              op.skip_tokens, op.num_tokens)

    def _fetch_p2p(self, op: CacheLoad) -> dict[bytes, torch.Tensor]:
        """The op's P2P chunks, in one lease and one NIXL READ; {} on failure (then recompute)."""
        idx = [i for i, t in enumerate(op.tiers) if t == "p2p"]
        if not idx or self.p2p is None or self.p2p.rank >= len(op.peers):
            return {}
        keys = [op.keys[i] for i in idx]
        got = self.p2p.fetch(op.peer_id, op.peers[self.p2p.rank], keys,
                             [self.kv.chunk_nbytes("block", op.tokens[i]) for i in idx])
        return dict(zip(keys, got, strict=True)) if got is not None else {}

    def save(self, ops: Sequence[CacheStore | CacheEvict]) -> None:
        """Evictions and stores in the order the planner made them."""
        for op in ops:
            if isinstance(op, CacheEvict):
                store = self._tier(op.tier)
                if store is not None:
                    store.delete(op.key)
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
            for tier in dest:
                if tier == "cpu" and self.cpu is not None:
                    self.cpu.put(key, data)
                elif tier == "disk" and self.disk is not None:
                    self.disk.put(key, data)
                elif tier == "remote" and self.remote is not None:
                    self.remote.put(key, data, n)
        dt = time.monotonic() - t0
        n = sum(op.tokens)
        self.counters["offloaded_tokens"] += n
        self.counters["offloaded_bytes"] += nbytes
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
        if self.disk is not None:
            more = self.disk.take_lost()
            if more:
                lost.setdefault("disk", set()).update(more)
        return lost

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.counters)
        if self.disk is not None:
            for name, v in self.disk.counters.items():
                out[f"disk_{name}"] = v
        if self.remote is not None:
            out.update(self.remote.stats())
        if self.p2p is not None:
            out.update(self.p2p.stats())
        return out

    def close(self) -> None:
        if self.p2p is not None:
            self.p2p.close()
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            self.disk.close()
        if self.cpu is not None:
            self.cpu.close()


def layout_digest(fp_bytes: bytes) -> bytes:
    """16 bytes naming a worker's KV layout (written into and checked against every disk file)."""
    return xxhash.xxh3_128_digest(fp_bytes)
