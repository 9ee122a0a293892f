"""Scheduler side of offload: keys each prompt's chunks, finds the longest cached prefix, and
decides every load, store, promotion and eviction on its :class:`ChunkIndex`.

Tiers in lookup order: the indexed ones (cpu, disk: this process knows what they hold), then the
shared ones it asks (p2p, remote: engine/offload/shared_tiers.py). Its decisions go to the copier
(engine/offload/copier.py) in the order they were made. It does not know vLLM: the connector maps
requests and blocks onto these calls, and the standalone engine (launcher/standalone.py) uses the
same planner without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvferry.common import zsock
from kvferry.common.config import ConfigError, KVFerryConfig
from kvferry.common.hashing import chunk_keys
from kvferry.common.log import get_logger
from kvferry.common.units import fmt_bytes
from kvferry.engine.chunking import chunk_tokens
from kvferry.engine.offload.index import ChunkIndex, TierIndex
from kvferry.engine.offload.ops import GB, PLAIN, CacheEvict, CacheLoad, CacheStore, PromptIdentity
from kvferry.engine.offload.shared_tiers import Lookup, PeerLookup, RemoteLookup, SharedTier
from kvferry.engine.offload.tier_events import TierEvent, TierEventLog
from kvferry.engine.p2p.lookup import ControllerLookup
from kvferry.engine.p2p.notices import PlannerNotices
from kvferry.engine.remote import mooncake_settings, redis_settings
from kvferry.engine.remote import serde as remote_serde
from kvferry.engine.remote.backends import parse_url
from kvferry.engine.tiers import disk as disk_tier
from kvferry.engine.tiers import nixl_storage
from kvferry.engine.tiers.remote import RemoteTier

logger = get_logger(__name__)


class OffloadPlanner:
    """Scheduler side: the index and every decision about it."""

    def __init__(self, cfg: KVFerryConfig, salt: bytes, block_size: int, block_bytes: int,
                 notice_addr: str | None = None, tier_events: bool = False) -> None:
        if cfg.chunk_size % block_size:
            raise ConfigError(f"chunk_size {cfg.chunk_size} is not a multiple of vLLM's block_size {block_size}: "
                             f"set chunk_size to a multiple of {block_size} (e.g. 256), or vLLM's --block-size "
                             f"to a divisor of {cfg.chunk_size}")
        # NIXL POSIX storage is the disk tier in nixl_path (other NIXL back-ends: refused here).
        cfg = nixl_storage.effective(cfg, block_bytes * (cfg.chunk_size // block_size))
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
            disk.counters.stored_chunks = disk.counters.stored_bytes = 0
            if found:
                logger.info("disk tier %s: %d chunks (%s) from earlier runs", disk_tier.disk_path(cfg.local_disk),
                            len(disk), fmt_bytes(disk.used))
            tiers.append(disk)
        self.index = ChunkIndex(tiers)
        # What the cpu and disk tiers take in and let go of, for the connector's KV events
        # (after the disk scan: chunks found on disk have no tokens to announce).
        self.events: TierEventLog | None = TierEventLog() if tier_events else None
        for t in tiers:
            t.events = self.events
        # The shared tiers are asked rather than indexed here; the scheduler waits on their
        # answers, hence the short limit.
        ask_timeout = min(1.0, cfg.blocking_timeout_secs)
        self.shared: list[SharedTier] = []
        if cfg.remote_url:  # refused before anything binds
            parse_url(cfg.remote_url)
            remote_serde.check_name(cfg.remote_serde)
        # P2P: the controller says which instance holds a prefix; the worker's notices say what a
        # controller's move put into or took out of this instance's CPU tier.
        self.notices: PlannerNotices | None = None
        if cfg.enable_p2p:
            controller = ControllerLookup(cfg, ask_timeout)
            self.shared.append(PeerLookup(controller, cfg.lmcache_instance_id))
            if notice_addr:
                self.notices = PlannerNotices(notice_addr, controller.trust)
        if cfg.remote_url:
            self.shared.append(RemoteLookup(RemoteTier(cfg.remote_url, ask_timeout, secret=zsock.trust_of(cfg).secret,
                                                       redis=redis_settings.from_config(cfg),
                                                       mooncake=mooncake_settings.from_config(cfg))))
        self._lookups: dict[str, Lookup] = {}
        self._loads: list[CacheLoad] = []

    @property
    def enabled(self) -> bool:
        return bool(self.index.tiers) or any(t.name == "remote" for t in self.shared)

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

    def keys(self, tokens: Sequence[int], identity: PromptIdentity = PLAIN) -> list[bytes]:
        return chunk_keys(tokens, self.chunk_size, self.salt, include_partial=self.cfg.save_unfull_chunk,
                          extras=identity.extras)

    def match(self, req_id: str, tokens: Sequence[int], num_computed: int, leave_one: bool = True,
              identity: PromptIdentity = PLAIN) -> int:
        """Tokens past `num_computed` that a tier holds (vLLM computes at least the last one)."""
        look = self._lookups.get(req_id)
        if look is None:
            look = self._lookups[req_id] = Lookup(self.keys(tokens, identity), identity)
        self._apply_notices()
        look.where = self.index.prefix(look.keys)
        look.local = num_computed
        for t in self.shared:
            if len(look.where) < len(look.keys):
                t.extend(look)
        hit = min(len(look.where) * self.chunk_size, len(tokens))
        return max(0, min(hit, len(tokens) - leave_one) - num_computed)

    def unkeyable(self) -> None:
        """Count a prompt the connector could not key (it is neither looked up nor stored)."""
        self.index.counters.unkeyable_requests += 1

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
        shared = {t.name: t for t in self.shared}
        for t in self.shared:
            t.plan_load(op, look)
        cpu = self.index.by_name.get("cpu")
        for i, (key, tier) in enumerate(zip(op.keys, op.tiers, strict=True)):
            local = self.index.by_name.get(tier)
            if local is not None:
                local.touch(key)
            counters = local.counters if local is not None else shared[tier].counters
            n = min(end, (c0 + i + 1) * self.chunk_size) - max(num_computed, (c0 + i) * self.chunk_size)
            counters.hit_chunks += 1
            counters.hit_tokens += n
            look.sources[tier] = look.sources.get(tier, 0) + n
            promote = False
            if tier != "cpu" and cpu is not None:
                promote, victims = cpu.admit(key, self.nbytes("cpu", op.tokens[i]))
                if promote:
                    self._stored("cpu", look.keys, c0 + i, tokens, look.identity)
                self._save_ops += [CacheEvict("cpu", v) for v in victims]
            op.promote.append(promote)
        self._loads.append(op)

    def _stored(self, tier: str, keys: Sequence[bytes], i: int, tokens: Sequence[int],
                identity: PromptIdentity) -> None:
        """Log chunk i of a prompt as stored in `tier`; a partial last chunk is not announced
        (a router matches whole chunks)."""
        if self.events is None or (i + 1) * self.chunk_size > len(tokens):
            return
        self.events.stored(tier, keys[i], keys[i - 1] if i else None,
                           tokens[i * self.chunk_size:(i + 1) * self.chunk_size], identity.lora_name,
                           identity.event_keys_of(i))

    def take_events(self) -> list[TierEvent]:
        """The tier events since the last call (empty when not asked for)."""
        return self.events.take() if self.events is not None else []

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """Tokens of the load `after_alloc` planned, by the tier that supplies them."""
        look = self._lookups.get(req_id)
        return dict(look.sources) if look is not None else {}

    def store(self, req_id: str, tokens: Sequence[int], block_ids: Sequence[int],
              identity: PromptIdentity = PLAIN) -> None:
        """The prompt's KV is complete in `block_ids` after this step: store what no tier has."""
        look = self._lookups.get(req_id)
        if look is not None:
            keys, identity = look.keys, look.identity
        else:
            keys = self.keys(tokens, identity)
        sizes = chunk_tokens(len(tokens), self.chunk_size)
        op = CacheStore(req_id, [], [], [], [], list(block_ids), len(tokens))
        pos: dict[bytes, int] = {}
        evicts: list[CacheEvict] = []
        for i, key in enumerate(keys):
            dest: list[str] = []
            indexed = self.index.locate(key) is not None
            dest += [t.name for t in self.shared if t.wants(look, i, indexed)]
            for t in self.index.tiers:
                if key in t:
                    t.touch(key)
                    continue
                ok, victims = t.admit(key, self.nbytes(t.name, sizes[i]))
                if ok:
                    self._stored(t.name, keys, i, tokens, identity)
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
        op.chunks = [op.chunks[j] for j in keep]
        op.keys = [op.keys[j] for j in keep]
        op.tiers = [op.tiers[j] for j in keep]
        op.tokens = [op.tokens[j] for j in keep]
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
            for t in self.shared:
                if t.name == tier:
                    for look in self._lookups.values():
                        t.forget(look, keys)

    def stats(self) -> dict[str, float]:
        """Counters (cumulative) and usage, flat: ``name`` or ``name|tier``."""
        out: dict[str, float] = self.index.counters.as_dict()
        for t in self.index.tiers:
            for name, v in t.counters.as_dict().items():
                out[f"{name}|{t.name}"] = v
            out[f"usage_bytes|{t.name}"] = t.used
            out[f"chunks|{t.name}"] = len(t)
        for s in reversed(self.shared):  # remote, then p2p: the order they were reported in
            out.update(s.stats())
        return out

    def close(self) -> None:
        for t in reversed(self.shared):
            t.close()
        if self.notices is not None:
            self.notices.close()
