"""Different tensor-parallel sizes on prefiller and decoder for a K/V-head (GQA) model, with real
NIXL and no vLLM (docs/pd.md, "Different TP with K/V heads"): each prefiller rank slices its heads
into every decoder rank it feeds, a decoder rank written by several prefiller ranks reads the
transfer only once all of them notified, every (prefiller rank, decoder rank, layer, token, head)
lands where the decoder's paged cache expects it, and every page comes back, also when one
prefiller rank fails."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import msgspec
import pytest

pytest.importorskip("nixl")

from kvferry.buffer import peering  # noqa: E402
from kvferry.common.wire import messages as m  # noqa: E402
from tests.hetero_helpers import CHUNK, blocks, dying_writer_main, hetero, run_prompt  # noqa: E402
from tests.polling import until  # noqa: E402

# pd_kv_ready_timeout where no test is about it: far, so a busy machine never makes a decoder
# recompute a prompt that is still coming.
READY_S = 60.0


@pytest.mark.parametrize("layout", ["cpu", "flash_nhd"])
def test_hetero_tp2_to_tp1_gqa_two_prefiller_ranks_fill_one_decoder_rank_byte_exact(layout: str) -> None:
    """P TP=2 -> D TP=1, 4 KV heads: both prefiller ranks write their 2 heads into the same pages
    of the one decoder rank (per block and layer in vLLM's CPU layout; per token in flash NHD,
    where heads interleave within a token)."""
    with hetero(2, 1, 4, layout, ready=READY_S) as h:
        assert [len(h.feeds(r)) for r in range(2)] == [1, 1]
        assert [s.share for r in range(2) for _, s in h.feeds(r)] == [(2, 0), (2, 1)]
        n = 90  # two full chunks and one of 26 tokens
        src_blocks, dst_blocks = run_prompt(h, "G21", n)
        assert h.landed(src_blocks, dst_blocks, n - 1) == 2 * 2 * (n - 1) * 4
        joint = h.consumers[0].receiver
        assert joint.counters.arrivals == 1 and joint.joints.sizes() == 0
        until(h.all_free, 60, "every page back on all ranks")
        assert all(not p.counters.failures and p.counters.early == 1 for p in h.producers)


def test_hetero_tp2_to_tp1_the_last_write_posts_descriptors_built_when_the_early_grant_came(monkeypatch) -> None:
    """engine/pd/producer.py prepares each rank's notifying write on its early grant: the write at
    the prompt's end builds no descriptors of its own (sender/prepared.py), and every byte lands."""
    from kvferry.sender import prepared

    built: list[str] = []
    preps: list[object] = []
    real_build, real_prepare = prepared.write_descs, prepared.prepare

    def counted(*a, **kw):
        built.append(threading.current_thread().name)
        return real_build(*a, **kw)

    def prepare(*a, **kw):
        preps.append(real_prepare(*a, **kw))
        return preps[-1]
    monkeypatch.setattr(prepared, "write_descs", counted)
    monkeypatch.setattr(prepared, "prepare", prepare)
    with hetero(2, 1, 4, ready=READY_S) as h:
        n = 80
        src_blocks, dst_blocks = run_prompt(h, "GP", n, pieces=False)
        assert h.landed(src_blocks, dst_blocks, n - 1) == 2 * 2 * (n - 1) * 4
        assert len(preps) == 2 and all(p is not None for p in preps), preps
        # Once per rank, when prepared: the writes built none.
        assert len(built) == 2, f"descriptors built {len(built)} times for two ranks' writes: {built}"
        until(h.all_free, 60, "every page back on all ranks")


def test_hetero_tp1_to_tp2_gqa_one_prefiller_rank_feeds_each_decoder_rank_its_heads() -> None:
    """P TP=1 -> D TP=2, 4 KV heads: the one prefiller rank writes heads 0-1 into decoder rank 0's
    pages and heads 2-3 into rank 1's, each in the decoder rank's own (half-size) chunk format."""
    with hetero(1, 2, 4, ready=READY_S) as h:
        assert [(d.init_port, s.share) for d, s in h.feeds(0)] == [(a.init_port, (1, 0)) for a in h.addrs]
        assert h.producers[0].fp.page_bytes == 2 * h.consumers[0].fp.page_bytes
        n = 70
        src_blocks, dst_blocks = run_prompt(h, "G12", n)
        assert h.landed(src_blocks, dst_blocks, n - 1) == 2 * 2 * (n - 1) * 4
        until(h.all_free, 60, "every page back on all ranks")
        sent = h.producers[0].sender.counters.bytes
        # every byte once: what travelled is what the two decoder ranks' chunks hold
        assert sent == 2 * sum(h.consumers[0].kv.chunk_nbytes("block", min(CHUNK, n - s)) for s in range(0, n, CHUNK))


def test_hetero_tp4_to_tp2_replicated_heads_each_head_sent_once_by_one_holder() -> None:
    """2 KV heads over prefiller TP=4 (each head replicated on 2 ranks) -> decoder TP=2 (one head
    each): each decoder rank gets its head from exactly one of its holders; ranks 1 and 2 send
    nothing."""
    with hetero(4, 2, 2, ready=READY_S) as h:
        assert [[(h.addrs.index(a), s.share) for a, s in h.feeds(r)] for r in range(4)] == \
            [[(0, (1, 0))], [], [], [(1, (1, 0))]]
        n = 40
        src_blocks, dst_blocks = run_prompt(h, "R42", n, pieces=False)
        assert h.landed(src_blocks, dst_blocks, n - 1) == 2 * 2 * (n - 1) * 1 * 2  # K/V, layers, tokens, head, ranks
        assert [p.counters.sent for p in h.producers] == [1, 0, 0, 1]
        until(h.all_free, 60, "every page back on all ranks")


def test_hetero_tp1_to_tp2_replicated_single_head_reaches_both_decoder_ranks() -> None:
    """1 KV head, P TP=1 -> D TP=2: both decoder ranks hold (a replica of) head 0, and each gets it."""
    with hetero(1, 2, 1, ready=READY_S) as h:
        n = 50
        src_blocks, dst_blocks = run_prompt(h, "R12", n)
        assert h.landed(src_blocks, dst_blocks, n - 1) == 2 * 2 * (n - 1) * 1 * 2  # K/V, layers, tokens, head, ranks
        until(h.all_free, 60, "every page back on all ranks")


def test_hetero_tp2_to_tp1_one_prefiller_rank_never_comes_decoder_stops_waiting_and_frees() -> None:
    """Rank 0 writes and notifies, rank 1 never allocs (its worker died): the transfer is never
    readable (half its heads are missing), the decoder's wait is bounded (the 1.5 s lease ends it,
    no renewal after rank 0's last write, long before the 60 s pd_kv_ready_timeout) and it
    recomputes; every page comes back; a late alloc of rank 1 is refused."""
    with hetero(2, 1, 4, lease=1.5, ready=READY_S) as h:
        n = 64
        tokens = list(range(n))
        h.consumers[0].expect("r", "F1", tokens, blocks(2, 4), n - 1)
        (addr, s), = h.feeds(0)
        h.producers[0].open("F1", addr, tokens, n, s)
        assert h.producers[0].submit("F1", addr, tokens, blocks(1, 4), n, s).result(10).sent_chunks == 2
        t0 = time.monotonic()
        assert h.consumers[0].poll(0.3) == (set(), set()), "read before prefiller rank 1 wrote its heads"
        assert until(lambda: h.consumers[0].poll(0.05)[1], 60, "the decoder gives up") == {"r"}
        assert time.monotonic() - t0 < 30, "the decoder's wait must be bounded by the lease"
        # The transfer ended (its lease), not the decoder's own 60 s wait.
        assert h.consumers[0].counters.recomputed == {"ended": 1}, h.consumers[0].counters
        until(h.all_free, 60, "every page back on all ranks")
        (addr1, s1), = h.feeds(1)
        late = h.producers[1].submit("F1", addr1, tokens, blocks(1, 4), n, s1)
        with pytest.raises(Exception, match="ended|already|aborted"):
            late.result(10)
        until(h.all_free, 60, "every page back after the late alloc's refusal")


def test_hetero_tp2_to_tp1_one_prefiller_rank_fails_mid_prefill_decoder_recomputes_at_once() -> None:
    """Both ranks reserve; rank 1's request ends mid-prefill (its abort): the transfer ends for both
    writers at once, the decoder stops waiting, and the pages come back once rank 0's last write
    landed (every writer settled), without waiting for the lease."""
    with hetero(2, 1, 4, lease=120.0, ready=120.0) as h:
        n = 64
        tokens = list(range(5, 5 + n))
        h.consumers[0].expect("r", "F2", tokens, blocks(2, 4), n - 1)
        for r, p in enumerate(h.producers):
            (addr, s), = h.feeds(r)
            p.open("F2", addr, tokens, n, s)
        until(lambda: h.consumers[0].receiver.table.status("F2") == "pending" and
              h.consumers[0].receiver.joints.sizes() == 1 and
              all(out.grant is not None and out.grant.done() for p in h.producers
                  for out in p._open["F2"].values()), 60, "both ranks' grants")
        t0 = time.monotonic()
        h.producers[1].cancel("F2")
        (addr, s), = h.feeds(0)
        res = h.producers[0].submit("F2", addr, tokens, blocks(1, 4), n, s)
        res.exception(30)  # done either way: its write landed in pages nobody reads, or was refused
        assert until(lambda: h.consumers[0].poll(0.05)[1], 30, "the decoder gives up") == {"r"}
        assert h.consumers[0].counters.recomputed == {"ended": 1}, h.consumers[0].counters  # not its 120 s wait
        until(h.all_free, 30, "every page back without waiting for the 120 s lease")
        assert time.monotonic() - t0 < 30


def test_hetero_tp2_to_tp1_a_prefiller_rank_process_dies_decoder_recomputes_and_pages_come_back() -> None:
    """Both ranks reserved; rank 1's process dies without a word (its worker crashed): once its
    connection is seen closed (a 1 s grace) the transfer ends for both, the decoder recomputes at
    once, and the pages come back when rank 0's last write landed, long before the 120 s lease."""
    with hetero(2, 1, 4, lease=120.0, ready=120.0) as h:
        n = 64
        tokens = list(range(9, 9 + n))
        h.consumers[0].expect("r", "F3", tokens, blocks(2, 4), n - 1)
        (addr, s0), = h.feeds(0)
        (_, s1), = h.feeds(1)
        h.producers[0].open("F3", addr, tokens, n, s0)
        rx = h.consumers[0].receiver
        until(lambda: rx.table.status("F3") == "pending" and rx.joints.sizes() == 1, 60, "rank 0's grant")
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=dying_writer_main, args=(
            theirs, (addr.host, addr.init_port, addr.alloc_port), msgspec.msgpack.encode(h.producers[1].fp), "F3",
            2, n, s1.share), daemon=True)
        proc.start()
        try:
            assert mine.poll(30) and mine.recv() == "reserved"
            t0 = time.monotonic()
            mine.send("die")
            proc.join(30)
            assert until(lambda: h.consumers[0].poll(0.05)[1], 30, "the decoder gives up") == {"r"}
            assert h.consumers[0].counters.loaded == 0
            assert h.consumers[0].counters.recomputed == {"ended": 1}, h.consumers[0].counters  # not its 120 s wait
            h.producers[0].submit("F3", addr, tokens, blocks(1, 4), n, s0).exception(30)
            until(h.all_free, 30, "every page back without waiting for the 120 s lease")
            assert time.monotonic() - t0 < 30
        finally:
            if proc.is_alive():
                proc.kill()


def test_hetero_tp_handshake_accepts_a_slicing_sender_and_still_refuses_another_model() -> None:
    base = m.LayoutFingerprint(model="x", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
                               block_size=16, kv_layout="cpu:[blocks,kv_heads,block_size,2*head_size]",
                               chunk_format="block", chunk_size=32, tp_size=2, page_bytes=100,
                               total_kv_heads=4, slices=True)
    dec = m.LayoutFingerprint(**{**{f: getattr(base, f) for f in base.__struct_fields__},
                                 "num_kv_heads": 4, "tp_size": 1, "page_bytes": 200, "slices": False})
    roles = ("receiver", "sender")
    assert peering.layout_error(roles, ("d", "p"), dec, base) is None
    assert peering.layout_error(("sender", "receiver"), ("p", "d"), base, dec) is None
    # Without slicing (an older prefiller) the TP mismatch is refused, naming the fix.
    no_slice = m.LayoutFingerprint(**{**{f: getattr(base, f) for f in base.__struct_fields__}, "slices": False})
    err = peering.layout_error(roles, ("d", "p"), dec, no_slice)
    assert err and "tp_size: 1 != 2" in err and "--tensor-parallel-size" in err
    # P2P never slices: a TP mismatch there stays refused.
    assert peering.layout_error(("reader", "holder"), ("a", "b"), dec, base)
    for field, value, fix in (("model", "y", "same model"), ("dtype", "float16", ""), ("num_layers", 3, ""),
                              ("head_size", 128, ""), ("total_kv_heads", 8, "same model")):
        other = m.LayoutFingerprint(**{**{f: getattr(base, f) for f in base.__struct_fields__}, field: value})
        err = peering.layout_error(roles, ("decoder-1", "prefiller-0"), dec, other)
        assert err and f"{field}: " in err and "decoder-1" in err and "prefiller-0" in err and fix in err, err
