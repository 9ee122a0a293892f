"""The receiver's transfer table on its own (a fake clock, no sockets): pinned transfers wait for
a queued request, aborted ones keep their pages until no WRITE can land, ids are single-use."""

from __future__ import annotations

import pytest

from kvferry.buffer.pd_buffer import PDBuffer
from kvferry.receiver.transfer_table import Incoming, TransferGone, TransferTable
from tests.pd_buffer_helpers import PAGE, FakeClock

LEASE, QUEUE = 10.0, 100.0


@pytest.fixture
def table() -> tuple[TransferTable, PDBuffer, FakeClock]:
    clock = FakeClock()
    buf = PDBuffer(PAGE * 8, "cpu", PAGE, clock=clock)
    return TransferTable(buf, LEASE, QUEUE), buf, clock


def incoming(buf: PDBuffer, tid: str, n: int = 2, conn: bytes = b"c1") -> Incoming:
    res = buf.reserve(n, tid, LEASE)
    return Incoming(tid, "s", [bytes([i + 1]) * 8 for i in range(n)], n * 16, res, conn)


def test_a_pinned_transfer_outlives_its_lease_once_arrived_but_not_while_being_written(table) -> None:
    t, buf, clock = table
    # Pinned before its alloc (the decode request reached the scheduler first), then it arrives.
    t.pin("early")
    a = incoming(buf, "early")
    t.add(a)
    assert t.arrived("early", a.res.generation) is not None
    # Pinned after it arrived.
    b = incoming(buf, "late")
    t.add(b)
    t.arrived("late", b.res.generation)
    clock.t += LEASE / 2
    t.pin("late")
    # Not pinned: expires with its lease.
    c = incoming(buf, "plain")
    t.add(c)
    t.arrived("plain", c.res.generation)
    # Pinned but never written: the lease still ends it (its sender may be dead).
    t.pin("unwritten")
    t.add(incoming(buf, "unwritten"))
    clock.t += LEASE * 2
    t.sweep()
    assert t.status("plain") == "lease expired" and t.status("unwritten") == "lease expired"
    assert t.status("early") == "arrived" and t.status("late") == "arrived"
    with t.claim("early", 0) as got:
        assert len(got.pages) == 2
    clock.t += QUEUE
    t.sweep()
    assert t.status("late") == "lease expired", "a pin is bounded by pd_queue_seconds"
    assert buf.fully_free()


def test_a_claim_releases_its_pages_even_when_the_reader_fails(table) -> None:
    t, buf, clock = table
    a = incoming(buf, "t", 4)
    t.add(a)
    t.arrived("t", a.res.generation)
    with pytest.raises(RuntimeError, match="scatter failed"), t.claim("t", 0) as got:
        clock.t += LEASE * 2  # a transfer being read does not expire mid-copy
        buf.reap()
        assert len(got.pages) == 4 and buf.is_live(a.res)
        raise RuntimeError("scatter failed")
    assert buf.fully_free() and not buf.is_live(a.res)


def test_unpin_of_an_unread_transfer_frees_it_and_a_written_one_waits_for_its_notice(table) -> None:
    t, buf, clock = table
    a = incoming(buf, "arrived")
    t.add(a)
    t.arrived("arrived", a.res.generation)
    t.pin("arrived")
    t.unpin("arrived", "its request ended")
    assert "its request ended" in t.status("arrived")
    b = incoming(buf, "writing")
    t.add(b)
    t.pin("writing")
    t.unpin("writing", "its request ended")
    assert t.sizes()["quarantine"] == 1 and buf.free_pages == 6, "a WRITE may still land in its pages"
    assert t.arrived("writing", b.res.generation) is None and buf.fully_free()
    assert t.counters["late_writes"] == 1
    with pytest.raises(TransferGone):
        with t.claim("writing", 0):
            pass


def test_ids_are_single_use_and_an_early_abort_refuses_the_late_alloc(table) -> None:
    t, buf, _ = table
    a = incoming(buf, "x")
    t.add(a)
    assert "in progress" in t.refusal("x")
    assert t.arrived("x", a.res.generation) is not None
    with t.claim("x", 0):
        pass
    assert "single-use" in t.refusal("x")
    t.abort("y", 0, "client disconnected")
    assert "aborted" in t.refusal("y")
    late = incoming(buf, "y")
    with pytest.raises(Exception, match="ended before its pages were granted"):
        t.add(late)
    buf.release(late.res)
    assert buf.fully_free()


def test_a_renewal_restarts_the_lease_only_for_its_own_connection_before_arrival_and_within_the_queue_bound(
        table) -> None:
    t, buf, clock = table
    t0 = clock.t
    a = incoming(buf, "a", conn=b"c1")
    t.add(a)
    clock.t += LEASE * 0.9
    assert t.renew("a", a.res.generation, b"other") is None, "another connection may not keep its pages"
    assert t.renew("a", a.res.generation + 1, b"c1") is None, "a stale generation renews nothing"
    assert t.renew("a", a.res.generation, b"c1") == pytest.approx(LEASE)
    clock.t += LEASE * 0.9
    t.sweep()
    assert t.status("a") == "pending", "the renewed lease must still hold"
    # Renewed again and again, it still ends pd_queue_seconds after the reservation.
    while clock.t - t0 < QUEUE - LEASE:
        assert t.renew("a", a.res.generation, b"c1") is not None
        clock.t += LEASE * 0.5
    left = t.renew("a", a.res.generation, b"c1")
    assert left is not None and left <= QUEUE - (clock.t - t0) + 1e-9
    clock.t += LEASE + 1
    t.sweep()
    assert t.status("a") == "lease expired" and t.renew("a", a.res.generation, b"c1") is None
    # Arrived data is not renewed by its writer (pins and reads govern it).
    b = incoming(buf, "b")
    t.add(b)
    t.arrived("b", b.res.generation)
    assert t.renew("b", b.res.generation, b"c1") is None
    assert buf.free_pages == 6
