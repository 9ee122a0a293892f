"""proxy/metrics.py: its fast paths (observe, observe_all, the lock-free LoopValue) leave every metric
exactly as prometheus-client's own calls do."""

from __future__ import annotations

from prometheus_client import generate_latest, values

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
