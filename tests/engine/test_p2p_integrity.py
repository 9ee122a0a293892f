"""Bad data from a P2P peer is a counted miss, never an exception.

A holder in its own process (real NIXL over UCX between processes, real ZMQ, the cluster secret)
lends its CPU tier's chunks; on command it lies in its leases (counts, sizes, addresses, NIXL
metadata, MACs) or its handshake, or has a chunk's bytes changed in its tier after the tag was
made. The reader's fetch (a request's load) and pull (a controller's move) must each end in a
miss counted as ``p2p_rejected`` with nothing adopted, and the same fetch must succeed once the
holder tells the truth again (so each check, not the setup, is what failed it).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import msgspec
import pytest
import torch

from kvferry.common.config import load_config
from kvferry.common.wire import messages as m
from kvferry.engine.p2p.service import P2PService
from kvferry.launcher.standalone import StandaloneEngine, parse_shape_spec
from tests.polling import until
from tests.transfer_helpers import p2p_worker, peer_addr

SLOT = 1 << 20  # one full chunk: 64 tokens of 2 blocks (512 KiB each) in the test layout
SLOTS = 4
KEYS = [b"k0", b"k1", b"k2"]
SECRET = "p2p-integrity-cluster-secret-0123"


def make_worker(name: str, secret: str | None) -> P2PService:
    return p2p_worker(name, secret, slot=SLOT, slots=SLOTS, timeout=3.0)


def _lie(mode: str, r: m.PeerChunks) -> m.PeerChunks:
    """The holder's lease answer, doctored."""
    rep = msgspec.structs.replace
    if mode == "count":  # more chunks than keys asked
        return rep(r, addrs=[*r.addrs, r.addrs[0]], sizes=[*r.sizes, r.sizes[0]], tags=[*r.tags, *r.tags[:1]])
    if mode == "short":  # a size not a whole number of blocks
        return rep(r, sizes=[r.sizes[0] - 1, *r.sizes[1:]])
    if mode == "big":  # more than a chunk: a READ past the slot
        return rep(r, sizes=[2 * SLOT, *r.sizes[1:]])
    if mode == "addr":  # outside everything it registered
        return rep(r, addrs=[r.addrs[0] + 16 * SLOTS * SLOT, *r.addrs[1:]])
    if mode == "misaligned":  # inside its arena, but not a slot
        return rep(r, addrs=[r.addrs[0] + 4096, *r.addrs[1:]])
    if mode == "metadata":  # an oversized NIXL metadata blob
        return rep(r, metadata=[b"\0" * (100 << 10)], spans=[m.Span(addr=r.addrs[0], nbytes=SLOT)])
    if mode == "untagged":
        return rep(r, tags=[])
    if mode == "forged":
        return rep(r, tags=[bytes(16), *r.tags[1:]])
    return r


def holder_main(conn, secret: str | None) -> None:
    """The holder process: lends KEYS, and lies or corrupts on command ("lie <mode>", "corrupt")."""
    from kvferry.buffer import peering
    w = make_worker("holder", secret)
    state = {"lie": ""}
    for i, key in enumerate(KEYS):
        t = w.cpu.alloc(SLOT)
        t.fill_(i + 1)
        w.cpu.put(key, t)
    until(lambda: w.lender.sizes()["tags"] == (len(KEYS) if secret else 0), what="the chunks' tags")
    lend, welcome = w.lender._lend, peering.welcome

    async def lying_lend(msg):
        reply = await lend(msg)
        return _lie(state["lie"], reply) if isinstance(reply, m.PeerChunks) and reply.addrs else reply

    def lying_welcome(*a, **kw):
        reply = welcome(*a, **kw)
        if state["lie"] == "hello_metadata":
            return msgspec.structs.replace(reply, agent_metadata=reply.agent_metadata + b"\0" * (100 << 10))
        if state["lie"] == "hello_name":
            return msgspec.structs.replace(reply, agent_name="holder\n[kvferry] INFO: forged log line")
        if state["lie"] == "hello_other_agent":  # its metadata is not the agent it names
            return msgspec.structs.replace(reply, agent_name="somebody-else")
        return reply

    w.lender._lend, peering.welcome = lying_lend, lying_welcome
    conn.send((w.info.p2p_init_port, w.info.p2p_lookup_port))
    try:
        while conn.poll(300):
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd.startswith("lie "):
                state["lie"] = cmd[4:]
            elif cmd == "corrupt":  # bytes change in the tier after their tag was made
                d = w.cpu.get(KEYS[1])
                d[SLOT // 2] ^= 0x5A
            conn.send("ok")
    finally:
        w.close()
        w.cpu.close()


class Holder:
    def __init__(self, secret: str | None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=holder_main, args=(child, secret), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "the holder process did not start"
        init, look = self.conn.recv()
        self.addr = m.PeerAddr(host="127.0.0.1", init_port=init, lookup_port=look)

    def cmd(self, c: str) -> None:
        self.conn.send(c)
        assert self.conn.poll(30) and self.conn.recv() == "ok"

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def holder():
    h = Holder(SECRET)
    yield h
    h.close()


@pytest.fixture(scope="module")
def reader():
    w = make_worker("reader", SECRET)
    yield w
    w.close()
    w.cpu.close()


def fetch(reader: P2PService, holder: Holder) -> list[torch.Tensor] | None:
    return reader.fetch("holder", holder.addr, KEYS, [SLOT] * len(KEYS))


def assert_true_bytes(got: list[torch.Tensor] | None) -> None:
    assert got is not None and len(got) == len(KEYS), "the honest holder's fetch failed"
    for i, d in enumerate(got):
        assert d.numel() == SLOT and bool((d == i + 1).all())


LEASE_LIES = ["count", "short", "big", "addr", "misaligned", "metadata", "untagged", "forged",
              "hello_metadata", "hello_name", "hello_other_agent"]


@pytest.mark.parametrize("lie", LEASE_LIES)
def test_a_lying_holder_is_a_counted_miss_and_the_truth_is_read_after(holder, reader, lie: str) -> None:
    assert_true_bytes(fetch(reader, holder))
    if lie.startswith("hello_"):
        reader._call(_forget_peers(reader), 5)  # the next fetch handshakes again, with the lying Welcome
    before = dict(reader.stats())
    holder.cmd(f"lie {lie}")
    try:
        got = fetch(reader, holder)  # never raises: vLLM's worker calls this
    finally:
        holder.cmd("lie ")
    after = reader.stats()
    assert got is None, f"the reader took chunks from a holder lying with {lie!r}"
    assert after["p2p_rejected"] == before["p2p_rejected"] + 1
    assert after["p2p_errors"] == before["p2p_errors"] + 1
    assert after["p2p_read_chunks"] == before["p2p_read_chunks"] or lie == "forged", "a READ ran on a bad lease"
    until(lambda: (g := fetch(reader, holder)) is not None and (assert_true_bytes(g) or True), timeout=15,
          what="the honest holder's chunks again")


async def _forget_peers(w: P2PService) -> None:
    import asyncio
    await asyncio.gather(*w.reader.peers.close())  # each peer's NIXL agent removed


def test_chunk_bytes_changed_after_their_tag_fail_the_mac(holder, reader) -> None:
    assert_true_bytes(fetch(reader, holder))
    before = reader.stats()["p2p_rejected"]
    holder.cmd("corrupt")
    try:
        assert fetch(reader, holder) is None
        assert reader.stats()["p2p_rejected"] == before + 1
    finally:
        holder.cmd("corrupt")  # the same XOR puts the byte back
    assert_true_bytes(fetch(reader, holder))


@pytest.mark.parametrize("lie", ["short", "big", "forged"])
def test_a_pull_of_bad_chunks_adopts_nothing(holder, reader, lie: str) -> None:
    """A controller's move: sizes are not known ahead (only a whole number of blocks up to a
    chunk), so what a pull brings in is checked before it enters the CPU tier."""
    pull = lambda ev: reader._call(reader.commands.run(m.PullChunks(  # noqa: E731
        event_id=ev, source_id="holder", source=holder.addr, keys=KEYS)), 20)
    before = reader.stats()["p2p_rejected"]
    holder.cmd(f"lie {lie}")
    try:
        res = pull("bad")
    finally:
        holder.cmd("lie ")
    assert not res.ok and res.num_chunks == 0
    assert reader.stats()["p2p_rejected"] == before + 1
    assert all(reader.cpu.get(k) is None for k in KEYS), "a bad pulled chunk entered the CPU tier"
    res = until(lambda: (r := pull("good")).ok and r, timeout=15, what="an honest pull")
    try:
        assert res.num_chunks == len(KEYS)
        for i, k in enumerate(KEYS):
            assert bool((reader.cpu.get(k) == i + 1).all())
    finally:
        for k in KEYS:
            reader.cpu.delete(k)


def test_without_a_secret_chunks_carry_no_tags() -> None:
    a, b = make_worker("plain-holder", None), make_worker("plain-reader", None)
    try:
        t = a.cpu.alloc(SLOT)
        t.fill_(9)
        a.cpu.put(b"k0", t)
        peer, reply = b._call(b.reader.lease(peer_addr(a), [b"k0"], time.monotonic() + 5, [SLOT], "plain-holder"), 10)
        assert reply.tags == [] and a.mac is None and b.mac is None
        out = b._call(b.reader.read(peer, reply, [b"k0"], time.monotonic() + 5), 10)
        assert bool((out[0] == 9).all())
        assert a.lender.sizes()["tags"] == 0
    finally:
        for w in (b, a):
            w.close()
            w.cpu.close()


def test_a_wrong_size_chunk_in_the_cpu_tier_is_a_miss_before_it_is_scattered() -> None:
    """What a move could have adopted from a peer of another build: `load` checks every chunk's
    size before scattering it into the KV cache, and recomputes."""
    eng = StandaloneEngine(load_config({"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.01}, env={}),
                           parse_shape_spec("(2,2,512,2,16):float16:1"), "test-model")
    try:
        toks = list(range(100, 612))
        for layer in eng.kv:
            layer.normal_()
        eng.store(toks)
        key = eng.planner.keys(toks)[1]
        good = eng.copier.cpu.get(key)
        eng.copier.cpu.put(key, good[: good.numel() // 2].clone())  # half a chunk under a full chunk's key
        before = eng.copier.counters.load_errors
        assert eng.retrieve(toks) == 0  # recomputed, no exception
        assert eng.copier.counters.load_errors == before + 1
        assert eng.copier.cpu.get(key) is None, "the wrong-size chunk stayed in the tier"
        assert eng.lookup(toks) == 256, "the scheduler still counts the dropped chunk as held"
    finally:
        eng.close()
