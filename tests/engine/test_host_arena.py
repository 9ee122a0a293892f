"""HostArena and the CPU tier on it: slots come back only when no tensor views them any more."""

from __future__ import annotations

import gc

import torch

from kvferry.engine.tiers.cpu import CPUTier
from kvferry.engine.tiers.host_arena import HostArena
from tests.polling import until

SLOT = 64 << 10


def test_slots_are_distinct_and_inside_the_arena() -> None:
    a = HostArena(4 * SLOT, SLOT)
    try:
        ts = [a.alloc(SLOT) for _ in range(3)] + [a.alloc(100)]
        assert all(t is not None and a.holds(t) for t in ts)
        assert sorted((t.data_ptr() - a.base) // SLOT for t in ts) == [0, 1, 2, 3]
        assert ts[-1].numel() == 100 and ts[0].numel() == SLOT
        for i, t in enumerate(ts):
            t.fill_(i + 1)
        assert [int(t[0]) for t in ts] == [1, 2, 3, 4]  # no two chunks share memory
        assert a.alloc(1) is None  # every slot in use
        assert a.alloc(SLOT + 1) is None  # bigger than a slot
        assert a.alloc(0) is None
        assert not a.holds(torch.empty(10, dtype=torch.uint8))
    finally:
        a.close()


def test_a_slot_is_reused_only_after_its_last_view_is_gone() -> None:
    a = HostArena(2 * SLOT, SLOT)
    try:
        t, other = a.alloc(SLOT), a.alloc(SLOT)
        t.fill_(7)
        view = t[:1024].view(torch.int32)  # e.g. a load's reshaped view, or a peer's lease
        del t
        gc.collect()
        assert a.alloc(SLOT) is None, "a slot came back while a view of it was alive"
        assert int(view[0]) == 0x07070707
        del view
        gc.collect()
        t2 = a.alloc(SLOT)
        assert t2 is not None and a.holds(t2) and t2.data_ptr() != other.data_ptr()
    finally:
        a.close()


def test_free_slots_are_touched_ahead() -> None:
    a = HostArena(16 * SLOT, SLOT, warm_bytes=2 * SLOT)
    try:
        until(lambda: len(a._warm) == 2, what="the warm thread to touch slots ahead")
        assert a.free_slots == 16
        t = a.alloc(SLOT)
        assert a.free_slots == 15
        until(lambda: len(a._warm) == 2, what="the warm thread to refill")
        del t
        until(lambda: a.free_slots == 16, what="the freed slot")
    finally:
        a.close()


def test_cpu_tier_falls_back_when_the_arena_is_full() -> None:
    tier = CPUTier(capacity=2 * SLOT, slot_bytes=SLOT)
    try:
        assert tier.arena is not None
        keep = [tier.alloc(SLOT) for _ in range(3)]
        assert [tier.arena.holds(t) for t in keep] == [True, True, False]
        for i, t in enumerate(keep):
            tier.put(bytes([i]), t)
        assert tier.used == 3 * SLOT
        del keep
        tier.clear()
        until(lambda: tier.arena.free_slots == 2, what="clearing the tier to free its slots")
    finally:
        tier.close()


def test_no_arena_for_pinned_or_tiny_tiers() -> None:
    assert CPUTier(pin=True, capacity=4 * SLOT, slot_bytes=SLOT).arena is None  # GPU KV: pinned chunks
    assert CPUTier(capacity=SLOT - 1, slot_bytes=SLOT).arena is None
    assert CPUTier(capacity=4 * SLOT).arena is None
    t = CPUTier(capacity=SLOT - 1, slot_bytes=SLOT).alloc(SLOT)
    assert t.numel() == SLOT
