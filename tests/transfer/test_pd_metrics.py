"""The PD path's counters and histograms reach Prometheus: every key the pd tier reports is a
declared series, labelled keys fill their label, gauges are not summed as counters, and each
observation of every TP rank lands in its histogram. The end-to-end checks on real servers are
test_connector's test_pd_metrics_count_one_transfer_on_both_sides and
test_pd_transfer_histograms_count_every_transfer_on_both_sides."""

from __future__ import annotations

import inspect
import math
import os
import re
import threading
from types import SimpleNamespace

import msgspec
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from kvferry.common.samples import Samples
from kvferry.connector.histograms import BYTES_BUCKETS, HISTOGRAMS, SECONDS_BUCKETS
from kvferry.connector.stats import GAUGES, SERIES, KVFerryPromMetrics, KVFerryStats, deltas
from kvferry.engine.pd import consumer, producer, shared
from kvferry.sender import results
from tests.polling import until


class _Registry:
    """prometheus_client's metric classes bound to a registry of this test's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def cls(self, base: type) -> type:
        registry = self.registry

        def make(*args, multiprocess_mode: str | None = None, **kw):
            return base(*args, registry=registry, **kw)
        return make


@pytest.fixture
def prom() -> tuple[KVFerryPromMetrics, CollectorRegistry]:
    r = _Registry()
    types = {prometheus_client.Gauge: r.cls(prometheus_client.Gauge),
             prometheus_client.Counter: r.cls(prometheus_client.Counter),
             prometheus_client.Histogram: r.cls(prometheus_client.Histogram)}
    vc = SimpleNamespace(kv_transfer_config=SimpleNamespace())
    return KVFerryPromMetrics(vc, types, ["engine"], {0: ["0"]}), r.registry


def test_every_pd_stat_key_is_a_declared_series() -> None:
    # The keys the pd tier reports, read from its source: a key with no series would be dropped silently.
    src = "".join(inspect.getsource(mod) for mod in (consumer, producer, shared))
    keys = set(re.findall(r'"(pd_[a-z_]+)(?:\|[^"]*)?"', src)) | set(re.findall(r'f"(pd_[a-z_]+)\|', src))
    assert {"pd_sent", "pd_send_failures", "pd_received", "pd_recomputed", "pd_buffer_free_pages",
            "pd_alloc_wait_seconds", "pd_arrival_wait_seconds"} <= keys
    assert keys <= set(SERIES) | set(HISTOGRAMS), keys - set(SERIES) - set(HISTOGRAMS)


def test_every_histogram_the_pd_tier_records_is_declared_and_every_declared_one_recorded() -> None:
    src = "".join(inspect.getsource(mod) for mod in (consumer, producer))
    recorded = set(re.findall(r'samples\.add\("([a-z_]+)"', src)) | {results.ALLOC_SAMPLES}
    assert recorded == set(HISTOGRAMS)
    assert not {name for name, _, _ in HISTOGRAMS.values()} & {name for name, _, _ in SERIES.values()}


def test_buckets_are_log_spaced_from_100_microseconds() -> None:
    assert SECONDS_BUCKETS[0] == 0.0001 and SECONDS_BUCKETS[-1] > 100  # a GPU's 100 µs to a timeout's minutes
    for b in (SECONDS_BUCKETS, BYTES_BUCKETS):
        ratios = {round(hi / lo, 6) for lo, hi in zip(b, b[1:], strict=False)}
        assert ratios == {2.0}, ratios


def _hist(registry: CollectorRegistry, name: str, engine: str = "0") -> tuple[float | None, float | None]:
    return (registry.get_sample_value(f"{name}_count", {"engine": engine}),
            registry.get_sample_value(f"{name}_sum", {"engine": engine}))


def test_histograms_get_each_observation_of_each_rank(prom) -> None:
    metrics, registry = prom
    # Two TP ranks' reports of one step, joined by vLLM (KVOutputAggregator.aggregate), then sent
    # to the logger process as msgpack (the scheduler's stats): every observation must survive both.
    rank0 = KVFerryStats(data={"pd_sent": 2, "pd_transfer_seconds": [0.00005, 0.003], "pd_transfer_bytes": [4096.0]})
    rank1 = KVFerryStats(data={"pd_sent": 1, "pd_transfer_seconds": [0.5], "pd_transfer_bytes": [8192.0, 100.0]})
    step = rank0.aggregate(rank1)
    metrics.observe(msgspec.msgpack.decode(msgspec.msgpack.encode(step.to_dict())))
    metrics.observe({"pd_transfer_seconds": [200.0], "pd_alloc_latency_seconds": [0.001]})  # the next report
    count, total = _hist(registry, "kvferry:pd_transfer_seconds")
    assert count == 4 and total is not None and math.isclose(total, 0.00005 + 0.003 + 0.5 + 200.0)
    le = {b: registry.get_sample_value("kvferry:pd_transfer_seconds_bucket", {"engine": "0", "le": str(b)})
          for b in (0.0001, 0.0032, 0.8192, 104.8576)}
    assert le == {0.0001: 1, 0.0032: 2, 0.8192: 3, 104.8576: 3}, le
    assert registry.get_sample_value("kvferry:pd_transfer_seconds_bucket", {"engine": "0", "le": "+Inf"}) == 4
    assert _hist(registry, "kvferry:pd_transfer_bytes") == (3, 4096 + 8192 + 100)
    assert _hist(registry, "kvferry:pd_alloc_latency_seconds") == (1, 0.001)
    assert _hist(registry, "kvferry:pd_load_seconds") == (None, None)  # declared, no series until observed
    assert registry.get_sample_value("kvferry:pd_sent_requests_total", {"engine": "0"}) == 3


def test_the_log_line_shows_each_histograms_median_and_highest() -> None:
    a = KVFerryStats(data={"pd_loaded": 1, "pd_load_seconds": [0.002, 0.001]})
    a.aggregate(KVFerryStats(data={"pd_loaded": 1, "pd_load_seconds": [0.004], "pd_kv_wait_seconds": []}))
    assert a.reduce() == {"pd_load_seconds_max": 0.004, "pd_load_seconds_p50": 0.002, "pd_loaded": 2}
    assert KVFerryStats(data={"pd_load_seconds": [], "pd_buffer_free_pages|0": 3}).is_empty()
    assert not KVFerryStats(data={"pd_load_seconds": [0.1], "pd_buffer_free_pages|0": 3}).is_empty()


def test_samples_are_taken_once_from_any_thread_and_bounded() -> None:
    s = Samples(limit=1000)
    threads = [threading.Thread(target=lambda: [s.add("x", 1.0) for _ in range(300)]) for _ in range(4)]
    for t in threads:
        t.start()
    taken: list[float] = []
    while any(t.is_alive() for t in threads):
        taken += s.take().get("x", [])
    for t in threads:
        t.join()
    taken += s.take().get("x", [])
    assert len(taken) + s.dropped == 1200 and len(taken) >= 1000 and s.take() == {}


def test_labelled_counters_and_gauges_reach_prometheus(prom) -> None:
    metrics, registry = prom
    last: dict[str, float] = {}
    first = {"pd_sent": 2, "pd_send_failures|timeout": 1, "pd_buffer_free_pages|0": 3, "pd_buffer_pages|0": 8,
             "pd_alloc_wait_seconds": 0.5, "pd_alloc_waits": 2}
    second = {**first, "pd_sent": 3, "pd_send_failures|buffer_full": 1, "pd_buffer_free_pages|0": 8}
    for now in (first, second):
        stats = KVFerryStats(data=deltas(now, last))
        metrics.observe(stats.reduce())

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert value("kvferry:pd_sent_requests_total") == 3
    assert value("kvferry:pd_send_failures_total", reason="timeout") == 1
    assert value("kvferry:pd_send_failures_total", reason="buffer_full") == 1
    assert value("kvferry:pd_alloc_wait_seconds_total") == 0.5 and value("kvferry:pd_alloc_waits_total") == 2
    assert value("kvferry:pd_buffer_free_pages", rank="0") == 8  # a gauge: the latest, not a sum
    assert value("kvferry:pd_buffer_pages", rank="0") == 8


def test_gauges_from_two_ranks_stay_apart() -> None:
    a = KVFerryStats(data={"pd_buffer_free_pages|0": 4, "pd_sent": 1})
    a.aggregate(KVFerryStats(data={"pd_buffer_free_pages|1": 6, "pd_sent": 1}))
    assert a.data == {"pd_buffer_free_pages|0": 4, "pd_buffer_free_pages|1": 6, "pd_sent": 2}
    assert "pd_buffer_free_pages" in GAUGES and "pd_buffer_pages" in GAUGES


def test_free_pages_and_transfers_in_flight_are_true_when_scraped_between_engine_steps() -> None:
    """A receiver in another process (as vLLM's worker is to its API server) reserves pages; no
    stats reach the metrics object, yet a scrape shows them at once, and again once they are back."""
    pytest.importorskip("nixl")
    import uuid

    import torch

    from kvferry.common.live_gauges import gauge_path
    from kvferry.sender.kv_sender import KVSender, SenderConfig
    from tests.transfer_helpers import PAGE, ReceiverProc, fingerprint

    engine_id = f"test-{uuid.uuid4()}"
    r = _Registry()
    types = {prometheus_client.Gauge: r.cls(prometheus_client.Gauge),
             prometheus_client.Counter: r.cls(prometheus_client.Counter),
             prometheus_client.Histogram: r.cls(prometheus_client.Histogram)}
    vc = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=engine_id),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1))
    KVFerryPromMetrics(vc, types, ["engine"], {0: ["0"]})

    def scrape(name: str) -> float | None:
        return r.registry.get_sample_value(name, {"engine": "0", "rank": "0"})

    rx = ReceiverProc(pages=16, opts={"live_path": gauge_path(engine_id, 0)}).start()
    try:
        assert scrape("kvferry:pd_buffer_free_pages") == 16 and scrape("kvferry:pd_transfers_in_flight") == 0
        with KVSender(SenderConfig("p0"), fingerprint()) as s:
            s.register(torch.zeros(4 * PAGE, dtype=torch.uint8))
            grant = s.reserve("t-live", rx.addr, [bytes([i + 1]) * 8 for i in range(4)], 128).result(30)
            (wait,) = s.samples.take()[results.ALLOC_SAMPLES]  # the alloc round trip's one sample
            assert wait == s.counters.alloc_wait_seconds > 0
            assert scrape("kvferry:pd_buffer_free_pages") == 12
            assert scrape("kvferry:pd_transfers_in_flight") == 1
            s.release(grant, "test: not needed")
            until(lambda: scrape("kvferry:pd_buffer_free_pages") == 16, 5, "every page free again", every=0.02)
            assert scrape("kvferry:pd_buffer_free_pages") == 16
            assert scrape("kvferry:pd_transfers_in_flight") == 0
    finally:
        rx.stop()
    assert not os.path.exists(gauge_path(engine_id, 0))  # removed when the receiver stopped
