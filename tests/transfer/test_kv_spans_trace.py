"""The PD path's trace spans with real parts and no vLLM: a PDProducer writes a prompt into a
PDConsumer's pd_buffer over NIXL (UCX), each under a leg's traceparent, and the spans reach a real
OTLP receiver (http/protobuf here; the proxy's tests use gRPC): the transfer with its reservation
and writes, their bytes equal to the KV sent, the arrival and the load, and a recompute with its
reason."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl")

from kvferry.common.config import load_config  # noqa: E402
from kvferry.common.netutil import free_port  # noqa: E402
from kvferry.engine.api import PagedKV, PDConsumer, PDProducer, ReceiverAddr, fingerprint  # noqa: E402
from kvferry.testing.otlp_receiver import OTLPReceiver, ReceivedSpan  # noqa: E402
from tests.kv_caches import make_caches  # noqa: E402
from tests.polling import until  # noqa: E402

BS, CHUNK, LAYERS, HEADS, HEAD = 16, 32, 2, 2, 64
NBLOCKS = 24
TRACE = "5b8efff798038103d269b633813fc60c"
PREFILL_LEG = f"00-{TRACE}-eee19b7ec3c1b174-01"
DECODE_LEG = f"00-{TRACE}-eee19b7ec3c1b175-01"


@pytest.fixture
def traced_pair():
    with OTLPReceiver() as rx:
        cfg = load_config({"chunk_size": CHUNK, "pd_buffer_size": 16 * 16384, "pd_peer_host": "127.0.0.1",
                           "pd_peer_init_port": free_port(), "pd_peer_alloc_port": free_port(),
                           "pd_lease_seconds": 2.0, "pd_kv_ready_timeout": 1.0,
                           "otlp_traces_endpoint": rx.http_endpoint, "otlp_traces_protocol": "http/protobuf"})
        src = PagedKV(make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=1), "cpu")
        dst = PagedKV(make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=2), "cpu")
        fp = fingerprint(src, "traced", CHUNK, "block")
        consumer = PDConsumer(cfg, dst, fp)
        producer = PDProducer(cfg, src, fp, "traced-sender")
        addr = ReceiverAddr("127.0.0.1", cfg.pd_peer_init_port, cfg.pd_peer_alloc_port)
        try:
            yield producer, consumer, addr, src, rx
        finally:
            producer.close()
            consumer.close()


def _named(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_trace_of_a_transfer_sent_in_pieces_holds_its_reserve_writes_arrival_and_load(traced_pair) -> None:
    producer, consumer, addr, src, rx = traced_pair
    n = 150  # 4 full chunks and one of 22 tokens
    tokens = list(range(100, 100 + n))
    consumer.expect("r", "T", tokens, list(range(10, 20)), n - 1, traceparent=DECODE_LEG)
    producer.open("T", addr, tokens, n, traceparent=PREFILL_LEG)
    until(lambda: producer.progress("T", list(range(4)), 64) or producer.counters.pieces == 1, 10, "the first piece")
    res = producer.submit("T", addr, tokens, list(range(10)), n).result(10)
    until(lambda: consumer.poll(0.05)[0], 10, "the transfer loaded")
    want = {"kv.transfer", "kv.reserve", "kv.write", "kv.arrival", "kv.load"}
    spans = until(lambda: (s := _named(rx.trace(TRACE))).keys() >= want and len(s["kv.write"]) == 2 and s, 15,
                  lambda: f"the KV spans, got {[s.name for s in rx.spans()]}")
    transfer, = spans["kv.transfer"]
    kv_bytes = src.chunk_nbytes("block", CHUNK) * 4 + src.chunk_nbytes("block", 22)
    assert res.bytes == kv_bytes and transfer.attributes["kvferry.kv.bytes"] == kv_bytes
    assert transfer.parent_id == PREFILL_LEG[36:52] and transfer.service == "kvferry-prefiller"
    assert transfer.attributes["kvferry.transfer_id"] == "T" and transfer.attributes["kvferry.kv.tokens"] == n
    assert transfer.attributes["kvferry.kv.reserved_early"] is True
    for child in [*spans["kv.reserve"], *spans["kv.write"]]:
        assert child.parent_id == transfer.span_id and child.start_ns >= transfer.start_ns
        assert child.end_ns <= transfer.end_ns and child.status != 2
    writes = sorted(spans["kv.write"], key=lambda s: s.start_ns)
    assert [w.attributes["kvferry.kv.notify"] for w in writes] == [False, True]
    assert sum(w.attributes["kvferry.kv.bytes"] for w in writes) == kv_bytes
    arrival, = spans["kv.arrival"]
    load, = spans["kv.load"]
    for s in (arrival, load):
        assert s.parent_id == DECODE_LEG[36:52] and s.service == "kvferry-decoder"
        assert s.attributes["kvferry.vllm_request_id"] == "r"
    # The decoder loads one token less than was sent (it computes the prompt's last token itself).
    assert load.attributes["kvferry.kv.bytes"] > 0 and load.attributes["kvferry.kv.tokens"] == n - 1
    assert arrival.attributes["kvferry.kv.arrived_first"] is False  # expected before the prompt was sent
    assert arrival.end_ns <= load.start_ns + 1_000_000


def test_trace_of_a_transfer_that_never_comes_holds_a_recompute_with_its_reason(traced_pair) -> None:
    _, consumer, _, _, rx = traced_pair
    consumer.expect("late", "NEVER", list(range(64)), list(range(4)), 63, traceparent=DECODE_LEG)
    until(lambda: consumer.poll(0.05)[1], 10, "the wait to time out (pd_kv_ready_timeout 1 s)")
    rec = until(lambda: _named(rx.trace(TRACE)).get("kv.recompute"), 15, "the recompute span")[0]
    assert rec.attributes["kvferry.kv.reason"] == "timeout" and rec.attributes["kvferry.transfer_id"] == "NEVER"
    assert rec.status == 2 and rec.parent_id == DECODE_LEG[36:52]
    assert rec.end_ns - rec.start_ns >= 900_000_000  # it waited pd_kv_ready_timeout


def test_no_span_without_a_sampled_traceparent(traced_pair) -> None:
    producer, consumer, addr, _, rx = traced_pair
    tokens = list(range(64))
    consumer.expect("u", "U", tokens, list(range(4)), 63, traceparent=PREFILL_LEG[:-2] + "00")
    producer.open("U", addr, tokens, 64)
    producer.submit("U", addr, tokens, list(range(4)), 64).result(10)
    until(lambda: consumer.poll(0.05)[0], 10, "the transfer loaded")
    consumer.expect("v", "V", tokens, list(range(4, 8)), 63, traceparent=DECODE_LEG)  # one traced: the flush marker
    producer.submit("V", addr, tokens, list(range(4)), 64, traceparent=PREFILL_LEG).result(10)
    until(lambda: consumer.poll(0.05)[0], 10, "the second transfer loaded")
    until(lambda: {"kv.transfer", "kv.load"} <= {s.name for s in rx.spans()}, 15, "the traced transfer's spans")
    assert {s.attributes.get("kvferry.transfer_id") for s in rx.spans()} == {"V"}
