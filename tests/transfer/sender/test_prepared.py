"""sender/prepared.py: a write's descriptors built ahead (KVSender.prepare) are exactly the ones the
write would build, and a write whose arguments differ in anything (chunks, pages, first page, run
arrays, a run array changed in place) builds its own instead of posting a stale preparation. The
prepared NIXL handle goes to one post only, of the notification it was made with, and one released
(grant ended, peer dropped, sleep) is never posted."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvferry.common.wire import messages as m
from kvferry.sender.addr import ReceiverAddr
from kvferry.sender.descs import write_descs
from kvferry.sender.errors import ChunkError
from kvferry.sender.grants import Grant
from kvferry.sender.prepared import Handles, checked_descs, prepare

REGION = m.Region(addr=1 << 40, page_bytes=1 << 16, num_pages=32, device_id=3)
SIZE = 1 << 15
RANGES = [(0x10000, 0x10000 + 16 * SIZE)]


class FakeAgent:
    """get_xfer_descs as NIXL's, minus NIXL: a copy of the descriptors, tagged with the memory type."""

    def get_xfer_descs(self, descs, mem_type):
        if isinstance(descs, tuple) and descs[0] == "dlist":  # NIXL passes a descriptor list through
            return descs
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
    local, remote, nbytes, widest, used = checked_descs(g, list(cs), 2, None if rs is None else list(rs), RANGES, 2)
    assert used is g.prepared and local is used.local and remote is used.remote, "the preparation was not used"
    assert local[2] == "DRAM" and remote[2] == REGION.mem_type
    assert same((local[1], remote[1], nbytes, widest), fresh)


def test_a_write_that_differs_from_its_preparation_builds_its_own() -> None:
    g = grant([5, 1, 9, 2, 30, 0])
    cs, rs = chunks(4), runs_of(4)
    prep = g.prepared = prepare(FakeAgent(), g, cs, 0, rs, RANGES, 2, "DRAM")
    assert prep is not None

    def fresh_ok(c, first, r, pages) -> None:
        got = checked_descs(g, c, first, r, RANGES, 2)
        assert got[0] is not prep.local and got[4] is None, "a stale preparation was posted"
        assert same(got[:4], write_descs(c, pages, REGION, 2, r))

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
    assert fresh_ok2[0] is not g2.prepared.local and fresh_ok2[4] is None
    assert same(fresh_ok2[:4], write_descs(cs, [5, 1, 9, 2], REGION, 2, runs_of(4)))


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


class HandleAgent(FakeAgent):
    def __init__(self) -> None:
        self.made: list[tuple] = []
        self.released: list[object] = []

    def initialize_xfer(self, op, local, remote, agent_name, notif):
        self.made.append((op, agent_name, notif))
        return object()

    def release_xfer_handle(self, h) -> None:
        self.released.append(h)


class QueuedNixl:
    """NixlThread's `run` and `agent`, its queue run when the test says."""

    def __init__(self) -> None:
        self.agent = HandleAgent()
        self.q: list[tuple] = []

    def run(self, fn, *args) -> None:
        self.q.append((fn, args))

    def drain(self) -> None:
        while self.q:
            fn, args = self.q.pop(0)
            fn(*args)


def prepped(nixl: QueuedNixl, handles: Handles, pages: list[int]) -> Grant:
    g = grant(pages)
    g.peer.agent, g.peer.dropped = "remote", False
    handles.make(g, prepare(nixl.agent, g, chunks(len(pages)), 0, None, RANGES, 0, "DRAM"), handles.gen)
    return g


def test_a_prepared_handle_goes_to_one_post_of_its_notification_only() -> None:
    nixl = QueuedNixl()
    handles = Handles(nixl)
    g = prepped(nixl, handles, [0, 1])
    assert g.prepared.take("WRITE", "remote", g.notice) is None, "taken before the NIXL thread made it"
    nixl.drain()
    assert nixl.agent.made == [("WRITE", "remote", g.notice)]
    assert g.prepared.take("WRITE", "remote", b"") is None  # a write without the notification
    assert g.prepared.take("WRITE", "other", g.notice) is None
    h = g.prepared.take("WRITE", "remote", g.notice)
    assert h is not None and g.prepared.take("WRITE", "remote", g.notice) is None, "posted twice"
    handles.close(g.prepared)
    nixl.drain()
    assert nixl.agent.released == [] and len(handles) == 0, "the post's handle is the post's to release"


def test_a_handle_not_posted_is_released_at_the_grants_end_the_peers_drop_or_sleep_and_never_posted() -> None:
    nixl = QueuedNixl()
    handles = Handles(nixl)
    a, b, c = (prepped(nixl, handles, [i]) for i in range(3))
    b.peer = SimpleNamespace(welcome=a.peer.welcome, agent="remote", dropped=False)
    b.prepared.peer = b.peer
    nixl.drain()
    handles.close(a.prepared)  # a's grant ended
    nixl.drain()
    assert len(nixl.agent.released) == 1 and a.prepared.take("WRITE", "remote", a.notice) is None
    handles.close_peer(b.peer)  # b's receiver dropped: c's (another peer) stays
    nixl.drain()
    assert len(nixl.agent.released) == 2 and b.prepared.take("WRITE", "remote", b.notice) is None
    assert c.prepared.handle is not None and len(handles) == 1
    handles.close_all()  # sleep mode
    nixl.drain()
    assert len(nixl.agent.released) == 3 and len(handles) == 0
    # Closed before the NIXL thread made it: made, then released, in queue order; never posted.
    d = prepped(nixl, handles, [4])
    handles.close(d.prepared)
    assert d.prepared.take("WRITE", "remote", d.notice) is None
    nixl.drain()
    assert len(nixl.agent.made) == 4 and len(nixl.agent.released) == 4 and d.prepared.handle is None
    assert d.prepared.take("WRITE", "remote", d.notice) is None
    d.prepared.make(nixl.agent, "remote", d.notice)  # a make after the release makes nothing
    assert len(nixl.agent.made) == 4 and d.prepared.handle is None
    # A grant that ended or whose peer dropped gets no handle at all.
    e = grant([5])
    e.peer.agent, e.peer.dropped = "remote", True
    handles.make(e, prepare(nixl.agent, e, chunks(1), 0, None, RANGES, 0, "DRAM"), handles.gen)
    assert e.prepared is not None and not nixl.q and len(handles) == 0


def test_preparing_again_releases_the_first_and_one_begun_before_a_sleep_never_posts_its_handle() -> None:
    nixl = QueuedNixl()
    handles = Handles(nixl)
    g = prepped(nixl, handles, [0, 1])
    nixl.drain()
    first = g.prepared
    handles.make(g, prepare(nixl.agent, g, chunks(2), 0, None, RANGES, 0, "DRAM"), handles.gen)
    nixl.drain()
    assert first.closed and first.handle is None and len(nixl.agent.released) == 1 and len(handles) == 1
    assert g.prepared is not first and g.prepared.take("WRITE", "remote", g.notice) is not None
    # A preparation that began (gen read) before a sleep and reached make() after it: stale.
    gen = handles.gen
    handles.close_all()
    s = grant([2])
    s.peer.agent, s.peer.dropped = "remote", False
    handles.make(s, prepare(nixl.agent, s, chunks(1), 0, None, RANGES, 0, "DRAM"), gen)
    nixl.drain()
    assert s.prepared.handle is None and s.prepared.take("WRITE", "remote", s.notice) is None
    # After the sleep, a new preparation's handle is made and posted as usual.
    t = prepped(nixl, handles, [3])
    nixl.drain()
    assert t.prepared.take("WRITE", "remote", t.notice) is not None
