"""The proxy's Prometheus metrics (its own registry: a test can run several proxies in one process).

With `--workers N`, each worker process keeps its values in files of one folder (prometheus-client's
multiprocess mode, switched on in the worker by `multiprocess()` before its metrics are made) and
/metrics, on whichever worker answers it, sums every worker's: counters and histograms add up,
the in-flight gauges too (live workers only), the health and index gauges show the highest.

A series labelled with an instance leaves /metrics when the instance goes (`forget_instance`):
churn of instances must not grow the page or the proxy's memory. prometheus-client's own
multiprocess values cannot drop a series from their files (nor from its list of every value ever
made), so a worker's values are `FileValue`s, written in the same files' format, whose dropped
series are compacted away. The page shows only the instances some worker holds now
(`live_instances`): a dead worker's files keep the counters it wrote.
"""

from __future__ import annotations

import os
import warnings
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client import multiprocess as mp_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.registry import Collector

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ProxyMetrics:
    def __init__(self) -> None:
        self.folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR") if getattr(values.ValueClass, "_multiprocess", False) \
            else None
        self._children: dict[tuple[int, tuple[str, ...]], Counter] = {}
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvferry_proxy_requests", "Client requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("kvferry_proxy_errors", "Errors by kind and instance", ["kind", "instance"], registry=r)
        self.in_flight = Gauge("kvferry_proxy_in_flight", "Requests in flight per instance", ["instance", "role"],
                               registry=r, multiprocess_mode="livesum")
        # --workers N: each worker checks each instance itself, so for up to a health interval they
        # disagree; the lowest, so that /metrics reads 0 as soon as any worker's /health says unhealthy.
        self.healthy = Gauge("kvferry_proxy_instance_healthy", "1 if the instance passes health checks",
                             ["instance", "role", "url"], registry=r, multiprocess_mode="livemin")
        self.prefill = Histogram("kvferry_proxy_prefill_seconds", "Prefill leg (prefiller answer) time",
                                 buckets=_LAT, registry=r)
        self.notifications = Counter("kvferry_proxy_notifications",
                                     "Frames on --proxy-port by result: arrived (a tracked transfer), unknown "
                                     "(no such transfer in flight), bad (not a valid notification)", ["result"],
                                     registry=r)
        self.kv_wait = Histogram("kvferry_proxy_kv_transfer_wait_seconds",
                                 "How long the KV was still on its way after the prefiller answered: from its answer "
                                 "to "
                                 "the decoder's KV-arrived notification, 0 when the notification came first; one "
                                 "sample per transfer that arrived",
                                 buckets=_LAT, registry=r)
        self.decoder_first = Histogram("kvferry_proxy_decoder_first_token_seconds",
                                       "From the decode leg's start to its first chunk", buckets=_LAT, registry=r)
        self.ttft = Histogram("kvferry_proxy_ttft_seconds", "Client time to first token", buckets=_LAT, registry=r)
        self.itl = Histogram("kvferry_proxy_inter_token_seconds", "Gap between streamed chunks", buckets=_LAT,
                             registry=r)
        self.routes = Counter("kvferry_proxy_routing_decisions", "Routing decisions by reason (docs/proxy.md "
                              "\"Routing\")", ["reason"], registry=r)
        self.served = Counter("kvferry_proxy_served", "Prompts by how they were served: disaggregated (a prefill "
                              "leg and a KV transfer), local (the decoder alone, by choice), degraded (the "
                              "decoder alone, as no prefiller was usable) or single (a one-token answer)", ["mode"],
                              registry=r)
        self.degraded = Gauge("kvferry_proxy_degraded", "1 while no prefiller is usable and decoders serve whole "
                              "requests", registry=r, multiprocess_mode="livemax")
        self.predicted_cached = Counter("kvferry_proxy_predicted_cached_tokens",
                                        "Prompt tokens the proxy predicted cached on the instance it chose",
                                        ["instance"], registry=r)
        self.actual_cached = Counter("kvferry_proxy_actual_cached_tokens",
                                     "Prompt tokens the instance reported cached (usage.prompt_tokens_details)",
                                     ["instance"], registry=r)
        self.routed_prompt = Counter("kvferry_proxy_routed_prompt_tokens",
                                     "Prompt tokens of the requests counted in the cached-token counters",
                                     ["instance"], registry=r)
        self.kv_events = Counter("kvferry_proxy_kv_events", "KV cache events by instance and result: applied, "
                                 "replayed, gap, reset (index cleared), bad", ["instance", "result"], registry=r)
        self.index_blocks = Gauge("kvferry_proxy_prefix_index_blocks", "Blocks in an instance's prefix index",
                                  ["instance"], registry=r, multiprocess_mode="livemax")
        self.discovery_rejected = Counter("kvferry_proxy_discovery_rejected", "Discovery entries not used, by "
                                          "reason: unsigned, bad_signature, lease, replayed, expired, version, "
                                          "too_many, key, malformed, model, fingerprint, insecure, duplicate "
                                          "(each key counted once)", ["reason"],
                                          registry=r)
        self.discovery_instances = Gauge("kvferry_proxy_discovery_instances", "Instances in use from discovery",
                                         ["role"], registry=r, multiprocess_mode="livemax")
        self.migrations = Counter("kvferry_proxy_migrations", "Requests moved to another decoder after their "
                                  "decode leg failed mid-stream, by the failure's kind (stream_broken, "
                                  "stream_error, stall, timeout, unreachable, upstream_5xx)", ["reason"], registry=r)
        self.total = Histogram("kvferry_proxy_request_seconds", "Client request total time", buckets=_LAT,
                               registry=r)
        self.dropped_connections = Counter("kvferry_proxy_dropped_connections", "Client connections the front door "
                                           "refused or closed: max_connections (past --max-connections), "
                                           "request_timeout (its request did not arrive within --request-timeout)",
                                           ["reason"], registry=r)
        self.board_full = Counter("kvferry_proxy_board_full", "Instances added while every row of the --workers "
                                  "load board was held: routed, on each worker's own load", registry=r)
        # Every metric with an `instance` label, and its label names (to remove an instance's series).
        self._per_instance: list[tuple[Counter | Gauge, tuple[str, ...]]] = [
            (self.errors, ("kind", "instance")), (self.in_flight, ("instance", "role")),
            (self.healthy, ("instance", "role", "url")), (self.predicted_cached, ("instance",)),
            (self.actual_cached, ("instance",)), (self.routed_prompt, ("instance",)),
            (self.kv_events, ("instance", "result")), (self.index_blocks, ("instance",))]
        # --workers N: the instance labels to show (the router's); "proxy" labels the proxy's own errors.
        self.live_instances: Callable[[], set[str]] | None = None

    def forget_instance(self, iid: str) -> None:
        """Every series labelled `instance=iid` leaves the page (and this process's memory)."""
        for metric, names in self._per_instance:
            labelsets = {tuple(s.labels[n] for n in names) for family in metric.collect() for s in family.samples
                         if s.labels.get("instance") == iid}
            with warnings.catch_warnings():  # multiprocess mode warns that its files keep the value (ours do not)
                warnings.simplefilter("ignore", UserWarning)
                for values_ in labelsets:
                    metric.remove(*values_)
        if FileValue.files is not None:
            FileValue.files.drop(iid)

    def count(self, metric: Counter, *labels: str) -> None:
        """metric.labels(*labels).inc(), the labelled child looked up once (labels() costs a lock
        and a tuple per call, on every request)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        c.inc()

    def render(self) -> bytes:
        if self.folder is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        merged.register(_LiveOnly(mp_metrics.MultiProcessCollector(None, self.folder), self.live_instances))
        return generate_latest(merged)


class _LiveOnly(Collector):
    """The workers' merged series, less those of instances no worker holds (their multiprocess
    files keep them for the workers' lives)."""

    def __init__(self, inner: mp_metrics.MultiProcessCollector, live: Callable[[], set[str]] | None) -> None:
        self.inner, self.live = inner, live

    def collect(self) -> Iterable[Metric]:
        live = None if self.live is None else self.live()
        for family in self.inner.collect():
            if live is not None:
                family.samples = [s for s in family.samples if s.labels.get("instance", "proxy") in live]
            yield family


def observe(hist: Histogram, sample: float) -> None:
    """hist.observe(sample) without its checks (for labelled parents and exemplars: these
    histograms have neither), as observe_all() files it."""
    hist._sum.inc(sample)
    hist._buckets[bisect_left(hist._upper_bounds, sample)].inc(1)


def observe_all(hist: Histogram, samples: Sequence[float]) -> None:
    """hist.observe(s) for every sample, with one locked increment per bucket hit and one for the
    sum, rather than two per sample (a stream's inter-token gaps: one per relayed batch)."""
    if not samples:
        return
    hist._raise_if_not_observable()
    bounds = hist._upper_bounds
    hits: dict[int, int] = {}
    for s in samples:
        i = bisect_left(bounds, s)  # the first bound >= s, as observe()'s `s <= bound` finds it
        hits[i] = hits.get(i, 0) + 1
    hist._sum.inc(sum(samples))
    for i, n in hits.items():
        hist._buckets[i].inc(n)


class LoopValue:
    """prometheus-client's MutexValue without its lock: in the proxy's process every metric
    changes on the event loop's thread (the lock per increment cost ~2% of a request's CPU)."""

    _multiprocess = False

    def __init__(self, typ: str, metric_name: str, name: str, labelnames: Sequence[str],
                 labelvalues: Sequence[str], help_text: str, **kwargs: object) -> None:
        self._value = 0.0
        self._exemplar: object = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: object) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> object:
        return self._exemplar


def one_process() -> None:
    """This process is the whole proxy (--workers 1): its metrics' values take no lock."""
    values.ValueClass = LoopValue


COMPACT_AFTER = 1024  # dropped series in a file before it is rewritten (and at least as many as it keeps)


class _Files:
    """This process's multiprocess files, one per kind of value (prometheus-client's names and
    format: its MultiProcessCollector reads them), whose series of a gone instance can be dropped."""

    def __init__(self, folder: str) -> None:
        self.folder, self.pid = folder, os.getpid()
        self.dicts: dict[str, MmapedDict] = {}
        self.values: dict[str, dict[str, FileValue]] = {}  # file prefix -> key -> its value
        self.dead: dict[str, int] = {}  # file prefix -> keys dropped and still in the file
        self.of_instance: dict[str, list[FileValue]] = {}  # instance label -> its values

    def path(self, prefix: str) -> str:
        return os.path.join(self.folder, f"{prefix}_{self.pid}.db")

    def file(self, prefix: str) -> MmapedDict:
        d = self.dicts.get(prefix)
        if d is None:
            d = self.dicts[prefix] = MmapedDict(self.path(prefix))
            self.values[prefix], self.dead[prefix] = {}, 0
        return d

    def drop(self, iid: str) -> None:
        """The instance's values leave the files (those still held keep counting, in memory only)."""
        for v in self.of_instance.pop(iid, ()):
            if self.values[v.prefix].get(v.key) is v:
                del self.values[v.prefix][v.key]
                self.dead[v.prefix] += 1
            v.dropped = True
        for prefix, dead in self.dead.items():
            if dead > max(COMPACT_AFTER, len(self.values[prefix])):
                self._compact(prefix)

    def _compact(self, prefix: str) -> None:
        """Rewrite the file with the values still kept; renamed over the old one, so a reader gets one or
        the other whole (its temporary name does not end in .db: readers never see it)."""
        tmp = self.path(prefix) + ".new"
        new = MmapedDict(tmp)
        for key, v in self.values[prefix].items():
            new.write_value(key, v.value, v.timestamp)
        os.replace(tmp, self.path(prefix))
        self.dicts[prefix].close()
        self.dicts[prefix], self.dead[prefix] = new, 0


class FileValue:
    """A metric's value in a worker of `--workers N`: prometheus-client's multiprocess value (kept
    in this process's file), which `_Files.drop` can take out of the file."""

    _multiprocess = True
    files: _Files | None = None  # this process's (multiprocess() sets them)

    def __init__(self, typ: str, metric_name: str, name: str, labelnames: Sequence[str],
                 labelvalues: Sequence[str], help_text: str, multiprocess_mode: str = "", **kwargs: object) -> None:
        files = self.files
        assert files is not None, "multiprocess() first"
        self.prefix = f"{typ}_{multiprocess_mode}" if typ == "gauge" else typ
        self.key = mmap_key(metric_name, name, list(labelnames), list(labelvalues), help_text)
        self.value, self.timestamp = files.file(self.prefix).read_value(self.key)
        self.dropped = False
        files.values[self.prefix][self.key] = self
        if "instance" in labelnames:
            files.of_instance.setdefault(labelvalues[list(labelnames).index("instance")], []).append(self)

    def _write(self) -> None:
        if not self.dropped and self.files is not None:
            self.files.file(self.prefix).write_value(self.key, self.value, self.timestamp)

    def inc(self, amount: float) -> None:
        self.value += amount
        self.timestamp = 0.0
        self._write()

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value, self.timestamp = value, timestamp or 0.0
        self._write()

    def set_exemplar(self, exemplar: object) -> None:
        return  # none in multiprocess mode

    def get(self) -> float:
        return self.value

    def get_exemplar(self) -> object:
        return None


def multiprocess(folder: str) -> None:
    """This process's metrics from now on live in `folder`, summed with its peers' on /metrics
    (a worker of `--workers N`, before it makes its ProxyMetrics)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    FileValue.files = _Files(folder)
    values.ValueClass = FileValue


def worker_died(pid: int, folder: str) -> None:
    """A dead worker's live gauges leave /metrics (its counters stay in the totals)."""
    mp_metrics.mark_process_dead(pid, folder)
