"""Two P2P services in one process over real NIXL (no vLLM): what a lease guarantees.

The holder's chunks live in slots of one arena registered once; a chunk evicted while a peer holds
a lease on it must keep its slot (and its bytes) until the lease ends, or the peer would read
whatever the next chunk wrote there."""

from __future__ import annotations

import gc
import time

import pytest

from kvferry.common.wire import messages as m
from kvferry.engine.p2p.fetching import P2PError
from kvferry.engine.p2p.service import P2PService
from tests.polling import until
from tests.transfer_helpers import p2p_worker, peer_addr

SLOT = 1 << 20
SLOTS = 4


def worker(name: str, secret: str | None = None, **fp) -> P2PService:
    return p2p_worker(name, secret, slot=SLOT, slots=SLOTS, **fp)


@pytest.fixture
def pair():
    holder, reader = worker("holder"), worker("reader")
    yield holder, reader
    for w in (reader, holder):
        w.close()
        w.cpu.close()


def test_a_chunk_evicted_under_a_lease_keeps_its_bytes_until_released(pair) -> None:
    holder, reader = pair
    assert holder.cpu.arena is not None and reader.cpu.arena is not None
    t = holder.cpu.alloc(SLOT)
    t.fill_(0xAB)
    holder.cpu.put(b"k0", t)
    leased_at = t.data_ptr()
    del t

    deadline = time.monotonic() + 10
    peer, reply = reader._call(reader.reader.lease(peer_addr(holder), [b"k0"], deadline), 10)
    assert list(reply.addrs) == [leased_at] and len(reply.metadata) == 1  # the arena's registration
    until(lambda: holder.cpu.arena._quiet == 1, what="the holder's touch-ahead to pause during a lease")

    # Evicted on the holder, and new chunks fill every free slot with other bytes.
    assert holder.cpu.delete(b"k0")
    gc.collect()
    others = []
    while (o := holder.cpu.arena.alloc(SLOT)) is not None:
        o.fill_(0xCD)
        others.append(o)
    assert len(others) == SLOTS - 1
    assert leased_at not in {o.data_ptr() for o in others}, "a leased slot was handed out again"

    out = reader._call(reader.reader.read(peer, reply, [b"k0"], deadline), 10)
    assert len(out) == 1 and reader.cpu.arena.holds(out[0])
    assert bool((out[0] == 0xAB).all()), "the reader got bytes written after the eviction"

    # Released by the read: the slot comes back, and the holder may touch ahead again.
    until(lambda: not holder.lender._leases, what="the lease's release")
    assert holder.cpu.arena._quiet == 0 and holder.lender._arena_reg.leases == 0
    gc.collect()
    until(lambda: holder.cpu.arena.free_slots == 1, what="the leased slot to come back")
    again = holder.cpu.arena.alloc(SLOT)
    assert again is not None and again.data_ptr() == leased_at


def test_the_arena_metadata_goes_to_a_peer_once(pair) -> None:
    holder, reader = pair
    for i in range(2):
        t = holder.cpu.alloc(SLOT)
        t.fill_(i + 1)
        holder.cpu.put(bytes([i]), t)
    deadline = time.monotonic() + 10
    got = []
    for key in (b"\x00", b"\x01"):
        peer, reply = reader._call(reader.reader.lease(peer_addr(holder), [key], deadline), 10)
        got.append(len(reply.metadata))
        out = reader._call(reader.reader.read(peer, reply, [key], deadline), 10)
        assert int(out[0][0]) == key[0] + 1 and int(out[0][-1]) == key[0] + 1
    assert got == [1, 0]
    assert not holder.lender._regs, "arena chunks got registrations of their own"


SECRET, OTHER = "p2p-test-cluster-secret-0123456", "a-different-cluster-secret-9876"


@pytest.fixture
def workers():
    made: list[P2PService] = []

    def make(name: str, **kw) -> P2PService:
        made.append(worker(name, **kw))
        return made[-1]

    yield make
    for w in reversed(made):
        w.close()
        w.cpu.close()


def put(w: P2PService, key: bytes, value: int) -> None:
    t = w.cpu.alloc(SLOT)
    t.fill_(value)
    w.cpu.put(key, t)


def test_a_peer_without_the_cluster_secret_gets_no_metadata_and_reads_nothing(workers) -> None:
    holder = workers("holder", secret=SECRET)
    put(holder, b"k0", 7)
    deadline = lambda: time.monotonic() + 1.5  # noqa: E731
    for name, secret in (("plain", None), ("wrong", OTHER)):
        intruder = workers(name, secret=secret)
        with pytest.raises(P2PError, match="did not answer the handshake"):
            intruder._call(intruder.reader.lease(peer_addr(holder), [b"k0"], deadline()), 10)
        assert not holder.lender._seen, "the holder answered someone without the secret"
    # The controller's command port too: nothing without the secret, an answer with it.
    import zmq

    from kvferry.common import secret as csecret
    from kvferry.common import zsock
    ctx = zmq.Context()
    try:
        for key, answered in ((None, False), (OTHER, False), (SECRET, True)):
            trust = zsock.Trust(csecret.from_text(key, "test")) if key else zsock.PLAIN
            sock = zsock.connect(ctx, zmq.DEALER, trust, zsock.tcp("127.0.0.1", holder.info.worker_port))
            sock.send(m.encode(m.Resync(event_id="e1")))
            got = sock.poll(1500)
            assert bool(got) == answered, f"worker port with secret {key!r}"
            if got:
                assert isinstance(m.decode(sock.recv()), m.CommandResult)
    finally:
        ctx.destroy(linger=0)
    friend = workers("friend", secret=SECRET)
    peer, reply = friend._call(friend.reader.lease(peer_addr(holder), [b"k0"], deadline() + 5), 10)
    out = friend._call(friend.reader.read(peer, reply, [b"k0"], deadline() + 5), 10)
    assert int(out[0][0]) == 7 and int(out[0][-1]) == 7


def test_another_kv_layout_is_refused_naming_both_sides(workers) -> None:
    holder, reader = workers("holder"), workers("reader", num_kv_heads=4)
    with pytest.raises(P2PError) as e:
        reader._call(reader.reader.lease(peer_addr(holder), [b"k0"], time.monotonic() + 5), 10)
    text = str(e.value)
    assert "num_kv_heads" in text and "reader:" in text and "holder:" in text


def test_leases_per_peer_and_the_peers_remembered_are_bounded(workers, monkeypatch) -> None:
    from kvferry.sender import lender
    monkeypatch.setattr(lender, "MAX_LEASES_PER_PEER", 3)
    monkeypatch.setattr(lender, "MAX_SEEN_PEERS", 2)
    holder, reader = workers("holder"), workers("reader")
    put(holder, b"k0", 1)
    deadline = time.monotonic() + 10
    held = [reader._call(reader.reader.lease(peer_addr(holder), [b"k0"], deadline), 10) for _ in range(3)]
    with pytest.raises(P2PError, match="leases of yours are open"):
        reader._call(reader.reader.lease(peer_addr(holder), [b"k0"], deadline), 10)
    assert holder.lender.sizes()["leases"] == 3 and holder.lender.counters["p2p_refused_leases"] == 1
    for peer, reply in held:
        reader._call(reader.reader.release(peer, reply.lease_id), 10)
    until(lambda: holder.lender.sizes()["leases"] == 0, timeout=3, what="the releases (not the leases' expiry, at 10 "
                                                                        "s)")
    for name in ("r2", "r3", "r4"):
        w = workers(name)
        p, r = w._call(w.reader.lease(peer_addr(holder), [b"k0"], time.monotonic() + 10), 10)
        w._call(w.reader.release(p, r.lease_id), 10)
    assert holder.lender.sizes()["seen_peers"] == 2
