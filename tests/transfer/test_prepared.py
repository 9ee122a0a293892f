"""sender/prepared.py: a write's descriptors built ahead (KVSender.prepare) are exactly the ones the
write would build, and a write whose arguments differ in anything (chunks, pages, first page, run
arrays, a run array changed in place) builds its own instead of posting a stale preparation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvferry.common import messages as m
from kvferry.sender.addr import ReceiverAddr
from kvferry.sender.descs import write_descs
from kvferry.sender.errors import ChunkError
from kvferry.sender.grants import Grant
from kvferry.sender.prepared import checked_descs, prepare

REGION = m.Region(addr=1 << 40, page_bytes=1 << 16, num_pages=32, device_id=3)
SIZE = 1 << 15
RANGES = [(0x10000, 0x10000 + 16 * SIZE)]


class FakeAgent:
    """get_xfer_descs as NIXL's, minus NIXL: a copy of the descriptors, tagged with the memory type."""

    def get_xfer_descs(self, descs, mem_type):
        return ("dlist", np.array(descs, dtype=np.int64).reshape(-1, 3), mem_type)


def grant(pages: list[int]) -> Grant:
    peer = SimpleNamespace(welcome=SimpleNamespace(region=REGION, peer_id="d0"))
    return Grant("t1", ReceiverAddr("127.0.0.1", 1, 2), peer, 7, pages, 1e18, 0.0, {}, False)  # type: ignore[arg-type]


def chunks(n: int, first: int = 0) -> list[tuple[int, int]]:
    return [(0x10000 + (first + i) * SIZE, SIZE) for i in range(n)]


def runs_of(n: int) -> list[np.ndarray]:
    one = np.array([[0, 64, 128], [4096, 8192, 256], [SIZE - 64, 0, 64]], dtype=np.int64)
    last = np.array([[0, 0, 32]], dtype=np.int64)
    return [one] * (n - 1) + [last]


def same(got, want) -> bool:
    return all(np.array_equal(np.asarray(g).reshape(-1, 3), np.asarray(w).reshape(-1, 3))
               for g, w in zip(got[:2], want[:2], strict=True)) and got[2:] == want[2:]


@pytest.mark.parametrize("sliced", [True, False])
def test_a_prepared_write_posts_exactly_what_a_fresh_one_builds(sliced: bool) -> None:
    g = grant([5, 1, 9, 2, 30, 0])
    cs, rs = chunks(4), runs_of(4) if sliced else None
    g.prepared = prepare(FakeAgent(), g, cs, 2, rs, RANGES, 2, "DRAM")
    assert g.prepared is not None
    fresh = write_descs(cs, [9, 2, 30, 0], REGION, 2, rs)
    local, remote, nbytes, widest = checked_descs(g, list(cs), 2, None if rs is None else list(rs), RANGES, 2)
    assert local is g.prepared.local and remote is g.prepared.remote, "the preparation was not used"
    assert local[2] == "DRAM" and remote[2] == REGION.mem_type
    assert same((local[1], remote[1], nbytes, widest), fresh)


def test_a_write_that_differs_from_its_preparation_builds_its_own() -> None:
    g = grant([5, 1, 9, 2, 30, 0])
    cs, rs = chunks(4), runs_of(4)
    prep = g.prepared = prepare(FakeAgent(), g, cs, 0, rs, RANGES, 2, "DRAM")
    assert prep is not None

    def fresh_ok(c, first, r, pages) -> None:
        got = checked_descs(g, c, first, r, RANGES, 2)
        assert got[0] is not prep.local, "a stale preparation was posted"
        assert same(got, write_descs(c, pages, REGION, 2, r))

    fresh_ok(chunks(4, 1), 0, rs, [5, 1, 9, 2])  # other chunks
    fresh_ok(cs[:3], 0, rs[:3], [5, 1, 9])  # fewer chunks
    fresh_ok(cs, 1, rs, [1, 9, 2, 30])  # another first page
    fresh_ok(cs, 0, [r.copy() for r in rs], [5, 1, 9, 2])  # equal runs, other arrays
    fresh_ok(cs, 0, None, [5, 1, 9, 2])  # whole chunks
    g.pages = [3, 4, 6, 7, 8, 10]  # the grant's pages changed
    fresh_ok(cs, 0, rs, [3, 4, 6, 7])
    g.pages = [5, 1, 9, 2, 30, 0]
    assert checked_descs(g, cs, 0, rs, RANGES, 2)[0] is prep.local
    rs[0][1, 1] += 64  # a run array changed in place after the preparation
    fresh_ok(cs, 0, rs, [5, 1, 9, 2])

    g2 = grant([5, 1, 9, 2])
    g2.prepared = prepare(FakeAgent(), g2, cs, 0, None, RANGES, 2, "DRAM")
    fresh_ok2 = checked_descs(g2, cs, 0, runs_of(4), RANGES, 2)  # prepared whole, written sliced
    assert fresh_ok2[0] is not g2.prepared.local
    assert same(fresh_ok2, write_descs(cs, [5, 1, 9, 2], REGION, 2, runs_of(4)))


def test_prepare_refuses_what_the_write_would() -> None:
    g = grant([0, 1, 2, 3])
    with pytest.raises(ChunkError, match="not in memory registered"):
        prepare(FakeAgent(), g, [(0x10, SIZE)], 0, None, RANGES, 0, "DRAM")
    with pytest.raises(ChunkError, match="do not fit"):
        prepare(FakeAgent(), g, chunks(3), 2, None, RANGES, 0, "DRAM")
    with pytest.raises(ChunkError, match="at least one chunk"):
        prepare(FakeAgent(), g, [], 0, None, RANGES, 0, "DRAM")
    with pytest.raises(ChunkError, match="outside its chunk"):
        prepare(FakeAgent(), g, chunks(1), 0, [np.array([[SIZE - 8, 0, 64]], np.int64)], RANGES, 0, "DRAM")
    # Runs that are not numpy arrays (they cannot be told unchanged) are not kept: the write builds them.
    assert prepare(FakeAgent(), g, chunks(1), 0, [[[0, 0, 64]]], RANGES, 0, "DRAM") is None  # type: ignore[list-item]
