"""Cache-aware routing: which prefiller computes a prompt soonest, given what each instance holds
(its KV events) and its queue, and whether the decoder should prefill the prompt itself
(conditional disaggregation). docs/proxy.md "Routing" says how and why."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.common import zsock
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing.holders import Holders
from kvferry.proxy.routing.instances import Instance, RolePool
from kvferry.proxy.routing.kv_event_subscription import KVEventSubscription
from kvferry.proxy.routing.prefix_index import CPU, DISK, GPU, ROOT, PrefixIndex, prefix_keys

# What loading a token from kvferry's CPU or disk tier costs, as a fraction of computing it
# (docs/proxy.md "Routing": cheaper than computing, not free).
LOAD_COST = {GPU: 0.0, CPU: 0.1, DISK: 0.25}

# Up to this many usable instances of a role, a route weighs every one of them. Above it, a route
# weighs up to HOLDERS of them holding the longest runs of the prompt's blocks (Holders) and SAMPLE
# others drawn at random ("power of d choices" on load): its cost stays flat as the cluster grows.
SCAN_ALL_UP_TO = 32
HOLDERS = 4
SAMPLE = 4


def effective(held: dict[str, int] | None) -> int:
    """Cached tokens as the cost model counts them: a tier's copy is worth less than the GPU's."""
    return 0 if held is None else round(sum(n * (1.0 - LOAD_COST[m]) for m, n in held.items()))


NO_PREFILLER = "no_prefiller"  # no usable prefiller: the decoder serves the request whole (degraded)


@dataclass
class Route:
    """Where one prompt goes. prefiller None: the decoder serves it alone (no prefill leg, no transfer)."""

    decoder: Instance
    prefiller: Instance | None
    reason: str
    predicted: int = 0  # cached prompt tokens predicted on the instance that computes the prompt

    @property
    def local(self) -> bool:
        return self.prefiller is None


def served_mode(r: Route) -> str:
    """The kvferry_proxy_served label of a multi-token request routed so."""
    return "degraded" if r.reason == NO_PREFILLER else "local" if r.local else "disaggregated"


class CacheView:
    """Each instance's event stream and prefix index, and the cost of a prompt on each."""

    def __init__(self, opts: ProxyOptions, metrics: ProxyMetrics) -> None:
        self.opts, self.metrics = opts, metrics
        self.streams: dict[str, KVEventSubscription] = {}  # instance id -> its stream
        self.trust = zsock.PLAIN  # the proxy's cluster secret: tcp:// event endpoints are kvferry relays
        self.holders = Holders()  # block -> the instances holding it, kept by the indexes `add` makes
        self.adapters: set[str] = set()  # LoRA adapter names the indexes saw in events

    def add(self, inst: Instance) -> KVEventSubscription | None:
        ev = self.opts.kv_events.get(inst.url)
        if ev is None:
            return None
        counter = self.metrics.kv_events

        def count(result: str, n: int = 1, inst: Instance = inst) -> None:
            if not inst.removed:  # its series left with it
                counter.labels(inst.id, result).inc(n)
        index = PrefixIndex(self.opts.prefix_index_max_blocks, self.adapters)
        index.attach(self.holders, inst.id)
        stream = KVEventSubscription(f"{inst.role} {inst.url}", ev[0], ev[1], index,
                                     self.opts.kv_events_stale_after, count, self.trust)
        self.streams[inst.id] = stream
        return stream

    def remove(self, inst: Instance) -> KVEventSubscription | None:
        s = self.streams.pop(inst.id, None)
        if s is not None:
            s.index.detach()
        return s

    def forget(self, inst: Instance) -> None:
        """The instance went down: whatever it held is gone."""
        s = self.streams.get(inst.id)
        if s is not None:
            s.index.clear()

    def cached(self, inst: Instance, keys: PromptKeys) -> dict[str, int] | None:
        """Predicted cached prompt tokens on `inst` by medium; None when it cannot be known (no
        stream, or a stale one: then the instance is routed by load)."""
        s = self.streams.get(inst.id)
        if s is None or keys.tokens is None or not s.check_fresh():
            return None
        bs = s.index.block_size
        if bs is None:
            return {}
        return s.index.cached(keys.of(bs))

    def candidates(self, pool: Sequence[Instance], keys: PromptKeys) -> Sequence[Instance]:
        """The instances of `pool` a route weighs: all of a small pool; of a large one, HOLDERS
        holding the most of the prompt and SAMPLE others."""
        if len(pool) <= SCAN_ALL_UP_TO:
            return pool
        by_id = pool.by_id if isinstance(pool, RolePool) else {i.id: i for i in pool}
        out: dict[str, Instance] = {}
        if keys.tokens is not None:
            for bs in self.holders.block_sizes():
                for owner in self.holders.deepest(keys.of(bs), HOLDERS - len(out), by_id):
                    out[owner] = by_id[owner]
        for inst in random.sample(pool, SAMPLE):
            out.setdefault(inst.id, inst)
        return list(out.values())

    def describe(self, inst: Instance) -> dict | None:
        s = self.streams.get(inst.id)
        return None if s is None else s.describe()


class PromptKeys:
    """One prompt's block keys for each block size, chained from its identity's root
    (routing/prefix_index.py) and made once per route. `tokens` None: not predictable."""

    def __init__(self, tokens: Sequence[int] | None, root: bytes = ROOT) -> None:
        self.tokens, self.root = tokens, root
        self._by_size: dict[int, list[bytes]] = {}

    def of(self, bs: int) -> list[bytes]:
        assert self.tokens is not None  # asked only for a predictable prompt
        out = self._by_size.get(bs)
        if out is None:
            # A full-prompt hit still computes one token: only blocks before the last token count.
            out = self._by_size[bs] = prefix_keys(self.tokens, bs, max(0, len(self.tokens) - 1) // bs, self.root)
        return out


def choose(view: CacheView, opts: ProxyOptions, decoders: Sequence[Instance], prefillers: Sequence[Instance],
           tokens: Sequence[int] | None, ntok: int, root: bytes = ROOT) -> Route:
    """The cache-aware choice among usable instances (`decoders` non-empty; no prefillers: the
    decoder serves the prompt alone); above SCAN_ALL_UP_TO of a role, among its candidates."""
    keys = PromptKeys(tokens, root)
    decoders = view.candidates(decoders, keys)
    prefillers = view.candidates(prefillers, keys) if prefillers else prefillers
    # Decoders by active sequences, then free KV (vLLM's cache usage, in tenths), then queued
    # tokens; among equals, the one holding more of the prompt (only those equals' indexes are walked).
    if len(decoders) == 1:
        tied = decoders
    else:
        rank = [(i.load, round(i.kv_usage or 0.0, 1), i.all_queued) for i in decoders]
        low = min(rank)
        tied = [i for i, r in zip(decoders, rank, strict=True) if r == low]
    held = {i.id: view.cached(i, keys) for i in tied}
    dc = {i: None if h is None else effective(h) for i, h in held.items()}
    d = tied[0] if len(tied) == 1 else min(tied, key=lambda i: (-(dc[i.id] or 0), random.random()))
    local = local_reason(opts, d, dc[d.id], tokens, ntok)
    if local or not prefillers:
        return Route(d, None, local or NO_PREFILLER, sum((held[d.id] or {}).values()))
    best, best_cost, best_cached, reasons = None, 0.0, 0, set()
    for p in prefillers:
        h = view.cached(p, keys)
        reasons.add("no_tokens" if tokens is None else "stale_events" if h is None and p.id in view.streams
                    else "no_events" if h is None else "")
        cost = max(0, ntok - effective(h)) + p.all_queued + opts.load_tokens_per_request * p.load
        if best is None or cost < best_cost or (cost == best_cost and random.random() < 0.5):
            best, best_cost, best_cached = p, cost, sum((h or {}).values())
    why = next((r for r in ("no_tokens", "stale_events", "no_events") if r in reasons), "cache_miss")
    reason = "cache_hit" if best_cached > 0 else why
    return Route(d, best, reason, best_cached)


def local_reason(opts: ProxyOptions, d: Instance, cached: int | None, tokens: Sequence[int] | None,
                 ntok: int) -> str | None:
    """Why the decoder should prefill this prompt itself, or None: the part it would compute is
    short (--local-prefill-tokens), or it holds nearly all of it (--local-prefill-fraction)."""
    if tokens is None or ntok <= 0:
        return None
    uncached = ntok - (cached or 0)
    if opts.local_prefill_tokens > 0 and uncached <= opts.local_prefill_tokens:
        return "local_short"
    if cached and opts.local_prefill_fraction <= 1 and cached >= opts.local_prefill_fraction * ntok:
        return "local_cached"
    return None
