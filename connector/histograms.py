"""kvferry's histograms on vLLM's /metrics: what each measures and its buckets.

Each observation is recorded where it happens (engine/pd/producer.py, engine/pd/consumer.py, the
sender's alloc round trip) into a `kvferry.common.samples.Samples`, and travels to vLLM's logger
process as a list under its key (connector/stats.py). The buckets are log-spaced so that one set
reads a GPU's sub-millisecond transfers and a CPU's second-long ones alike (docs/metrics.md).
"""

from __future__ import annotations

# Seconds: 100 µs doubling to 104.9 s (21 bounds): 100 µs .. 1.6 ms holds GPU transfers and loads,
# 1.6 ms .. 1.6 s CPU ones and alloc round trips across hosts, the rest waits that hit a timeout.
SECONDS_BUCKETS: tuple[float, ...] = tuple(round(1e-4 * 2 ** k, 7) for k in range(21))
# Bytes: 4 KiB doubling to 32 GiB (24 bounds): a short prompt of a small model to a long one of a large.
BYTES_BUCKETS: tuple[float, ...] = tuple(float(4096 * 2 ** k) for k in range(24))

# key (the Samples name) -> (Prometheus name, help, buckets)
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "pd_transfer_seconds": (
        "kvferry:pd_transfer_seconds",
        "Prefiller: per transfer sent (and per TP rank), from its first write asked to its notifying write done "
        "(the data and the arrival notice are on the decoder)", SECONDS_BUCKETS),
    "pd_transfer_bytes": (
        "kvferry:pd_transfer_bytes",
        "Prefiller: bytes written into a decoder's pd_buffer per transfer sent (and per TP rank); the sum is "
        "kvferry:pd_sent_bytes_total", BYTES_BUCKETS),
    "pd_alloc_latency_seconds": (
        "kvferry:pd_alloc_latency_seconds",
        "Prefiller: alloc request sent to the decoder's answer (or the timeout), per alloc; the sum and count are "
        "kvferry:pd_alloc_wait_seconds_total and kvferry:pd_alloc_waits_total", SECONDS_BUCKETS),
    "pd_kv_wait_seconds": (
        "kvferry:pd_kv_wait_seconds",
        "Decoder: per request loaded from the pd_buffer (and per TP rank), from its scheduling to its KV's arrival "
        "notice (0 when the KV was there first)", SECONDS_BUCKETS),
    "pd_load_seconds": (
        "kvferry:pd_load_seconds",
        "Decoder: per request loaded (and per TP rank), the copy from the pd_buffer into vLLM's paged KV cache",
        SECONDS_BUCKETS),
    "pd_load_bytes": (
        "kvferry:pd_load_bytes",
        "Decoder: bytes copied from the pd_buffer into vLLM's paged KV cache per request loaded (and per TP rank); "
        "the sum is kvferry:pd_received_bytes_total", BYTES_BUCKETS),
}


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (not empty), nearest rank: for the log line."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]
