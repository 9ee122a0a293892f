"""kvferry's counters in vLLM's stats pipeline: logged with vLLM's "KV Transfer metrics" line and
exported on vLLM's /metrics as ``kvferry:*`` Prometheus series.

Stats travel as flat dicts (``name`` or ``name|label`` -> number) from the scheduler and every
worker to vLLM's logger process; counters are deltas, gauges absolute, and a histogram's key
holds the list of its observations since the last report (connector/histograms.py), so each TP
rank's observations reach Prometheus one by one. docs/metrics.md lists the series.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvferry.common import live_gauges
from kvferry.common.log import get_logger
from kvferry.connector.histograms import HISTOGRAMS, quantile

logger = get_logger(__name__)

GAUGES = ("usage_bytes", "chunks", "pd_buffer_free_pages", "pd_buffer_pages", "pd_transfers_in_flight")

TIER, REASON, RANK = "tier", "reason", "rank"

# name -> (Prometheus name, help, the label a ``name|value`` key fills, if any)
SERIES: dict[str, tuple[str, str, str | None]] = {
    "lookup_tokens": ("kvferry:cache_lookup_tokens", "Prompt tokens looked up in the offload tiers", None),
    "hit_tokens": ("kvferry:cache_hit_tokens", "Prompt tokens loaded from a tier instead of computed", TIER),
    "miss_tokens": ("kvferry:cache_miss_tokens", "Looked-up prompt tokens no tier held", None),
    "unkeyable_requests": ("kvferry:cache_unkeyable_requests", "Prompts with an input kvferry cannot key (a form "
                           "it does not know, or a LoRA adapter it cannot read): neither stored nor looked up", None),
    "hit_chunks": ("kvferry:cache_hit_chunks", "Chunks loaded from a tier", TIER),
    "stored_chunks": ("kvferry:cache_stored_chunks", "Chunks admitted to a tier", TIER),
    "stored_bytes": ("kvferry:cache_stored_bytes", "Bytes admitted to a tier", TIER),
    "evicted_chunks": ("kvferry:cache_evicted_chunks", "Chunks evicted from a tier (LRU)", TIER),
    "evicted_bytes": ("kvferry:cache_evicted_bytes", "Bytes evicted from a tier (LRU)", TIER),
    "rejected_chunks": ("kvferry:cache_rejected_chunks", "Chunks a tier could not take", TIER),
    "retrieved_bytes": ("kvferry:cache_retrieved_bytes", "Bytes copied from the tiers into vLLM's KV cache", None),
    "offloaded_bytes": ("kvferry:cache_offloaded_bytes", "Bytes copied from vLLM's KV cache to host memory", None),
    "load_errors": ("kvferry:cache_load_errors", "Loads that found a chunk missing or corrupt (recomputed)", None),
    "disk_corrupt": ("kvferry:cache_disk_corrupt_files", "Disk chunk files rejected as corrupt or truncated", None),
    "disk_write_errors": ("kvferry:cache_disk_write_errors", "Disk chunk writes that failed", None),
    "remote_errors": ("kvferry:cache_remote_errors", "Remote store calls that failed or timed out (served as misses)",
                      None),
    "remote_put_dropped": ("kvferry:cache_remote_put_dropped", "Chunks not sent to the remote store (queue full or "
                           "store down)", None),
    "remote_corrupt": ("kvferry:cache_remote_corrupt", "Remote values rejected (checksum, shape, layout, length, "
                                                       "format)",
                       None),
    "remote_forged": ("kvferry:cache_remote_forged", "Remote values refused by the cluster-secret MAC (forged, "
                      "untagged, or another key's)", None),
    "remote_get_bytes": ("kvferry:cache_remote_read_bytes", "Bytes read from the remote store", None),
    "p2p_lookup_errors": ("kvferry:p2p_lookup_errors", "Controller lookups that failed or timed out (misses)",
                          None),
    "p2p_read_chunks": ("kvferry:p2p_read_chunks", "Chunks read from peers over NIXL", None),
    "p2p_read_bytes": ("kvferry:p2p_read_bytes", "Bytes read from peers over NIXL", None),
    "p2p_read_seconds": ("kvferry:p2p_read_seconds", "Seconds spent in NIXL reads from peers", None),
    "p2p_errors": ("kvferry:p2p_errors", "Fetches from peers that failed (recomputed)", None),
    "p2p_rejected": ("kvferry:p2p_rejected", "Fetches from peers whose answer or bytes failed a check: counts, "
                     "sizes, addresses, NIXL metadata, names, MAC (recomputed; also in p2p_errors)", None),
    "p2p_served_chunks": ("kvferry:p2p_served_chunks", "Chunks this instance lent to peers", None),
    "p2p_served_bytes": ("kvferry:p2p_served_bytes", "Bytes this instance lent to peers", None),
    "p2p_refused_leases": ("kvferry:p2p_refused_leases", "Leases refused to a peer holding too many already",
                           None),
    "pd_sent": ("kvferry:pd_sent_requests", "Prompts whose KV this prefiller sent to a decoder", None),
    "pd_send_failures": ("kvferry:pd_send_failures", "Prompts whose KV could not be sent (the decoder recomputes), "
                         "by reason", REASON),
    "pd_sent_bytes": ("kvferry:pd_sent_bytes", "Bytes this prefiller wrote into decoders' pd_buffers", None),
    "pd_alloc_wait_seconds": ("kvferry:pd_alloc_wait_seconds", "Seconds prefillers waited for a decoder's pages "
                              "(alloc request to answer); with pd_alloc_waits, the mean wait", None),
    "pd_alloc_waits": ("kvferry:pd_alloc_waits", "Alloc requests answered or timed out", None),
    "pd_sent_early": ("kvferry:pd_sent_early_requests", "Prompts sent into decoder pages reserved when the prompt "
                      "was first scheduled (the alloc round trip hidden behind the compute)", None),
    "pd_sent_pieces": ("kvferry:pd_sent_pieces", "Writes made while a prompt was still computing (chunked "
                       "prefill): only the last piece's transfer is left after the compute", None),
    "pd_received": ("kvferry:pd_received_transfers", "Transfers whose arrival notification this decoder got",
                    None),
    "pd_alloc_refusals": ("kvferry:pd_alloc_refusals", "Alloc requests this decoder refused, by reason (its "
                          "ErrorReply code)", REASON),
    "pd_loaded": ("kvferry:pd_loaded_requests", "Decode requests whose prompt KV was loaded from the pd_buffer",
                  None),
    "pd_recomputed": ("kvferry:pd_recomputed_requests", "Decode requests whose KV did not arrive or could not be "
                      "loaded: recomputed (or failed, with pd_kv_timeout_action: fail), by reason", REASON),
    "pd_kv_timeouts": ("kvferry:pd_kv_timeouts", "Decode requests whose KV did not arrive within "
                       "pd_kv_ready_timeout", None),
    "pd_arrival_wait_seconds": ("kvferry:pd_arrival_wait_seconds", "Seconds decode requests waited for their KV "
                                "(scheduled to loaded); with pd_arrival_waits, the mean wait", None),
    "pd_arrival_waits": ("kvferry:pd_arrival_waits", "Decode requests whose KV wait ended in a load", None),
    "pd_received_bytes": ("kvferry:pd_received_bytes", "Bytes copied from the pd_buffer into vLLM's KV cache", None),
    "pd_buffer_free_pages": ("kvferry:pd_buffer_free_pages", "Free pages of this instance's pd_buffer (a "
                             "prefiller's: its staging pages), by TP rank", RANK),
    "pd_buffer_pages": ("kvferry:pd_buffer_pages", "Pages of this instance's pd_buffer, by TP rank", RANK),
    "pd_transfers_in_flight": ("kvferry:pd_transfers_in_flight", "Transfers this decoder reserved pages for whose "
                               "KV has not arrived yet, by TP rank", RANK),
    "pd_quarantined": ("kvferry:pd_quarantined_transfers", "Aborted transfers whose pages waited for a write that "
                       "might still land", None),
    "pd_bad_frames": ("kvferry:pd_bad_frames", "Malformed frames rejected on the receiver's ports", None),
    "pd_aborts_received": ("kvferry:pd_aborts_received", "Aborts handled on the receiver's alloc port (a sender's, "
                           "the proxy's, a request's that ended)", None),
    "pd_loop_restarts": ("kvferry:pd_loop_restarts", "Times the receiver's NIXL thread failed and was started "
                         "again (its log says why)", None),
    "p2p_loop_restarts": ("kvferry:p2p_loop_restarts", "Times a P2P service loop (heartbeats, reports) failed and "
                          "was started again (its log says why)", None),
    "usage_bytes": ("kvferry:cache_usage_bytes", "Bytes held by a tier", TIER),
    "chunks": ("kvferry:cache_chunks", "Chunks held by a tier", TIER),
}


def deltas(now: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    """Counters since `last` (gauges as they are now); updates `last`."""
    out = {}
    for k, v in now.items():
        if k.partition("|")[0] in GAUGES:
            out[k] = v
        elif v != last.get(k, 0):
            out[k] = v - last.get(k, 0)
    last.update(now)
    return out


class KVFerryStats(KVConnectorStats):
    """One report, or several joined: vLLM joins the TP ranks' (and the scheduler's) with
    `aggregate`, and its logger joins a logging interval's; counters add, gauges take the
    latest, histograms' observation lists join."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            name = k.partition("|")[0]
            if name in HISTOGRAMS:
                self.data[k] = [*self.data.get(k, ()), *v]
            else:
                self.data[k] = v if name in GAUGES else self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The "KV Transfer metrics" log line: counters and gauges, and each histogram's median and
        highest observation in the interval."""
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if k.partition("|")[0] in HISTOGRAMS:
                if v:
                    out[f"{k}_p50"], out[f"{k}_max"] = quantile(v, 0.5), max(v)
            elif v:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k.partition("|")[0] not in GAUGES)


class KVFerryPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        self._warned = False
        for key, (name, doc, label) in SERIES.items():
            cls = self._gauge_cls if key in GAUGES else self._counter_cls
            kw: dict[str, Any] = {"multiprocess_mode": "mostrecent"} if key in GAUGES else {}
            self._metrics[key] = cls(name=name, documentation=doc,
                                     labelnames=labelnames + ([label] if label else []), **kw)
        histogram: Any = self._histogram_cls  # vLLM types it as any of its three metric classes
        for key, (name, doc, buckets) in HISTOGRAMS.items():
            self._metrics[key] = histogram(name=name, documentation=doc, labelnames=labelnames, buckets=list(buckets))
        self._last: dict[tuple[str, str], float] = {}  # gauges as the stats pipeline last told them
        self._read_live(vllm_config)

    def _read_live(self, vllm_config: Any) -> None:
        """The pd_buffer gauges are read from the workers' live files when scraped (see
        common/live_gauges.py); the stats pipeline's last value stands in where none is written.
        Only with one engine (its engine_id names the files) and plain prometheus_client gauges
        (vLLM's multiprocess mode, with several API servers, reads its own files)."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        if ktc is None or not getattr(ktc, "engine_id", None) or len(self.per_engine_labelvalues) != 1:
            return
        tp = vllm_config.parallel_config.tensor_parallel_size
        labels = next(iter(self.per_engine_labelvalues.values()))
        for key in live_gauges.SLOTS:
            for rank in range(tp):
                path = live_gauges.gauge_path(ktc.engine_id, rank)

                def now(key: str = key, rank: str = str(rank), path: str = path) -> float:
                    v = live_gauges.read(path, key)
                    return float(v) if v is not None else self._last.get((key, rank), 0.0)
                try:
                    self._metrics[key].labels(*labels, str(rank)).set_function(now)
                except (AttributeError, ValueError):  # not prometheus_client's Gauge, or multiprocess mode
                    return

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Runs in vLLM's output handler, where an exception stops the server's outputs: never raise.
        try:
            self._observe(transfer_stats_data, engine_idx)
        except Exception as e:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                logger.warning("kvferry metrics not exported: %s: %s", type(e).__name__, e)

    def _observe(self, transfer_stats_data: dict[str, Any], engine_idx: int) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for k, v in transfer_stats_data.items():
            name, _, value = k.partition("|")
            metric = self._metrics.get(name)
            if metric is None:
                continue
            child = metric.labels(*labels, *([value] if value else []))
            if name in HISTOGRAMS:
                for x in v:
                    child.observe(x)
            elif name in GAUGES:
                child.set(v)
                self._last[(name, value)] = v
            elif v > 0:
                child.inc(v)


