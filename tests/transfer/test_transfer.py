"""The transfer service over real NIXL (UCX) and real ZMQ, receiver and sender in separate processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl")

from kvferry.common.netutil import free_port  # noqa: E402
from kvferry.common.wire import messages as m  # noqa: E402
from kvferry.sender.addr import ReceiverAddr  # noqa: E402
from kvferry.sender.errors import (  # noqa: E402
    AllocFailed,
    FingerprintMismatch,
    HandshakeFailed,
    LeaseExpired,
    SendError,
)
from kvferry.sender.kv_sender import KVSender, SenderConfig  # noqa: E402
from tests.polling import until, until_async  # noqa: E402
from tests.transfer_helpers import PAGE, ReceiverProc, abort_acked, fingerprint, next_answer, sender_main, trust  # noqa: E402


@pytest.fixture
def receiver():
    procs: list[ReceiverProc] = []

    def make(pages: int = 16, **opts) -> ReceiverProc:
        p = ReceiverProc(pages=pages, opts=opts).start()
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.stop()


@pytest.fixture
def sender():
    made: list[KVSender] = []

    def make(name: str = "p0", pages: int = 16, fp: m.LayoutFingerprint | None = None,
             **cfg) -> tuple[KVSender, torch.Tensor]:
        s = KVSender(SenderConfig(name, **cfg), fp or fingerprint())
        src = torch.randint(0, 256, (pages * PAGE,), dtype=torch.uint8)
        s.register(src)
        made.append(s)
        return s, src

    yield make
    for s in made:
        s.close()


def chunks_of(src: torch.Tensor, n: int, first: int = 0) -> list[tuple[int, int]]:
    return [(src.data_ptr() + (first + i) * PAGE, PAGE) for i in range(n)]


def keys(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i + 1]) * 8 for i in range(n)]


def test_round_trip_is_byte_exact_and_read_once(receiver, sender) -> None:
    r = receiver()
    s, src = sender()
    res = s.send("t1", r.addr, keys(4), chunks_of(src, 4), 4 * 32).result(30)
    assert res.sent_chunks == 4 and res.bytes == 4 * PAGE and res.handshook
    kind, num_tokens, data = r.ask("claim", "t1", 10)
    assert kind == "ok" and num_tokens == 4 * 32 and sorted(data) == [0, 1, 2, 3]
    for i in range(4):
        assert data[i] == bytes(src[i * PAGE:(i + 1) * PAGE].numpy())
    # Nothing is read twice; the buffer is fully free again.
    kind, err, msg = r.ask("claim", "t1", 1)
    assert (kind, err) == ("err", "TransferGone") and "already read" in msg
    assert r.state()[1]
    # A second transfer reuses the cached connection.
    assert not s.send("t2", r.addr, keys(2, 1), chunks_of(src, 2, 4), 64).result(30).handshook
    assert r.ask("claim", "t2", 10)[0] == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_to_gpu_memory_round_trip_is_byte_exact_and_frees_the_pages(receiver) -> None:
    """pd_buffer_device: cuda: the sender's chunks and the receiver's pd_buffer both in GPU memory,
    written over NIXL between two processes (UCX's CUDA transports), read back byte for byte."""
    r = receiver(device="cuda")
    with KVSender(SenderConfig("p0"), fingerprint(), "cuda") as s:
        src = torch.randint(0, 256, (16 * PAGE,), dtype=torch.uint8, device="cuda")
        s.register(src)
        res = s.send("g1", r.addr, keys(8), chunks_of(src, 8, 3), 8 * 32).result(60)
        assert res.sent_chunks == 8 and res.bytes == 8 * PAGE
        kind, num_tokens, data = r.ask("claim", "g1", 30)
        assert kind == "ok" and num_tokens == 8 * 32 and sorted(data) == list(range(8))
        want = src.cpu()
        for i in range(8):
            assert data[i] == bytes(want[(3 + i) * PAGE:(4 + i) * PAGE].numpy()), f"chunk {i} differs"
        assert r.wait_fully_free(10)


def test_unknown_transfer_wait_is_bounded(receiver) -> None:
    r = receiver()
    t = time.monotonic()
    kind, err, msg = r.ask("claim", "never-sent", 0.5, timeout=60)
    assert (kind, err) == ("err", "TransferTimeout") and "within 0.5s (pd_kv_ready_timeout)" in msg, msg
    assert time.monotonic() - t < 30  # its 0.5 s ended the wait, not an unbounded one (the pipe's 60 s)


def test_many_senders_many_transfers_in_flight(receiver, sender) -> None:
    recvs = [receiver(pages=32), receiver(pages=32)]
    senders = [sender(f"p{i}") for i in range(2)]
    futs = {}
    for si, (s, src) in enumerate(senders):
        for ri, r in enumerate(recvs):
            for k in range(3):
                tid = f"s{si}-r{ri}-{k}"
                futs[tid] = (r, src, s.send(tid, r.addr, keys(3, si * 16 + ri * 4 + k), chunks_of(src, 3, k), 96))
    for tid, (r, src, fut) in futs.items():
        assert fut.result(30).sent_chunks == 3
        kind, _, data = r.ask("claim", tid, 10)
        k = int(tid.rsplit("-", 1)[1])
        assert kind == "ok" and data[0] == bytes(src[k * PAGE:(k + 1) * PAGE].numpy()), tid
    for r in recvs:
        assert r.state()[1]


def test_fingerprint_mismatch_is_refused_showing_both(receiver, sender) -> None:
    r = receiver()
    s, src = sender(fp=fingerprint(num_kv_heads=4))
    with pytest.raises(FingerprintMismatch) as e:
        s.send("t", r.addr, keys(1), chunks_of(src, 1), 32).result(30)
    assert "num_kv_heads: 2 != 4" in str(e.value) or "num_kv_heads: 4 != 2" in str(e.value)
    assert "sender:" in str(e.value) and "receiver:" in str(e.value)
    assert r.state()[1]


@pytest.mark.parametrize("field,value,fix", [("block_size", 16, "same --block-size"),
                                             ("tp_size", 2, "same --tensor-parallel-size"),
                                             ("kv_kind", "mla", "one is MLA"),
                                             ("kv_layout", "cpu isa=amx", "packs blocks unlike one without AMX")])
def test_block_size_tp2_and_mla_mismatch_is_refused_naming_the_fix(receiver, sender, field: str, value: object,
                                                                    fix: str) -> None:
    """Different block sizes or TP sizes from a sender that does not slice (docs/pd.md: a slicing
    prefiller maps both), an MLA model on one side only, or vLLM CPU attention kernels that pack
    blocks differently (an AMX CPU beside one without): refused at the handshake, both sides'
    values and the fix named."""
    r = receiver()
    s, src = sender(fp=msgspec.structs.replace(fingerprint(), **{field: value}))
    with pytest.raises(FingerprintMismatch) as e:
        s.send("t", r.addr, keys(1), chunks_of(src, 1), 32).result(30)
    assert f"{field}: " in str(e.value) and repr(value) in str(e.value) and fix in str(e.value), str(e.value)
    assert r.state()[1]


def test_handshake_with_nobody_listening_is_bounded(sender) -> None:
    s, src = sender(handshake_timeout=0.5)
    addr = ReceiverAddr("127.0.0.1", free_port(), free_port())
    t = time.monotonic()
    # The 0.5 s it was given ended it (the message names the bound that fired: not the 5 s default)...
    with pytest.raises(HandshakeFailed, match=r"within 0\.5s \(pd_handshake_timeout\)"):
        s.send("t", addr, keys(1), chunks_of(src, 1), 32).result(60)
    assert time.monotonic() - t < 30  # ... and it is bounded: not a wait for the future's 60 s


def test_receiver_restart_rehandshakes(receiver, sender) -> None:
    r = receiver()
    s, src = sender()
    s.send("a", r.addr, keys(2), chunks_of(src, 2), 64).result(30)
    assert r.ask("claim", "a", 10)[0] == "ok"
    old = r.epoch
    r.restart()
    assert r.epoch != old
    res = s.send("b", r.addr, keys(2, 1), chunks_of(src, 2, 2), 64).result(30)
    assert res.handshook, "the sender should have noticed the new epoch and handshaken again"
    kind, _, data = r.ask("claim", "b", 10)
    assert kind == "ok" and data[1] == bytes(src[3 * PAGE:4 * PAGE].numpy())
    assert s.counters.handshakes == 2


def test_buffer_full_waits_fifo_then_fails_naming_pd_buffer_size(receiver, sender) -> None:
    # pd_alloc_timeout 60 s on both sides (and a 60 s lease): nothing times out while the test looks.
    r = receiver(pages=4, alloc_timeout=60, lease_seconds=60)
    s, src = sender(alloc_timeout=60)
    # Too large for the whole buffer: fails at once, not after the 60 s it could wait for room.
    t = time.monotonic()
    with pytest.raises(AllocFailed) as e:
        s.send("huge", r.addr, keys(5), chunks_of(src, 5), 160).result(90)
    assert e.value.code == "too_large" and "pd_buffer_size" in str(e.value)
    assert time.monotonic() - t < 30
    # Full (pd_alloc_timeout 1 s here), a transfer that fits later waits its turn and times out
    # naming the key: its 1 s ends the wait, not the filler's 120 s lease (it would get the pages then).
    short = receiver(pages=4, alloc_timeout=1.0, lease_seconds=120)
    s1, src1 = sender("p1", alloc_timeout=1.0)
    s1.send("fill", short.addr, keys(3, 1), chunks_of(src1, 3), 96).result(30)
    t = time.monotonic()
    with pytest.raises(AllocFailed) as e:
        s1.send("late", short.addr, keys(2, 2), chunks_of(src1, 2), 64).result(30)
    waited = time.monotonic() - t
    assert e.value.code == "buffer_full" and "pd_buffer_size" in str(e.value)
    assert 0.9 <= waited < 30
    assert short.ask("claim", "fill", 10)[0] == "ok"
    # FIFO, no overtaking: w1 (3 pages) waits for the filler; w2 (1 page) would fit now but
    # must queue behind w1, so a stream of small requests can never starve a large one.
    s.send("fill", r.addr, keys(3, 1), chunks_of(src, 3), 96).result(30)
    f1 = s.send("w1", r.addr, keys(3, 3), chunks_of(src, 3), 96)
    until(lambda: r.state()[6] == 1, 60, lambda: f"w1 to queue for pages: {r.state()}")
    f2 = s.send("w2", r.addr, keys(1, 4), chunks_of(src, 1, 3), 32)
    time.sleep(0.3)  # a sleep (window): w2 must not be served in this time
    assert not f1.done() and not f2.done(), "w2 overtook w1"
    assert r.ask("claim", "fill", 5)[0] == "ok"
    assert f1.result(60).sent_chunks == 3 and f2.result(60).sent_chunks == 1
    assert r.ask("claim", "w1", 5)[0] == "ok" and r.ask("claim", "w2", 5)[0] == "ok"
    assert r.wait_fully_free(30)  # the claims gave every page back, not the 60 s lease


def test_interleaved_large_requests_do_not_deadlock(receiver, sender) -> None:
    """Two requests of 3 pages each on a 4-page buffer, from two senders at once: all or nothing
    means one waits for the other instead of both holding half."""
    r = receiver(pages=4, alloc_timeout=60)
    (s1, a), (s2, b) = sender("p1", alloc_timeout=60), sender("p2", alloc_timeout=60)
    f1 = s1.send("x", r.addr, keys(3, 1), chunks_of(a, 3), 96)
    f2 = s2.send("y", r.addr, keys(3, 2), chunks_of(b, 3), 96)
    until(lambda: f1.done() or f2.done(), 60, "one of the two to hold the buffer", every=0.01)
    assert f1.done() != f2.done(), "exactly one of the two must hold the buffer"
    first, waiting, later = ("x", f2, "y") if f1.done() else ("y", f1, "x")
    assert r.ask("claim", first, 5)[0] == "ok"
    assert waiting.result(60).sent_chunks == 3
    assert r.ask("claim", later, 5)[0] == "ok"
    assert r.state()[1]


def spawn_sender(r: ReceiverProc, pages: int):
    """A sender process connected to `r`, waiting for ("go", transfer_id)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=sender_main, args=(child, (r.addr.host, r.init_port, r.alloc_port), pages),
                       daemon=True)
    proc.start()
    if not conn.poll(60):
        proc.kill()
        raise TimeoutError("sender process did not start")
    conn.recv()
    return proc, conn


def test_sender_killed_mid_transfer_frees_pages_within_the_lease(receiver, sender) -> None:
    r = receiver(pages=8, lease_seconds=2.0)
    proc, conn = spawn_sender(r, 6)
    try:
        conn.send(("go", "doomed-1"))
        # Kill it the moment the receiver has reserved its pages (before, during or just after
        # its write; whichever, the pages must come back).
        until(lambda: r.state()[2] != 8, 20, "the sender to get pages (else nothing is tested)", every=0.005)
        os.kill(proc.pid, signal.SIGKILL)
        assert r.state()[2] < 8, "the sender never got pages: nothing was tested"
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
    # The 2 s lease (or the 1 s grace after the connection closed) gives them back; nothing else
    # would, so a leak never ends: a far bound tells the two apart under any load.
    t = time.monotonic()
    assert r.wait_fully_free(60), r.state()
    assert time.monotonic() - t < 30
    # The receiver keeps serving others.
    s, src = sender()
    s.send("after", r.addr, keys(2, 9), chunks_of(src, 2), 64).result(30)
    assert r.ask("claim", "after", 10)[0] == "ok"


def test_a_killed_senders_reserved_pages_come_back_when_its_connection_closes_not_at_the_lease(receiver) -> None:
    r = receiver(pages=8, lease_seconds=60.0)
    proc, conn = spawn_sender(r, 6)
    try:
        conn.send(("reserve", "held-1"))
        assert conn.poll(30) and conn.recv() == ("reserved",)
        assert r.state()[2] == 2  # 6 of 8 pages held, for up to a minute
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
    assert r.wait_fully_free(30), r.state()  # the 1 s grace after the close, not the 60 s lease
    st = r.state()
    assert st[4] == 0  # no lease expired: the closed connection gave them back
    assert r.ask("claim", "held-1", 1)[0] == "err"  # ended, not read


def test_a_killed_senders_arrived_data_stays_readable(receiver) -> None:
    r = receiver(pages=8, lease_seconds=60.0)
    proc, conn = spawn_sender(r, 4)
    try:
        conn.send(("go", "landed-1"))
        assert conn.poll(30) and conn.recv() == ("sent",)
        assert conn.poll(30) and conn.recv() == ("done",)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
    time.sleep(1.5)  # a sleep (window): past the receiver's grace after the close, the data stays
    ok, num_tokens, data = r.ask("claim", "landed-1", 5)
    assert ok == "ok" and num_tokens == 4 * 32
    want = torch.arange(4 * PAGE, dtype=torch.int64).to(torch.uint8)
    assert b"".join(data[i] for i in range(4)) == bytes(want.numpy())
    assert r.wait_fully_free(30)  # the claim gave them back, not the 60 s lease


def test_a_grant_on_a_closed_connection_is_never_written_and_its_pages_come_back(receiver, sender) -> None:
    r = receiver(pages=8, lease_seconds=60.0)
    s, src = sender()
    grant = s.reserve("cut-1", r.addr, keys(4), 128).result(30)
    assert r.state()[2] == 4
    # The connection closes under a live sender (as a network reset would): the sender stops
    # using it, and the receiver gives the pages back after its grace.
    s._loop.call_soon_threadsafe(s._peers.drop, grant.peer, "test: connection reset")
    until(lambda: grant.peer.dropped, 60, "the sender never saw its connection close")
    with pytest.raises(SendError, match="connection to receiver .* closed"):
        s.write(grant, chunks_of(src, 4), notify=True).result(10)
    assert r.wait_fully_free(30), r.state()  # the grace after the close, not the 60 s lease
    assert r.state()[4] == 0
    # A new connection serves the next transfer.
    s.send("after-cut", r.addr, keys(2, 9), chunks_of(src, 2), 64).result(30)
    assert r.ask("claim", "after-cut", 10)[0] == "ok"


def test_unread_transfer_expires_and_cannot_be_read(receiver, sender) -> None:
    r = receiver(lease_seconds=1.0)
    s, src = sender()
    s.send("t", r.addr, keys(2), chunks_of(src, 2), 64).result(30)
    assert r.wait_fully_free(60)
    kind, err, msg = r.ask("claim", "t", 1)
    assert (kind, err) == ("err", "TransferGone") and "lease expired" in msg


def test_proxy_notification_once_per_transfer(receiver, sender) -> None:
    port = free_port()
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{port}")
    try:
        r = receiver(proxy_host="127.0.0.1", proxy_port=port)
        s, src = sender()
        s.send("t", r.addr, keys(3), chunks_of(src, 3), 90).result(30)
        assert pull.poll(30_000)
        note = m.decode(pull.recv(), expect=m.ProxyNotification)
        assert (note.transfer_id, note.num_chunks, note.num_tokens) == ("t", 3, 90)
        assert not pull.poll(300), "more than one notification for one transfer"
    finally:
        pull.close(linger=0)


FRAMES = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda t, v: m.encode(m.AllocRequest(transfer_id=t, sender_id="x", epoch=v, chunk_keys=[b"k"],
                                                   num_tokens=1)), st.text(min_size=1, max_size=5), st.integers(0, 9)),
    st.builds(lambda b: b[:len(b) // 2], st.just(m.encode(m.Hello(
        peer_id="x", agent_name="a", agent_metadata=b"m", fingerprint=fingerprint())))),
    st.just(m.encode(m.DeregisterWorker(instance_id="i", worker_id=0, epoch="e"))),
    st.just(m.encode(m.Hello(peer_id="x", agent_name="a", agent_metadata=b"m", fingerprint=fingerprint(),
                             v=m.PROTOCOL_VERSION + 1))),  # another version
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(FRAMES, min_size=1, max_size=4))
def test_hostile_frames_get_errors_and_change_nothing(shared_receiver, frames) -> None:
    r = shared_receiver
    ctx = zmq.Context.instance()
    for port in (r.init_port, r.alloc_port):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            for f in frames:
                sock.send(f)
                answer = next_answer(sock, 30_000)
                # Every one is refused: garbage, a wrong type or version, or an alloc carrying
                # an epoch this receiver never had.
                assert isinstance(answer, m.ErrorReply), f"no refusal of {f[:40]!r}: {answer!r}"
        finally:
            sock.close(linger=0)
    assert r.state()[1], "a hostile frame left pages reserved"


@pytest.fixture(scope="module")
def shared_receiver():
    p = ReceiverProc(pages=4).start()
    yield p
    p.stop()


def test_oversized_and_multipart_frames_and_then_a_real_transfer(shared_receiver, sender) -> None:
    r = shared_receiver
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{r.alloc_port}")
    try:
        sock.send(b"\x00" * (m.MAX_FRAME_BYTES + 10))
        reply = next_answer(sock, 5000)
        assert isinstance(reply, m.ErrorReply) and "too_large" in reply.message
        sock.send_multipart([b"a", b"b", b"c"])  # dropped with a log line, no reply
        assert next_answer(sock, 300) is None
    finally:
        sock.close(linger=0)
    assert r.state()[3]["bad_frames"] >= 2
    s, src = sender()
    s.send("ok-after", r.addr, keys(2, 5), chunks_of(src, 2), 64).result(30)
    assert r.ask("claim", "ok-after", 10)[0] == "ok"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_sender_and_receiver_use_under_5_percent_of_a_core(receiver) -> None:
    r = receiver()
    proc, conn = spawn_sender(r, 2)
    try:
        conn.send(("go", "warm"))  # connected and one transfer done: the realistic idle state
        assert conn.poll(30) and conn.recv() == ("sent",)
        assert conn.poll(30) and conn.recv() == ("done",)
        assert r.ask("claim", "warm", 10)[0] == "ok"
        time.sleep(0.5)  # a sleep (window): past the fast polling after the claim (FAST_S)
        before = {pid: _cpu_seconds(pid) for pid in (r.pid, proc.pid)}
        time.sleep(5)  # a sleep (window): the idle time measured
        used = {pid: (_cpu_seconds(pid) - t0) / 5 for pid, t0 in before.items()}
    finally:
        proc.kill()
        proc.join(5)
    assert used[r.pid] < 0.05, f"idle receiver used {used[r.pid]:.1%} of a core"
    assert used[proc.pid] < 0.05, f"idle sender used {used[proc.pid]:.1%} of a core"


def test_settings_come_from_the_seed_keys() -> None:
    from kvferry.common.config import load_config
    from kvferry.receiver.kv_receiver import ReceiverError, receiver_config
    from kvferry.sender.kv_sender import sender_config

    cfg = load_config({"enable_pd": True, "pd_role": "receiver", "pd_peer_host": "127.0.0.1",
                       "pd_peer_init_port": [7300, 7301], "pd_peer_alloc_port": [7400, 7401],
                       "pd_proxy_host": "10.0.0.1", "pd_proxy_port": 7500, "pd_lease_seconds": 12.5}, env={})
    rc = receiver_config(cfg, tp_rank=1)
    assert (rc.host, rc.init_port, rc.alloc_port, rc.lease_seconds) == ("127.0.0.1", 7301, 7401, 12.5)
    assert (rc.proxy_host, rc.proxy_port, rc.alloc_timeout) == ("10.0.0.1", 7500, cfg.pd_alloc_timeout)
    with pytest.raises(ReceiverError, match="one per decoder TP rank"):
        receiver_config(cfg, tp_rank=2)
    sc = sender_config(load_config({"pd_handshake_timeout": 2.0}, env={}), "p0")
    assert (sc.handshake_timeout, sc.sender_id) == (2.0, "p0")


def test_closing_a_receiver_ends_waiting_allocs_at_once() -> None:
    """No alloc thread stays blocked for the rest of pd_alloc_timeout after close()."""
    import threading

    from kvferry.buffer.pd_buffer import PDBuffer
    from kvferry.receiver.kv_receiver import KVReceiver, ReceiverConfig

    rx = KVReceiver(ReceiverConfig("127.0.0.1", free_port(), free_port(), alloc_timeout=60),
                    PDBuffer(2 * PAGE, "cpu", PAGE), fingerprint()).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{rx.cfg.alloc_port}")
    try:
        for tid, n in (("fill", 2), ("waits", 1)):
            sock.send(m.encode(m.AllocRequest(transfer_id=tid, sender_id="t", epoch=rx.epoch,
                                              chunk_keys=keys(n, len(tid)), num_tokens=n)))
        assert isinstance(m.decode(sock.recv()), m.AllocResponse)
        until(lambda: rx.buffer.stats().extra["waiting"] >= 1, 60, "an alloc waiting for room", every=0.01)
        assert rx.buffer.stats().extra["waiting"] == 1
        t0 = time.monotonic()
        rx.close()
        assert time.monotonic() - t0 < 30  # not after the waiting alloc's 60 s
        assert not [t for t in threading.enumerate() if t.name.startswith(("kvf-alloc", "kvf-recv"))]
        assert rx.buffer.fully_free()
    finally:
        sock.close(linger=0)


# ---- trust: who gets the pd_buffer's NIXL metadata, and no request reads another's KV ----

SECRET, OTHER = "transfer-test-secret-0123456789", "some-other-cluster-secret-98765"


def raw_socket(port: int, secret_text: str | None) -> zmq.Socket:
    from kvferry.common import zsock
    return zsock.connect(zmq.Context.instance(), zmq.DEALER, trust(secret_text), zsock.tcp("127.0.0.1", port))


def ask(sock: zmq.Socket, msg: m.Msg, timeout: float = 30.0) -> m.Msg | None:
    sock.send(m.encode(msg))
    return next_answer(sock, int(timeout * 1000))


def test_without_the_cluster_secret_a_peer_gets_nothing_and_the_receiver_keeps_serving(receiver, sender) -> None:
    r = receiver(secret=SECRET)
    hello = m.Hello(peer_id="intruder", agent_name="a", agent_metadata=b"m", fingerprint=fingerprint())
    for who in (None, OTHER):
        for port, msg in ((r.init_port, hello), (r.alloc_port, m.AllocRequest(
                transfer_id="x", sender_id="x", epoch=r.epoch, chunk_keys=keys(1), num_tokens=1))):
            sock = raw_socket(port, who)
            try:
                assert ask(sock, msg, 1.5) is None, f"a peer with secret {who!r} got an answer on port {port}"
            finally:
                sock.close(linger=0)
    # A real sender with the wrong secret fails the handshake with a message naming the secret.
    s, src = sender("wrong", trust=trust(OTHER), handshake_timeout=1.0)
    with pytest.raises(HandshakeFailed, match="cluster secret"):
        s.send("t0", r.addr, keys(1), chunks_of(src, 1), 32).result(30)
    assert r.state()[1] and r.state()[3]["handshakes"] == 0 and r.state()[3]["allocs"] == 0
    # The right secret: the transfer works, byte for byte.
    s, src = sender("right", trust=trust(SECRET))
    assert s.send("t1", r.addr, keys(2), chunks_of(src, 2), 64).result(30).sent_chunks == 2
    kind, _, data = r.ask("claim", "t1", 10)
    assert kind == "ok" and data[1] == bytes(src[PAGE:2 * PAGE].numpy())
    # The right raw peer gets the metadata (this is what the others did not get).
    sock = raw_socket(r.init_port, SECRET)
    try:
        assert isinstance(ask(sock, hello), m.Welcome)
    finally:
        sock.close(linger=0)


def test_an_abort_between_alloc_and_write_never_lets_the_late_write_into_another_transfer(receiver, sender) -> None:
    """The proxy aborts transfer A (its client left) after A's pages were reserved and before A's
    WRITE; B then reserves pages. A's late WRITE must not land in B's pages."""
    import threading
    r = receiver(pages=4, lease_seconds=60)
    a, src_a = sender("a")
    b, src_b = sender("b")
    src_a.fill_(0xAA)
    gate, holding = threading.Event(), threading.Event()
    original = a.write

    # On A's loop, between its grant and its write: the loop is held, so the receiver's word that
    # A was dropped is read only after this write was posted (it lands late, in A's own pages).
    # The abort is sent once A holds its grant here: sent earlier, the sender may read the drop
    # with the grant and rightly write nothing, and the late write would not be tested.
    def held_write(*args, **kw):
        holding.set()
        gate.wait(30)
        return original(*args, **kw)

    a.write = held_write
    fa = a.send("A", r.addr, keys(2, 1), chunks_of(src_a, 2), 64)
    assert holding.wait(10), "A never had its grant: nothing was tested"
    assert r.state()[2] == 2, r.state()
    proxy = raw_socket(r.alloc_port, None)  # another connection than A's sender: the proxy's abort
    try:
        abort_acked(proxy, "A", reason="client disconnected")  # it holds before B's alloc
    finally:
        proxy.close(linger=0)
    assert b.send("B", r.addr, keys(2, 2), chunks_of(src_b, 2), 64).result(30).sent_chunks == 2
    gate.set()
    assert fa.result(30).sent_chunks == 2  # A's write went somewhere: into its own, quarantined pages
    # A's notification (after its write landed) ends its quarantine: its 2 pages are free, B's held.
    until(lambda: r.state()[2] == 2, 30, lambda: f"A's notification to free its pages: {r.state()}")
    kind, _, data = r.ask("claim", "B", 10)
    assert kind == "ok"
    for i in range(2):
        assert data[i] == bytes(src_b[i * PAGE:(i + 1) * PAGE].numpy()), f"B's chunk {i} holds another's bytes"
    # A's notification ended the quarantine: every page is back without waiting for the 60 s lease.
    assert r.wait_fully_free(30), r.state()
    assert r.state()[4] == 0, "a lease ended, not A's notification"
    assert r.state()[3]["arrivals"] == 1, "A's aborted write must not be counted as an arrival"
    # A's id is spent: its alloc again is refused.
    sock = raw_socket(r.alloc_port, None)
    try:
        reply = ask(sock, m.AllocRequest(transfer_id="A", sender_id="a", epoch=r.epoch, chunk_keys=keys(1),
                                         num_tokens=1))
        assert isinstance(reply, m.ErrorReply) and reply.code == "duplicate" and "single-use" in reply.message
    finally:
        sock.close(linger=0)


def test_a_final_abort_frees_pages_at_once_only_from_the_connection_that_reserved_them(receiver) -> None:
    r = receiver(pages=4, lease_seconds=60)  # within the test's bounds only an abort can free the pages
    mine, other = raw_socket(r.alloc_port, None), raw_socket(r.alloc_port, None)
    try:
        for tid, closer in (("t1", other), ("t2", mine)):
            reply = ask(mine, m.AllocRequest(transfer_id=tid, sender_id="s", epoch=r.epoch, chunk_keys=keys(4),
                                             num_tokens=4))
            assert isinstance(reply, m.AllocResponse)
            closer.send(m.encode(m.AbortTransfer(transfer_id=tid, generation=reply.generation, final=True)))
            if closer is other:
                time.sleep(0.3)  # a sleep (window): someone else's final abort must not free the pages
                # Someone else's "final" means nothing: a WRITE of t1's sender may still be coming.
                assert r.state()[2] == 0 and r.state()[5]["quarantine"] == 1
                # The sender that reserved them is told, so that it can answer with its own abort.
                told = next_answer(mine, 30_000)
                assert isinstance(told, m.AbortTransfer) and told.transfer_id == tid, told
                mine.send(m.encode(m.AbortTransfer(transfer_id=tid, generation=reply.generation, final=True)))
            until(lambda: r.state()[1], 30, f"{tid}: the sender's own final abort to free the pages at once")
        assert r.state()[4] == 0, "a lease ended, not the sender's own final abort"
    finally:
        mine.close(linger=0)
        other.close(linger=0)
    # A quarantine nobody ends is over at the lease's end (3 s here): the lease, not the other
    # connection's abort, gives the pages back (its buffer counts an expired lease).
    r = receiver(pages=4, lease_seconds=3)
    mine, other = raw_socket(r.alloc_port, None), raw_socket(r.alloc_port, None)
    try:
        reply = ask(mine, m.AllocRequest(transfer_id="t3", sender_id="s", epoch=r.epoch, chunk_keys=keys(2),
                                         num_tokens=2))
        assert isinstance(reply, m.AllocResponse)
        other.send(m.encode(m.AbortTransfer(transfer_id="t3", generation=0)))
        assert r.wait_fully_free(60), r.state()
        assert r.state()[4] == 1, "another connection's abort freed the pages"
    finally:
        mine.close(linger=0)
        other.close(linger=0)


def test_a_hostile_authenticated_peer_leaves_the_table_bounded_and_the_buffer_free(receiver) -> None:
    r = receiver(pages=4, lease_seconds=2, alloc_timeout=0.5, max_waiting_allocs=2, secret=SECRET)
    sock = raw_socket(r.alloc_port, SECRET)
    other = raw_socket(r.alloc_port, SECRET)
    try:
        def alloc(tid: str, n: int, s: zmq.Socket = sock) -> m.Msg | None:
            return ask(s, m.AllocRequest(transfer_id=tid, sender_id="h", epoch=r.epoch, chunk_keys=keys(n),
                                         num_tokens=n))
        # Empty chunk keys: refused, no entry.
        sock.send(m.encode(m.AllocRequest(transfer_id="e", sender_id="h", epoch=r.epoch, chunk_keys=[b"k"],
                                          num_tokens=0)).replace(b"\xaachunk_keys\x91\xc4\x01k",
                                                                  b"\xaachunk_keys\x90"))
        assert sock.poll(30_000) and isinstance(m.decode(sock.recv()), m.ErrorReply)
        # A transfer id twice: the second is refused, and while the first waits for pages too.
        assert isinstance(alloc("d1", 3), m.AllocResponse)
        assert (reply := alloc("d1", 1)).code == "duplicate", reply
        sock.send(m.encode(m.AllocRequest(transfer_id="w", sender_id="h", epoch=r.epoch, chunk_keys=keys(2),
                                          num_tokens=2)))
        other.send(m.encode(m.AllocRequest(transfer_id="w", sender_id="h", epoch=r.epoch, chunk_keys=keys(2),
                                           num_tokens=2)))
        assert other.poll(30_000) and m.decode(other.recv()).code == "duplicate"
        assert sock.poll(30_000) and m.decode(sock.recv()).code == "buffer_full"  # timed out: 0.5 s
        # More waiting allocs than the receiver queues: refused at once.
        for i in range(3):
            sock.send(m.encode(m.AllocRequest(transfer_id=f"q{i}", sender_id="h", epoch=r.epoch,
                                              chunk_keys=keys(2), num_tokens=2)))
        replies = [m.decode(sock.recv()) for _ in range(3) if sock.poll(30_000)]
        assert len(replies) == 3 and all(x.code == "buffer_full" for x in replies)
        assert any("queues" in x.message for x in replies)
        # A generation-0 abort of a live transfer (not the sender's own connection), and an abort
        # before its alloc: that alloc is then refused.
        abort_acked(other, "d1", reason="hostile")
        abort_acked(other, "later", reason="early")  # both hold before the alloc they precede
        told = next_answer(sock, 30_000)  # d1's sender is told of the abort, once
        assert isinstance(told, m.AbortTransfer) and told.transfer_id == "d1" and told.reason == "hostile", told
        assert (reply := alloc("later", 1)).code == "aborted" and "before its alloc" in reply.message
        for i in range(8):  # unique ids, nothing ever written: their leases take the pages back
            alloc(f"n{i}", 1)
    finally:
        sock.close(linger=0)
        other.close(linger=0)
    assert r.wait_fully_free(60), r.state()
    until(lambda: r.state()[5]["live"] == 0, timeout=60, what="the table's sweep of expired transfers")
    sizes = r.state()[5]
    assert sizes["quarantine"] == 0 and sizes["ended"] <= 16384, sizes


def test_the_senders_receiver_table_is_bounded_and_drops_the_least_recently_used(receiver, sender) -> None:
    a, b = receiver(), receiver()
    s, src = sender("bounded", max_receivers=1)
    agents = {}
    for i, (r, again) in enumerate(((a, True), (b, True), (a, True), (a, False))):
        res = s.send(f"t{i}", r.addr, keys(1, i), chunks_of(src, 1), 32).result(30)
        assert res.handshook == again, f"send {i}"
        assert r.ask("claim", f"t{i}", 10)[0] == "ok"
        assert len(s._peers) == 1
        agents[i] = s._peers.cached(r.addr.host, r.addr.init_port).agent
    assert s.counters.handshakes == 3
    # The dropped receivers' NIXL agents were removed from this sender's agent.
    assert not s._call(s._agent.check_remote_metadata, agents[1]), "b's agent outlived its eviction"
    assert s._call(s._agent.check_remote_metadata, agents[3])


def test_an_early_grant_written_in_pieces_is_readable_only_when_notified_and_kept_past_its_lease(
        receiver, sender) -> None:
    """The PD path's shape: pages reserved before the chunks exist, chunks written as they are
    computed, the last write notifies. keep_alive renews the lease while the compute runs longer."""
    r = receiver(pages=4, lease_seconds=1.5)
    s, src = sender("early")
    grant = s.reserve("E", r.addr, keys(4), 4 * 32, keep_alive=True).result(30)
    assert r.state()[2] == 0
    assert s.write(grant, chunks_of(src, 2), 0).result(30).sent_chunks == 2
    kind, name, _ = r.ask("claim", "E", 0.3)
    assert (kind, name) == ("err", "TransferTimeout"), "a piece without the notification must not be readable"
    time.sleep(2.4)  # a sleep (pacing): "compute" past the 1.5 s lease, the sender renews it meanwhile
    res = s.write(grant, chunks_of(src, 2, 2), 2, notify=True).result(30)
    assert res.sent_chunks == 4 and res.bytes == 4 * PAGE and set(res.phases) >= {"alloc", "to_nixl", "write"}
    kind, _, data = r.ask("claim", "E", 10)
    assert kind == "ok"
    for i in range(4):
        assert data[i] == bytes(src[i * PAGE:(i + 1) * PAGE].numpy()), f"chunk {i} differs"
    assert r.wait_fully_free(60), r.state()


def test_a_prepared_write_lands_byte_exact_and_a_write_of_other_chunks_does_not_post_the_preparation(
        receiver, sender) -> None:
    """KVSender.prepare on the grant (sender/prepared.py): the write of the prepared chunks posts
    them; a write of other chunks into the same grant builds its own, and those chunks land."""
    r = receiver(pages=8, lease_seconds=60)
    s, src = sender("prep")
    grant = s.reserve("PR", r.addr, keys(4), 4 * 32).result(30)
    s.prepare(grant, chunks_of(src, 4), 0)
    prep = grant.prepared
    assert prep is not None
    until(lambda: prep.handle is not None, 60, "the NIXL thread made the prepared handle")
    assert s.write(grant, chunks_of(src, 4), 0, notify=True).result(30).bytes == 4 * PAGE
    assert prep.handle is None, "the write did not post the prepared handle"
    kind, _, data = r.ask("claim", "PR", 10)
    assert kind == "ok" and all(data[i] == bytes(src[i * PAGE:(i + 1) * PAGE].numpy()) for i in range(4))
    grant = s.reserve("PS", r.addr, keys(4, 1), 4 * 32).result(30)
    s.prepare(grant, chunks_of(src, 4), 0)
    prep = grant.prepared
    until(lambda: prep.handle is not None, 60, "the NIXL thread made the prepared handle")
    s.write(grant, chunks_of(src, 4, 4), 0, notify=True).result(30)  # chunks 4..7, not the prepared 0..3
    kind, _, data = r.ask("claim", "PS", 10)
    assert kind == "ok" and all(data[i] == bytes(src[(4 + i) * PAGE:(5 + i) * PAGE].numpy()) for i in range(4))
    until(lambda: prep.closed and prep.handle is None, 60, "the unposted handle released at the grant's end")
    with pytest.raises(ValueError, match="not in memory registered"):
        s.prepare(grant, [(16, PAGE)], 0)
    # Prepared before sleep mode, written after: the handle went with the registrations, the
    # descriptors stay right.
    grant = s.reserve("PZ", r.addr, keys(2, 2), 2 * 32).result(30)
    s.prepare(grant, chunks_of(src, 2), 0)
    s.suspend()
    assert grant.prepared.closed and grant.prepared.handle is None
    s.resume()
    s.write(grant, chunks_of(src, 2), 0, notify=True).result(30)
    kind, _, data = r.ask("claim", "PZ", 10)
    assert kind == "ok" and all(data[i] == bytes(src[i * PAGE:(i + 1) * PAGE].numpy()) for i in range(2))
    assert len(s._preps) == 0
    assert r.wait_fully_free(30), r.state()  # the claims gave them back, not the 60 s lease


def test_a_chunk_larger_than_the_receivers_pages_is_refused_before_the_post_and_the_pages_come_back(
        receiver, sender) -> None:
    r = receiver(pages=4, lease_seconds=60)
    s, src = sender("big")
    grant = s.reserve("BIG", r.addr, keys(1), 32).result(30)
    with pytest.raises(SendError, match=f"a {2 * PAGE}-byte chunk does not fit .* {PAGE}-byte pages"):
        s.write(grant, [(src.data_ptr(), 2 * PAGE)], 0, notify=True).result(30)
    assert r.wait_fully_free(30), r.state()  # given back with the refusal, not at the 60 s lease


def test_an_early_grant_released_unwritten_frees_its_pages_at_once_and_one_not_kept_expires(receiver, sender) -> None:
    r = receiver(pages=4, lease_seconds=60)
    s, src = sender("early")
    grant = s.reserve("R", r.addr, keys(4), 4 * 32).result(30)
    s.release(grant, "the request ended")
    assert r.wait_fully_free(30), "an unwritten grant given back must free its pages at once, not at the 60 s lease"
    assert r.state()[4] == 0
    r = receiver(pages=4, lease_seconds=1.0)
    grant = s.reserve("X", r.addr, keys(2), 2 * 32).result(30)
    time.sleep(1.2)  # a sleep (pacing): not kept, the lease runs out and the write is refused
    with pytest.raises(LeaseExpired, match="pd_lease_seconds"):
        s.write(grant, chunks_of(src, 2), 0, notify=True).result(30)
    assert r.wait_fully_free(60), r.state()


def test_a_grant_released_after_its_written_pieces_ended_frees_its_pages_at_once(receiver, sender) -> None:
    """A prompt whose request ended mid-compute: its pieces were written (done), the rest never
    will be. The sender's abort is final, so the pages need not wait out the lease (60 s)."""
    r = receiver(pages=4, lease_seconds=60.0)
    s, src = sender("partial")
    grant = s.reserve("P", r.addr, keys(4), 4 * 32).result(30)
    assert s.write(grant, chunks_of(src, 2), 0).result(30).sent_chunks == 2
    s.release(grant, "the request ended before its prompt was computed")
    assert r.wait_fully_free(30), r.state()  # not at the 60 s lease
    assert r.state()[4] == 0 and r.ask("claim", "P", 0.5)[0] == "err"


def test_a_closed_connection_is_told_from_a_live_one_on_a_reused_descriptor() -> None:
    """ZMQ names only the closed descriptor; a live identity seen on that number (the kernel
    reuses them) gets a probe and is not taken for gone."""
    import asyncio

    import zmq.asyncio

    from kvferry.receiver.conns import ConnWatch

    async def main() -> tuple[list[bytes], bytes, bytes, bytes]:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        gone: list[bytes] = []
        watch = ConnWatch(router, gone.append, grace=0.2)
        runner = asyncio.ensure_future(watch.run())
        a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        idents = []
        for d in (a, b):
            d.connect(f"tcp://127.0.0.1:{port}")
            await d.send(b"hello")
            parts = await router.recv_multipart(copy=False)
            idents.append((parts[0].bytes, parts[0].get(zmq.SRCFD)))
        (ia, fa), (ib, _) = idents
        watch.seen(ia, fa)
        watch.seen(ib, fa)  # as if b's connection had come on a's number after it closed
        a.close(linger=0)
        await until_async(lambda: gone, 60, "the closed connection to be reported")
        probe = await asyncio.wait_for(b.recv(), 60)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        b.close(linger=0)
        router.close(linger=0)
        ctx.term()
        return gone, ia, ib, probe

    gone, ia, ib, probe = asyncio.run(main())
    assert gone == [ia]
    reply = m.decode(probe, expect=m.ErrorReply)
    assert reply.code == "probe" and reply.transfer_id is None


def test_a_connection_whose_first_probe_was_still_delivered_is_found_gone_by_a_later_one() -> None:
    """ZMQ reports a close before its I/O thread ends the identity's pipe: a probe in between is
    delivered, and only a later one finds the identity gone."""
    import asyncio

    import zmq.asyncio

    from kvferry.receiver.conns import ConnWatch

    async def main() -> tuple[list[bytes], bytes, bytes]:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        gone: list[bytes] = []
        # no run(): the close is reported by hand, while the connection is still open
        watch = ConnWatch(router, gone.append, grace=0.1, probes=8)
        a = ctx.socket(zmq.DEALER)
        a.connect(f"tcp://127.0.0.1:{port}")
        await a.send(b"hello")
        parts = await router.recv_multipart(copy=False)
        ia = parts[0].bytes
        watch.seen(ia, parts[0].get(zmq.SRCFD))
        watch.closed(parts[0].get(zmq.SRCFD))
        first = await asyncio.wait_for(a.recv(), 60)  # the first probe reached a live connection
        a.close(linger=0)
        await until_async(lambda: gone, 60, "a later probe to find the closed connection")
        watch.stop()
        router.close(linger=0)
        ctx.term()
        return gone, ia, first

    gone, ia, first = asyncio.run(main())
    assert gone == [ia]
    assert m.decode(first, expect=m.ErrorReply).code == "probe"


def test_receiver_polls_fast_after_a_reservation_then_backs_off_while_the_transfer_is_awaited() -> None:
    """The NIXL thread's pause: 50 us within FAST_S of pages reserved or a notification, then
    doubling to AWAIT_POLL_S while a transfer is still awaited (a prefill step may take seconds,
    and each poll holds the GIL the receiver's ports thread needs), IDLE_POLL_S when none is."""
    from kvferry.receiver.kv_receiver import ACTIVE_POLL_S, AWAIT_POLL_S, IDLE_POLL_S, poll_pause

    assert poll_pause(IDLE_POLL_S, awaited=False, fast=False) == IDLE_POLL_S
    pauses, last = [], IDLE_POLL_S
    for fast in (True,) * 3 + (False,) * 8:  # pages reserved, then nothing arrives for a while
        last = poll_pause(last, awaited=True, fast=fast)
        pauses.append(last)
    assert pauses[:3] == [ACTIVE_POLL_S] * 3 and pauses[-1] == AWAIT_POLL_S
    assert all(b == min(2 * a, AWAIT_POLL_S) for a, b in zip(pauses[2:], pauses[3:], strict=False))
    assert poll_pause(AWAIT_POLL_S, awaited=True, fast=True) == ACTIVE_POLL_S  # a notification: fast again
    assert poll_pause(IDLE_POLL_S, awaited=True, fast=False) == AWAIT_POLL_S  # awaited, no kick: never idle-slow
    assert poll_pause(AWAIT_POLL_S, awaited=False, fast=True) == IDLE_POLL_S  # the last one arrived
