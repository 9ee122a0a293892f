"""proxy/metrics.py: its fast paths (observe, observe_all, the lock-free LoopValue) leave every metric
exactly as prometheus-client's own calls do."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client import multiprocess as mp_metrics

from kvferry.proxy import metrics
from kvferry.proxy.metrics import LoopValue, ProxyMetrics, observe, observe_all

# On bounds (observe() puts a sample equal to a bound in that bound's bucket), between them, past
# the last one, zero and negative.
SAMPLES = [0.0, -0.5, 0.001, 0.0010001, 0.0024, 0.0025, 0.7, 1, 59.9, 60, 61, 1e9, 0.003, 0.003]


def itl_lines(m: ProxyMetrics) -> list[str]:
    """The histogram's samples as /metrics shows them (its creation time aside)."""
    return [ln for ln in generate_latest(m.registry).decode().splitlines()
            if ln.startswith("kvferry_proxy_inter_token_seconds") and "_created" not in ln]


def test_observe_all_equals_one_observe_per_sample() -> None:
    each, together = ProxyMetrics(), ProxyMetrics()
    for s in SAMPLES:
        each.itl.observe(s)
    observe_all(together.itl, SAMPLES[:5])
    observe_all(together.itl, SAMPLES[5:])
    observe_all(together.itl, [])
    assert itl_lines(together) == itl_lines(each)
    text = "\n".join(itl_lines(together))
    assert 'kvferry_proxy_inter_token_seconds_bucket{le="0.001"} 3.0' in text
    assert 'kvferry_proxy_inter_token_seconds_bucket{le="60.0"} 12.0' in text
    assert "kvferry_proxy_inter_token_seconds_count 14.0" in text


def test_observe_and_lock_free_values_count_as_prometheus_does(monkeypatch) -> None:
    ref = ProxyMetrics()
    monkeypatch.setattr(values, "ValueClass", LoopValue)  # what one_process() sets in the proxy's process
    fast = ProxyMetrics()
    assert fast.folder is None  # not taken for prometheus-client's multiprocess mode
    assert isinstance(fast.ttft._sum, LoopValue)
    for s in SAMPLES:
        ref.ttft.observe(s)
        observe(fast.ttft, s)
    for m in (ref, fast):
        for _ in range(3):
            m.count(m.requests, "/v1/completions", "200")
        g = m.in_flight.labels("d0", "decoder")
        g.inc()
        g.inc()
        g.dec()
        m.errors.labels("timeout", "d0").inc(2.5)

    def lines(m: ProxyMetrics) -> list[str]:
        return [ln for ln in generate_latest(m.registry).decode().splitlines() if "_created" not in ln]
    assert lines(fast) == lines(ref)
    assert 'kvferry_proxy_ttft_seconds_bucket{le="0.0025"} 6.0' in lines(fast)
    assert 'kvferry_proxy_in_flight{instance="d0",role="decoder"} 1.0' in lines(fast)


def _worker_sets_healthy(folder: str, value: int) -> None:
    metrics.multiprocess(folder)  # what a worker of --workers N does before it makes its metrics
    ProxyMetrics().healthy.labels("d0", "decoder", "http://d0").set(value)


def test_with_workers_an_instance_any_live_worker_finds_unhealthy_reads_0(tmp_path: Path) -> None:
    """Each worker checks health itself, so for a while they disagree: /metrics says unhealthy as
    soon as one (and so one /health answer) does, and a dead worker's view leaves it."""
    pids = []
    for value in (1, 0):
        p = multiprocessing.get_context("fork").Process(target=_worker_sets_healthy, args=(str(tmp_path), value))
        p.start()
        p.join(10)
        assert p.exitcode == 0
        pids.append(p.pid)

    def healthy() -> list[str]:
        reg = CollectorRegistry()
        mp_metrics.MultiProcessCollector(reg, str(tmp_path))
        text = generate_latest(reg).decode()
        return [ln for ln in text.splitlines() if ln.startswith("kvferry_proxy_instance_healthy{")]
    line = 'kvferry_proxy_instance_healthy{instance="d0",role="decoder",url="http://d0"}'
    assert healthy() == [line + " 0.0"]
    metrics.worker_died(pids[1], str(tmp_path))
    assert healthy() == [line + " 1.0"]
