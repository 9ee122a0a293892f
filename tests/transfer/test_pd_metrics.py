"""The PD path's counters reach Prometheus: every key the pd tier reports is a declared series,
labelled keys fill their label, and gauges are not summed as counters. The end-to-end check on
real servers is test_connector's test_pd_metrics_count_one_transfer_on_both_sides."""

from __future__ import annotations

import inspect
import os
import re
from types import SimpleNamespace

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from kvferry.connector.stats import GAUGES, SERIES, KVFerryPromMetrics, KVFerryStats, deltas
from kvferry.engine.pd import consumer, producer, shared
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
    assert keys <= set(SERIES), keys - set(SERIES)


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
    pytest.importorskip("nixl._api")
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
            assert scrape("kvferry:pd_buffer_free_pages") == 12
            assert scrape("kvferry:pd_transfers_in_flight") == 1
            s.release(grant, "test: not needed")
            until(lambda: scrape("kvferry:pd_buffer_free_pages") == 16, 5, "every page free again", every=0.02)
            assert scrape("kvferry:pd_buffer_free_pages") == 16
            assert scrape("kvferry:pd_transfers_in_flight") == 0
    finally:
        rx.stop()
    assert not os.path.exists(gauge_path(engine_id, 0))  # removed when the receiver stopped
