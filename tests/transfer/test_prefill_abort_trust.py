"""A transfer the proxy drops while its prompt still computes (the client left): the decoder's pages
come back at once, not when the prefiller's compute step ends nor when the lease runs out. Real
NIXL (UCX) and ZMQ, no vLLM; the leases are long (60 s), so only the sender's own final abort can
free the pages within the tests' bounds (30 s: far from the milliseconds it takes, and from the lease)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

pytest.importorskip("nixl")

from kvferry.buffer.pd_buffer import PDBuffer  # noqa: E402
from kvferry.common import zsock  # noqa: E402
from kvferry.common.config import load_config  # noqa: E402
from kvferry.common.netutil import free_port  # noqa: E402
from kvferry.common.wire import messages as m  # noqa: E402
from kvferry.engine.api import PagedKV, PDConsumer, PDProducer, ReceiverAddr, fingerprint  # noqa: E402
from kvferry.receiver.kv_receiver import KVReceiver, ReceiverConfig  # noqa: E402
from kvferry.sender.errors import AllocFailed, TransferDropped  # noqa: E402
from kvferry.sender.kv_sender import KVSender, SenderConfig  # noqa: E402
from tests.kv_caches import make_caches  # noqa: E402
from tests.polling import until  # noqa: E402
from tests.transfer_helpers import PAGE  # noqa: E402
from tests.transfer_helpers import fingerprint as raw_fingerprint  # noqa: E402

BS, CHUNK, LAYERS, HEADS, HEAD = 16, 32, 2, 2, 64
NBLOCKS = 24
LEASE_S = 60.0
BOUND_S = 30.0  # the pages' return, against a 60 s lease (the step in flight never ends by itself here)


@pytest.fixture
def pair() -> Iterator[tuple[PDProducer, PDConsumer, ReceiverAddr]]:
    cfg = load_config({"chunk_size": CHUNK, "pd_buffer_size": 16 * 16384, "pd_peer_host": "127.0.0.1",
                       "pd_peer_init_port": free_port(), "pd_peer_alloc_port": free_port(),
                       "pd_lease_seconds": LEASE_S, "pd_kv_ready_timeout": 5.0})
    src = PagedKV(make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=1), "cpu")
    dst = PagedKV(make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=2), "cpu")
    fp = fingerprint(src, "drops", CHUNK, "block")
    consumer = PDConsumer(cfg, dst, fp)
    producer = PDProducer(cfg, src, fp, "drops-sender")
    try:
        yield producer, consumer, ReceiverAddr("127.0.0.1", cfg.pd_peer_init_port, cfg.pd_peer_alloc_port)
    finally:
        producer.close()
        consumer.close()


def proxy_abort(alloc_port: int, tid: str) -> None:
    """What the proxy sends when a client leaves (proxy/flows/kv_transfers.py): never final, any generation."""
    ctx = zmq.Context()
    try:
        sock = zsock.connect(ctx, zmq.DEALER, zsock.PLAIN, zsock.tcp("127.0.0.1", alloc_port))
        sock.send(m.encode(m.AbortTransfer(transfer_id=tid, generation=0, reason="client disconnected")))
        sock.close(linger=2000)
    finally:
        ctx.term()


def _grant_of(producer: PDProducer, tid: str):
    outs = list(producer._open[tid].values())
    assert len(outs) == 1 and outs[0].grant is not None
    return outs[0]


def test_trust_a_dropped_prompt_mid_prefill_frees_the_decoders_pages_before_its_step_ends(pair) -> None:
    """A piece was written; the proxy drops the transfer while the next step computes: the pages come
    back within BOUND_S; the next step's piece and the last write are refused, staging comes back."""
    producer, consumer, addr = pair
    tokens = list(range(300, 300 + 128))
    blocks = list(range(8))
    producer.open("D", addr, tokens, 128)
    until(lambda: producer.progress("D", blocks[:4], 64) or producer.counters.pieces == 1, 60, "the first piece")
    out = _grant_of(producer, "D")
    until(lambda: all(w.done() for w in out.writes), 60, "the piece's write done")
    assert not consumer.buffer.fully_free()
    t0 = time.monotonic()
    proxy_abort(addr.alloc_port, "D")
    until(consumer.buffer.fully_free, BOUND_S, "the decoder's pages back while the prompt computes")
    assert time.monotonic() - t0 < BOUND_S
    assert consumer.receiver.table.counters["quarantined"] == 1  # quarantined first: a write could have landed
    assert out.grant.result().cut == "client disconnected"
    producer.progress("D", blocks[:6], 96)  # the step in flight ends: its piece is not written
    assert producer.counters.pieces == 1
    with pytest.raises(TransferDropped, match="dropped it"):
        producer.submit("D", addr, tokens, blocks, 128).result(10)
    until(producer.staging.fully_free, BOUND_S, "the staging pages back")
    assert consumer.buffer.fully_free() and producer.counters.failures == {"aborted": 1}


def test_trust_a_dropped_prompt_before_any_piece_frees_the_pages_and_its_cancel_after(pair) -> None:
    """Granted, nothing written yet (the prompt's first step computes): back at once; the request's
    end (vLLM's abort at the next step) then only gives the staging pages back."""
    producer, consumer, addr = pair
    producer.open("E", addr, list(range(96)), 96)
    out = _grant_of(producer, "E")
    out.grant.result(10)
    assert not consumer.buffer.fully_free()
    proxy_abort(addr.alloc_port, "E")
    until(consumer.buffer.fully_free, BOUND_S, "the decoder's pages back")
    producer.cancel("E")
    until(producer.staging.fully_free, BOUND_S, "the staging pages back")
    assert producer.counters.failures == {}


def test_trust_a_dropped_joint_transfer_is_told_to_every_writer_and_frees_its_pages() -> None:
    """Two prefiller ranks write into one decoder rank's pages (a larger TP): the proxy's abort
    reaches both, each answers final, and the pages come back at once."""
    init, alloc = free_port(), free_port()
    fp = raw_fingerprint()
    rx = KVReceiver(ReceiverConfig(host="127.0.0.1", init_port=init, alloc_port=alloc, lease_seconds=LEASE_S),
                    PDBuffer(8 * PAGE, "cpu", PAGE), fp).start()
    senders = [KVSender(SenderConfig(f"joint-{r}", tp_rank=r), fp) for r in range(2)]
    try:
        for s in senders:
            s.register(torch.zeros(2 * PAGE, dtype=torch.uint8))
        addr = ReceiverAddr("127.0.0.1", init, alloc)
        keys = [b"k0", b"k1"]
        grants = [s.reserve("J", addr, keys, 100, keep_alive=True, share=(2, r)).result(10)
                  for r, s in enumerate(senders)]
        assert rx.buffer.free_pages == 6
        t0 = time.monotonic()
        proxy_abort(alloc, "J")
        until(rx.buffer.fully_free, BOUND_S, "the joint transfer's pages back")
        assert time.monotonic() - t0 < BOUND_S
        assert [g.cut for g in grants] == ["client disconnected"] * 2
        with pytest.raises(TransferDropped):
            senders[0].write(grants[0], [(senders[0]._ranges[0][0], PAGE)]).result(5)
    finally:
        for s in senders:
            s.close()
        rx.close()


def test_trust_a_prompt_dropped_before_its_alloc_is_refused_as_aborted_not_as_an_error(pair, caplog) -> None:
    """The client left before the prefiller scheduled the prompt: the decoder refuses its alloc as
    `aborted` (not a reused id), and the prefiller counts it so and logs no error."""
    producer, consumer, addr = pair
    proxy_abort(addr.alloc_port, "F")
    until(lambda: consumer.receiver.table.status("F") != "pending", 60, "the abort remembered")
    producer.open("F", addr, list(range(64)), 64)
    with caplog.at_level(logging.INFO, logger="kvferry"):
        with pytest.raises(AllocFailed, match="before its alloc") as e:
            producer.submit("F", addr, list(range(64)), list(range(4)), 64).result(10)
    assert e.value.code == "aborted" and producer.counters.failures == {"aborted": 1}
    assert consumer.receiver.counters.refusals == {"aborted": 1}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    until(producer.staging.fully_free, BOUND_S, "the staging pages back")
    assert consumer.buffer.fully_free()
