"""The pd tier's send-while-computing path with real parts and no vLLM: a PDProducer writes a
prompt's chunks into a PDConsumer's pd_buffer over NIXL (UCX) as a chunked prefill would compute
them, and the consumer loads them into its own paged cache."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

pytest.importorskip("nixl")

from kvferry.common.config import load_config  # noqa: E402
from kvferry.common.netutil import free_port  # noqa: E402
from kvferry.engine.api import PagedKV, PDConsumer, PDProducer, ReceiverAddr, fingerprint  # noqa: E402
from tests.kv_caches import make_caches  # noqa: E402
from tests.polling import until  # noqa: E402

BS, CHUNK, LAYERS, HEADS, HEAD = 16, 32, 2, 2, 64
NBLOCKS = 24


@contextlib.contextmanager
def make_pair(lease: float):
    # pd_kv_ready_timeout far: no test here is about the decoder giving up, and a busy machine
    # must not make it recompute a prompt that is still coming.
    cfg = load_config({"chunk_size": CHUNK, "pd_buffer_size": 16 * 16384, "pd_peer_host": "127.0.0.1",
                       "pd_peer_init_port": free_port(), "pd_peer_alloc_port": free_port(),
                       "pd_lease_seconds": lease, "pd_kv_ready_timeout": 60.0})
    src_caches = make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=1)
    dst_caches = make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=2)
    src, dst = PagedKV(src_caches, "cpu"), PagedKV(dst_caches, "cpu")
    fp = fingerprint(src, "pieces", CHUNK, "block")
    consumer = PDConsumer(cfg, dst, fp)
    producer = PDProducer(cfg, src, fp, "pieces-sender")
    addr = ReceiverAddr("127.0.0.1", cfg.pd_peer_init_port, cfg.pd_peer_alloc_port)
    try:
        yield producer, consumer, addr, src, src_caches, dst_caches
    finally:
        producer.close()
        consumer.close()


@pytest.fixture
def pair():
    with make_pair(2.0) as p:  # a short lease: the prompt that computes past it keeps its pages
        yield p


@pytest.fixture
def long_lease_pair():
    with make_pair(60.0) as p:  # a lease far from the tests' bounds: only an abort frees pages within them
        yield p


def rows(caches: list[torch.Tensor], blocks: list[int], n: int) -> list[bytes]:
    """Each of the first `n` tokens' K/V bytes in every layer ("cpu" layout: blocks, heads, slot, 2*head)."""
    return [bytes(t[blocks[i // BS], :, i % BS, :].contiguous().view(torch.uint8).numpy())
            for t in caches for i in range(n)]


def test_a_prompt_sent_in_pieces_while_it_computes_arrives_byte_exact_and_frees_every_page(pair) -> None:
    producer, consumer, addr, src, src_caches, dst_caches = pair
    n = 150  # 4 full chunks and one of 22 tokens
    tokens = list(range(100, 100 + n))
    src_blocks = torch.randperm(NBLOCKS, generator=torch.Generator().manual_seed(3))[:10].tolist()
    dst_blocks = torch.randperm(NBLOCKS, generator=torch.Generator().manual_seed(4))[:10].tolist()
    consumer.expect("r", "T", tokens, dst_blocks, n - 1)  # the decoder computes the last token itself
    producer.open("T", addr, tokens, n)
    # Step 1 computed 64 tokens (two chunks), in the blocks allocated so far; the grant may still
    # be on its way, so the step is retried until its piece went out.
    until(lambda: producer.progress("T", src_blocks[:4], 64) or producer.counters.pieces == 1, 60, "the first piece")
    first_piece = time.monotonic()
    producer.progress("T", src_blocks[:6], 90)  # step 2: chunk 2 is not complete yet
    assert producer.counters.pieces == 1
    assert consumer.poll() == (set(), set()), "pieces without the notification must not be loadable"
    producer.progress("T", src_blocks[:8], 128)  # step 3: chunks 2 and 3
    assert producer.counters.pieces == 2
    computing = time.monotonic() - first_piece  # the rest of the "prefill", after the first piece went out
    res = producer.submit("T", addr, tokens, src_blocks, n).result(10)
    assert res.sent_chunks == 5 and res.bytes == src.chunk_nbytes("block", CHUNK) * 4 + src.chunk_nbytes("block", 22)
    loaded = until(lambda: consumer.poll(0.05)[0], 60, "the transfer loaded")
    assert loaded == {"r"}
    want = rows(src_caches, src_blocks, n - 1)
    assert rows(dst_caches, dst_blocks, n - 1) == want, "the decoder's KV differs from the prefiller's"
    assert producer.counters.early == 1 and producer.counters.sent == 1 and not producer.counters.failures
    # One observation each in the histograms (connector/histograms.py): the transfer's time runs from
    # its first piece's write, so it holds the compute after it; its bytes are all the pieces'.
    sent: dict[str, list[float]] = {}
    until(lambda: sent.update(producer.samples.take()) or "pd_transfer_seconds" in sent, 60, "the send's samples")
    assert sent["pd_transfer_seconds"][0] >= computing and len(sent["pd_transfer_seconds"]) == 1
    assert sent["pd_transfer_bytes"] == [producer.counters.sent_bytes] == [res.bytes]
    assert sent["pd_alloc_latency_seconds"] == [producer.sender.counters.alloc_wait_seconds]
    got = consumer.samples.take()
    assert got["pd_load_bytes"] == [consumer.counters.received_bytes] and len(got["pd_load_seconds"]) == 1
    assert 0 <= got["pd_kv_wait_seconds"][0] <= consumer.counters.arrival_wait_seconds
    until(lambda: producer.staging.fully_free() and consumer.buffer.fully_free(), 60, "every page back")


def test_a_prompt_whose_request_ends_mid_prefill_gives_back_staging_and_decoder_pages_at_once(
        long_lease_pair) -> None:
    producer, consumer, addr, *_ = long_lease_pair
    tokens = list(range(64 * 2))
    blocks = list(range(8))
    producer.open("C", addr, tokens, 128)
    until(lambda: producer.progress("C", blocks[:4], 64) or producer.counters.pieces == 1, 60, "the first piece")
    until(lambda: producer.counters.pieces_done == 1, 60, "the piece's write to end DONE")
    t0 = time.monotonic()
    producer.cancel("C")
    until(producer.staging.fully_free, 30, "the staging pages back")
    # A piece was written, and its write ended DONE before the grant was given back: no write
    # can land any more, so the sender's abort is final and the decoder's pages come back at
    # once, not when the 60 s lease ends (sender/grants.py, nothing_in_flight).
    until(consumer.buffer.fully_free, 30, "the decoder's pages back at once")
    assert time.monotonic() - t0 < 30
    assert consumer.buffer.stats().leases_expired == 0
    assert consumer.receiver.table.counters["quarantined"] == 0
    assert producer.counters.sent == 0


def test_a_prompt_computing_longer_than_the_lease_keeps_its_pages_and_arrives(pair) -> None:
    producer, consumer, addr, src, src_caches, dst_caches = pair
    n = 100
    tokens = list(range(7, 7 + n))
    blocks = list(range(7))
    consumer.expect("k", "K", tokens, blocks, n - 1)
    producer.open("K", addr, tokens, n)
    t0 = time.monotonic()
    done = 0
    while time.monotonic() - t0 < 3.5:  # steps of a slow chunked prefill, past the 2 s lease
        done = min(done + 8, n - 1)
        producer.progress("K", blocks, done)
        time.sleep(0.25)  # a sleep (pacing): a slow prefill's steps
    assert producer.counters.pieces >= 1
    assert producer.submit("K", addr, tokens, blocks, n).result(10).sent_chunks == 4
    assert until(lambda: consumer.poll(0.05)[0], 60, "the transfer loaded") == {"k"}
    assert rows(dst_caches, blocks, n - 1) == rows(src_caches, blocks, n - 1)
    assert producer.counters.early == 1 and not producer.counters.failures


def test_mla_prompt_sent_in_pieces_arrives_byte_exact(tmp_path) -> None:
    """The MLA layout (one latent per token per layer, no heads) through the same producer, NIXL
    write and consumer: the decoder's latent rows equal the prefiller's."""
    cfg = load_config({"chunk_size": CHUNK, "pd_buffer_size": 16 * 16384, "pd_peer_host": "127.0.0.1",
                       "pd_peer_init_port": free_port(), "pd_peer_alloc_port": free_port(),
                       "pd_lease_seconds": 2.0, "pd_kv_ready_timeout": 60.0})
    latent = 72  # elements per token (kv_lora_rank + qk_rope_head_dim of a small model)
    src_caches = make_caches("mla", LAYERS, NBLOCKS, BS, 1, latent, torch.bfloat16, seed=1)
    dst_caches = make_caches("mla", LAYERS, NBLOCKS, BS, 1, latent, torch.bfloat16, seed=2)
    src, dst = PagedKV(src_caches, "mla"), PagedKV(dst_caches, "mla")
    fp = fingerprint(src, "pieces-mla", CHUNK, "block")
    assert fp.kv_kind == "mla" and fp.num_kv_heads == 1 and fp.page_bytes == LAYERS * CHUNK * latent * 2
    consumer = PDConsumer(cfg, dst, fp)
    producer = PDProducer(cfg, src, fp, "pieces-mla-sender")
    addr = ReceiverAddr("127.0.0.1", cfg.pd_peer_init_port, cfg.pd_peer_alloc_port)
    try:
        n = 90
        tokens = list(range(300, 300 + n))
        src_blocks = torch.randperm(NBLOCKS, generator=torch.Generator().manual_seed(5))[:6].tolist()
        dst_blocks = torch.randperm(NBLOCKS, generator=torch.Generator().manual_seed(6))[:6].tolist()
        consumer.expect("m", "M", tokens, dst_blocks, n - 1)
        producer.open("M", addr, tokens, n)
        until(lambda: producer.progress("M", src_blocks[:4], 64) or producer.counters.pieces == 1, 60,
              "the first piece")
        assert producer.submit("M", addr, tokens, src_blocks, n).result(10).sent_chunks == 3
        assert until(lambda: consumer.poll(0.05)[0], 60, "the transfer loaded") == {"m"}

        def latent_rows(caches: list[torch.Tensor], blocks: list[int]) -> list[bytes]:
            return [bytes(t[blocks[i // BS], i % BS].contiguous().view(torch.uint8).numpy())
                    for t in caches for i in range(n - 1)]
        assert latent_rows(dst_caches, dst_blocks) == latent_rows(src_caches, src_blocks)
        until(lambda: producer.staging.fully_free() and consumer.buffer.fully_free(), 60, "every page back")
    finally:
        producer.close()
        consumer.close()


def test_mla_hetero_tp1_to_tp2_one_prefiller_rank_feeds_both_decoder_ranks() -> None:
    """P TP=1 -> D TP=2 for MLA: the prefiller rank opens the prompt for both decoder ranks'
    receivers (the connector does this for d % P == r), pieces and the last write go to both, and
    each decoder rank's cache gets the same latent rows; every page comes back on all three."""
    latent = 72
    ports = [(free_port(), free_port()) for _ in range(2)]
    cfg = load_config({"chunk_size": CHUNK, "pd_buffer_size": 16 * 16384, "pd_peer_host": "127.0.0.1",
                       "pd_peer_init_port": [i for i, _ in ports], "pd_peer_alloc_port": [a for _, a in ports],
                       "pd_lease_seconds": 2.0, "pd_kv_ready_timeout": 60.0})
    src_caches = make_caches("mla", LAYERS, NBLOCKS, BS, 1, latent, torch.bfloat16, seed=1)
    dsts = [make_caches("mla", LAYERS, NBLOCKS, BS, 1, latent, torch.bfloat16, seed=2 + r) for r in range(2)]
    src = PagedKV(src_caches, "mla")
    fp = fingerprint(src, "hetero-mla", CHUNK, "block", tp_size=1)
    consumers = [PDConsumer(cfg, PagedKV(dsts[r], "mla"), fingerprint(PagedKV(dsts[r], "mla"), "hetero-mla",
                                                                          CHUNK, "block", tp_size=2), r)
                 for r in range(2)]
    producer = PDProducer(cfg, src, fp, "hetero-mla-sender")
    addrs = [ReceiverAddr("127.0.0.1", i, a) for i, a in ports]
    try:
        n = 90
        tokens = list(range(500, 500 + n))
        src_blocks = torch.randperm(NBLOCKS, generator=torch.Generator().manual_seed(7))[:6].tolist()
        dst_blocks = [torch.randperm(NBLOCKS, generator=torch.Generator().manual_seed(8 + r))[:6].tolist()
                      for r in range(2)]
        for r in range(2):
            consumers[r].expect(f"h{r}", "H", tokens, dst_blocks[r], n - 1)
            producer.open("H", addrs[r], tokens, n)
        until(lambda: producer.progress("H", src_blocks[:4], 64) or producer.counters.pieces == 2, 60,
              "the first piece to both decoder ranks")
        for r in range(2):
            assert producer.submit("H", addrs[r], tokens, src_blocks, n).result(10).sent_chunks == 3
        for r in range(2):
            assert until(lambda r=r: consumers[r].poll(0.05)[0], 60, f"rank {r} loaded") == {f"h{r}"}

        def latent_rows(caches: list[torch.Tensor], blocks: list[int]) -> list[bytes]:
            return [bytes(t[blocks[i // BS], i % BS].contiguous().view(torch.uint8).numpy())
                    for t in caches for i in range(n - 1)]
        want = latent_rows(src_caches, src_blocks)
        for r in range(2):
            assert latent_rows(dsts[r], dst_blocks[r]) == want, f"decoder rank {r}: latent differs"
        assert producer.counters.sent == 2 and not producer.counters.failures
        until(lambda: producer.staging.fully_free() and all(c.buffer.fully_free() for c in consumers), 60,
              "every page back")
    finally:
        producer.close()
        for c in consumers:
            c.close()
