"""The PD path's counters reach Prometheus: every key the pd tier reports is a declared series,
labelled keys fill their label, and gauges are not summed as counters. The end-to-end check on
real servers is test_connector's test_pd_metrics_count_one_transfer_on_both_sides."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from kvferry.connector.stats import GAUGES, SERIES, KVFerryPromMetrics, KVFerryStats, deltas
from kvferry.engine import pd, pd_producer


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
    src = inspect.getsource(pd) + inspect.getsource(pd_producer)
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
