"""proxy/metrics.py: observe_all() leaves a histogram exactly as one observe() per sample does."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvferry.proxy.metrics import ProxyMetrics, observe_all

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
