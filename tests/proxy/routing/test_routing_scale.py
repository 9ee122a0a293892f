"""Routing that does not grow with the cluster: the holders (block -> instances holding it) stay in
step with every instance's prefix index through stores, removals, clears, eviction and removal of
the instance; usable pools are rebuilt only when membership, health or drain changes; a large pool
weighs the holders of a prompt's deepest blocks and a few others, a small one every instance."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from kvferry.proxy.instance_flags import InstanceSpec
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing import cache
from kvferry.proxy.routing.cache import CacheView, choose
from kvferry.proxy.routing.holders import Holders
from kvferry.proxy.routing.instances import Instance, Registry
from kvferry.proxy.routing.prefix_index import CPU, GPU, PrefixIndex, prefix_keys

BS = 4


def chain(doc: int, blocks: int) -> list[int]:
    """The tokens of document `doc`'s first `blocks` blocks (documents share their first block)."""
    return [0, 1, 2, 3] + [doc * 1000 + t for t in range((blocks - 1) * BS)]


def owners_of(indexes: dict[str, PrefixIndex], key: bytes) -> set[str]:
    return {o for o, idx in indexes.items() if key in idx}


def test_holders_agree_with_every_index_on_random_event_streams() -> None:
    rng = random.Random(7)
    holders = Holders()
    indexes = {f"p{i}": PrefixIndex(max_blocks=25) for i in range(3)}
    for o, idx in indexes.items():
        idx.attach(holders, o)
    universe = {k for d in range(6) for k in prefix_keys(chain(d, 8), BS)}
    hashes: dict[str, list[int]] = {o: [] for o in indexes}
    for step in range(600):
        o = rng.choice(list(indexes))
        idx, op = indexes[o], rng.random()
        if op < 0.6:
            d, n = rng.randrange(6), rng.randint(1, 8)
            first = step * 100
            idx.stored(None, list(range(first, first + n)), chain(d, n), BS, rng.choice([GPU, CPU]))
            hashes[o] += range(first, first + n)
        elif op < 0.85 and hashes[o]:
            idx.removed(rng.sample(hashes[o], min(3, len(hashes[o]))), rng.choice([GPU, CPU]))
        elif op < 0.95:
            idx.clear(GPU)
        else:
            idx.clear()
        for k in universe:
            assert set(holders.of(k)) == owners_of(indexes, k), f"step {step}"
    for d in range(6):  # every instance with a cached prefix is found, and none without a held block
        keys = prefix_keys(chain(d, 8), BS)
        found = set(holders.deepest(keys, 99, indexes))
        assert {o for o, idx in indexes.items() if idx.cached_tokens(keys)} <= found
        assert found <= {o for k in keys for o in owners_of(indexes, k)}
    assert set(holders.deepest(keys, 99, {"p1"})) <= {"p1"}  # one role's: the others are not counted


def test_eviction_keeps_holders_in_step_with_the_bounded_index() -> None:
    holders = Holders()
    idx = PrefixIndex(max_blocks=3)
    idx.attach(holders, "p0")
    keys = prefix_keys(chain(1, 5), BS)
    idx.stored(None, [1, 2, 3, 4, 5], chain(1, 5), BS)
    assert len(idx) == 3 and len(holders) == 3
    assert [bool(holders.of(k)) for k in keys] == [False, False, True, True, True]
    assert holders.deepest(keys, 8, {"p0"}) == []  # the prompt's first block is gone: no holder walks it


def test_a_detached_index_leaves_nothing_in_the_holders() -> None:
    holders = Holders()
    a, b = PrefixIndex(100), PrefixIndex(100)
    a.attach(holders, "p0")
    b.attach(holders, "p1")
    for idx in (a, b):
        idx.stored(None, [1, 2], chain(1, 2), BS)
    a.detach()
    a.stored(None, [3], chain(2, 1), BS)  # after it left: not told
    assert all(holders.of(k) == ("p1",) for k in prefix_keys(chain(1, 2), BS))
    assert holders.block_sizes() == [BS]
    b.detach()
    assert len(holders) == 0 and holders.block_sizes() == []


@pytest.fixture
def view() -> Iterator[CacheView]:
    opts = ProxyOptions()
    v = CacheView(opts, ProxyMetrics())
    yield v
    for s in v.streams.values():
        s.close()


def cluster(view: CacheView, prefillers: int, decoders: int) -> tuple[list[Instance], list[Instance]]:
    """Instances with fresh event streams on `view`."""
    out: dict[str, list[Instance]] = {"prefiller": [], "decoder": []}
    for role, n in (("prefiller", prefillers), ("decoder", decoders)):
        for i in range(n):
            inst = Instance(InstanceSpec(role, f"http://{role}{i}:8000"), f"{role[0]}{i}")
            view.opts.kv_events[inst.url] = ("ipc:///nonexistent", None)
            view.add(inst)
            view.streams[inst.id].last_heard = time.monotonic()
            out[role].append(inst)
    return out["prefiller"], out["decoder"]


def test_removing_an_instance_removes_its_holdings(view: CacheView) -> None:
    (p0, p1), _ = cluster(view, 2, 0)
    for p in (p0, p1):
        view.streams[p.id].index.stored(None, [1, 2], chain(1, 2), BS)
    keys = prefix_keys(chain(1, 2), BS)
    assert set(view.holders.of(keys[0])) == {"p0", "p1"}
    view.remove(p0)
    assert all(view.holders.of(k) == ("p1",) for k in keys)


def test_a_large_pool_sends_a_prompt_to_the_one_prefiller_holding_it_and_weighs_few(view: CacheView) -> None:
    prefillers, decoders = cluster(view, 200, 200)
    view.opts.local_prefill_fraction = 1.1  # off: the decoders holding it would serve it alone
    doc = chain(5, 10)
    for p in prefillers:  # every prefiller holds the shared first block ...
        view.streams[p.id].index.stored(None, [1], doc[:BS], BS)
    holder = prefillers[137]  # ... one holds the whole document, as do more decoders than are weighed
    for inst in [holder, *decoders[:3 * cache.HOLDERS]]:
        view.streams[inst.id].index.stored(None, list(range(1, 11)), doc, BS)
    walked = []
    cached = view.cached

    def counting(inst: Instance, *a: object) -> dict[str, int] | None:
        walked.append(inst)
        return cached(inst, *a)  # type: ignore[arg-type]
    view.cached = counting  # type: ignore[method-assign]
    prompt = doc + [9, 9]
    for _ in range(20):
        walked.clear()
        r = choose(view, view.opts, decoders, prefillers, prompt, len(prompt))
        assert (r.prefiller, r.reason, r.predicted) == (holder, "cache_hit", 10 * BS)
        assert len(walked) <= 2 * (cache.HOLDERS + cache.SAMPLE)


def test_a_pool_up_to_the_scan_size_is_weighed_whole(view: CacheView) -> None:
    prefillers, decoders = cluster(view, 1, cache.SCAN_ALL_UP_TO)
    for d in decoders:
        d.active = 3
    idle = decoders[-1]
    idle.active = 0
    for _ in range(20):
        assert choose(view, view.opts, decoders, prefillers, chain(1, 3), 3 * BS).decoder is idle


def test_the_usable_pool_is_kept_until_membership_health_or_drain_changes() -> None:
    reg = Registry(policy="cache")
    a = reg.add(InstanceSpec("prefiller", "http://a:8000"))
    b = reg.add(InstanceSpec("prefiller", "http://b:8000"))
    pool = reg.usable("prefiller")
    assert list(pool) == [a, b] and reg.usable("prefiller") is pool and pool.by_id == {a.id: a, b.id: b}
    a.draining = True
    assert list(reg.usable("prefiller")) == [b]
    a.draining = False
    b.eject()
    assert list(reg.usable("prefiller")) == [a] and not reg.usable("decoder")
    b.ok()
    c = reg.add(InstanceSpec("prefiller", "http://c:8000"))
    assert list(reg.usable("prefiller")) == [a, b, c]
    reg.remove(a.id)
    assert list(reg.usable("prefiller")) == [b, c]
    a.draining = True  # a removed instance no longer touches the pools
    assert list(reg.usable("prefiller")) == [b, c]
