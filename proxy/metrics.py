"""The proxy's Prometheus metrics: values kept by this module, exposed through prometheus-client's
documented collector API (`generate_latest` over a custom `Collector`) and, with `--workers N`,
its multiprocess files and `MultiProcessCollector`.

Why its own values rather than prometheus-client's metric classes: every value here changes on
the event loop's one thread, so it needs no lock (prometheus-client takes one per increment, on
every request); and a series labelled with an instance must leave the page, and
this process's memory and files, when the instance goes (`forget_instance`): instance churn must
not grow /metrics. prometheus-client's multiprocess values cannot drop a series from their files.

With `--workers N` (`multiprocess(folder)` in each worker before its metrics are made) each value
is written through to this process's file in prometheus-client's multiprocess format (the files
`MultiProcessCollector` reads), and /metrics, on whichever worker answers, sums every worker's:
counters and histograms add up, the in-flight gauges too (live workers only), the health and
index gauges show the lowest or highest. Dropped series are compacted out of the files; the page
shows only instances some worker holds now (`live_instances`): a dead worker's files keep the
counters it wrote.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import multiprocess as mp_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
COMPACT_AFTER = 1024  # dropped series in a file before it is rewritten (and at least as many as it keeps)


class Value:
    """One series' value (a counter's, a gauge's, a histogram bucket's or sum)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:
        self.value = value

    def get(self) -> float:
        return self.value


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
            d = self.dicts[prefix] = self._new(self.path(prefix))
            self.values[prefix], self.dead[prefix] = {}, 0
        return d

    @staticmethod
    def _new(path: str) -> MmapedDict:
        """A file made under a temporary name and renamed once it holds its header: a reader of the
        folder (another worker's /metrics) fails on a file it finds empty, and MmapedDict creates
        its file empty before it sizes it. One already there (a dead worker's whose pid this one
        reuses) is opened as it is: its counters stay in the totals."""
        if os.path.exists(path):
            return MmapedDict(path)
        tmp = path + ".new"  # not *.db: readers never see it
        d = MmapedDict(tmp)
        os.replace(tmp, path)
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
            new.write_value(key, v.value, 0.0)
        os.replace(tmp, self.path(prefix))
        self.dicts[prefix].close()
        self.dicts[prefix], self.dead[prefix] = new, 0


class FileValue(Value):
    """A value of a worker of `--workers N`, written through to this process's file."""

    __slots__ = ("files", "prefix", "key", "dropped")

    def __init__(self, files: _Files, prefix: str, key: str, iid: str | None) -> None:
        self.files, self.prefix, self.key, self.dropped = files, prefix, key, False
        self.value = files.file(prefix).read_value(key)[0]
        files.values[prefix][key] = self
        if iid is not None:
            files.of_instance.setdefault(iid, []).append(self)

    def inc(self, amount: float = 1.0) -> None:
        self.set(self.value + amount)

    def set(self, value: float) -> None:
        self.value = value
        if not self.dropped:
            self.files.file(self.prefix).write_value(self.key, value, 0.0)


_files: _Files | None = None  # this process's, once multiprocess() ran


def _value(kind: str, family: str, sample: str, labelnames: Sequence[str], labelvalues: Sequence[str], doc: str,
           mode: str = "") -> Value:
    files = _files
    if files is None:
        return Value()
    prefix = f"gauge_{mode}" if kind == "gauge" else kind
    key = mmap_key(family, sample, list(labelnames), list(labelvalues), doc)
    iid = labelvalues[list(labelnames).index("instance")] if "instance" in labelnames else None
    return FileValue(files, prefix, key, iid)


class _Family:
    """A metric and its series, one per set of label values."""

    kind = ""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), registry: list[_Family] | None = None,
                 mode: str = "") -> None:
        self.name, self.doc, self.labelnames, self.mode = name, doc, tuple(labelnames), mode
        self.children: dict[tuple[str, ...], Value] = {}
        if registry is not None:
            registry.append(self)
        if not self.labelnames and self.kind != "histogram":
            self.labels()  # shown (0) from the start, as prometheus-client's unlabelled metrics are

    def labels(self, *values: str) -> Value:
        c = self.children.get(values)
        if c is None:
            assert len(values) == len(self.labelnames), f"{self.name} takes labels {self.labelnames}"
            c = self.children[values] = _value(self.kind, self.name, self.sample_name, self.labelnames, values,
                                               self.doc, self.mode)
        return c

    @property
    def sample_name(self) -> str:
        return self.name

    def remove(self, *values: str) -> None:
        self.children.pop(values, None)

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def get(self) -> float:
        """An unlabelled metric's value."""
        return self.labels().get()

    def family(self) -> Metric:
        raise NotImplementedError

    def _series(self, f: CounterMetricFamily | GaugeMetricFamily) -> Metric:
        """`f` with one sample per set of label values."""
        for values, v in self.children.items():
            f.add_metric(values, v.value)
        return f


class Counter(_Family):
    kind = "counter"

    @property
    def sample_name(self) -> str:
        return self.name + "_total"

    def family(self) -> Metric:
        return self._series(CounterMetricFamily(self.name, self.doc, labels=self.labelnames))


class Gauge(_Family):
    kind = "gauge"

    def set(self, value: float) -> None:
        self.labels().set(value)

    def family(self) -> Metric:
        return self._series(GaugeMetricFamily(self.name, self.doc, labels=self.labelnames))


class Histogram(_Family):
    """An unlabelled histogram: a value per bucket (its own count, not cumulative) and the sum."""

    kind = "histogram"

    def __init__(self, name: str, doc: str, buckets: Sequence[float], registry: list[_Family] | None = None) -> None:
        super().__init__(name, doc, (), registry)
        self.bounds = [float(b) for b in buckets] + [float("inf")]
        les = [floatToGoString(b) for b in self.bounds]
        self.buckets = [_value("histogram", name, name + "_bucket", ("le",), (le,), doc) for le in les]
        self.les = les
        self.sum = _value("histogram", name, name + "_sum", (), (), doc)

    def observe(self, sample: float) -> None:
        self.sum.inc(sample)
        self.buckets[bisect_left(self.bounds, sample)].inc()  # the first bound >= sample: `sample <= le`

    def observe_all(self, samples: Sequence[float]) -> None:
        """observe(s) for every sample, with one increment per bucket hit and one for the sum (a
        stream's inter-token gaps, one per relayed batch)."""
        if not samples:
            return
        bounds = self.bounds
        hits: dict[int, int] = {}
        for s in samples:
            i = bisect_left(bounds, s)
            hits[i] = hits.get(i, 0) + 1
        self.sum.inc(sum(samples))
        for i, n in hits.items():
            self.buckets[i].inc(n)

    def family(self) -> Metric:
        f = HistogramMetricFamily(self.name, self.doc)
        total, cumulative = 0.0, []
        for le, b in zip(self.les, self.buckets, strict=True):
            total += b.value
            cumulative.append((le, total))
        f.add_metric([], cumulative, self.sum.value)
        return f


class _Own(Collector):
    def __init__(self, families: list[_Family]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        for f in self.families:
            yield f.family()


class ProxyMetrics:
    def __init__(self) -> None:
        self.folder = _files.folder if _files is not None else None
        self.families: list[_Family] = []
        self._requests(self.families)
        self._routing(self.families)
        # --workers N: the instance labels to show (the router's); "proxy" labels the proxy's own errors.
        self.live_instances: Callable[[], set[str]] | None = None

    def _requests(self, r: list[_Family]) -> None:
        """Requests, their legs and their latencies."""
        self.requests = Counter("kvferry_proxy_requests", "Client requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("kvferry_proxy_errors", "Errors by kind and instance", ["kind", "instance"], registry=r)
        self.in_flight = Gauge("kvferry_proxy_in_flight", "Requests in flight per instance", ["instance", "role"],
                               registry=r, mode="livesum")
        # --workers N: each worker checks each instance itself, so for up to a health interval they
        # disagree; the lowest, so that /metrics reads 0 as soon as any worker's /health says unhealthy.
        self.healthy = Gauge("kvferry_proxy_instance_healthy", "1 if the instance passes health checks",
                             ["instance", "role", "url"], registry=r, mode="livemin")
        self.prefill = Histogram("kvferry_proxy_prefill_seconds", "Prefill leg (prefiller answer) time",
                                 _LAT, registry=r)
        self.notifications = Counter("kvferry_proxy_notifications",
                                     "Frames on --proxy-port by result: arrived (a tracked transfer), unknown "
                                     "(no such transfer in flight), bad (not a valid notification)", ["result"],
                                     registry=r)
        self.kv_wait = Histogram("kvferry_proxy_kv_transfer_wait_seconds",
                                 "How long the KV was still on its way after the prefiller answered: from its answer "
                                 "to "
                                 "the decoder's KV-arrived notification, 0 when the notification came first; one "
                                 "sample per transfer that arrived",
                                 _LAT, registry=r)
        self.decoder_first = Histogram("kvferry_proxy_decoder_first_token_seconds",
                                       "From the decode leg's start to its first chunk", _LAT, registry=r)
        self.ttft = Histogram("kvferry_proxy_ttft_seconds", "Client time to first token", _LAT, registry=r)
        self.itl = Histogram("kvferry_proxy_inter_token_seconds", "Gap between streamed chunks", _LAT, registry=r)

    def _routing(self, r: list[_Family]) -> None:
        """Routing, instances, discovery and connections."""
        self.routes = Counter("kvferry_proxy_routing_decisions", "Routing decisions by reason (docs/proxy.md "
                              "\"Routing\")", ["reason"], registry=r)
        self.served = Counter("kvferry_proxy_served", "Prompts by how they were served: disaggregated (a prefill "
                              "leg and a KV transfer), local (the decoder alone, by choice), degraded (the "
                              "decoder alone, as no prefiller was usable) or single (a one-token answer)", ["mode"],
                              registry=r)
        self.degraded = Gauge("kvferry_proxy_degraded", "1 while no prefiller is usable and decoders serve whole "
                              "requests", registry=r, mode="livemax")
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
                                  ["instance"], registry=r, mode="livemax")
        self.discovery_rejected = Counter("kvferry_proxy_discovery_rejected", "Discovery entries not used, by "
                                          "reason: unsigned, bad_signature, lease, replayed, expired, version, "
                                          "too_many, key, malformed, model, fingerprint, insecure, duplicate "
                                          "(each key counted once)", ["reason"],
                                          registry=r)
        self.discovery_instances = Gauge("kvferry_proxy_discovery_instances", "Instances in use from discovery",
                                         ["role"], registry=r, mode="livemax")
        # --workers N: the lowest, so that one worker cut off from etcd reads 0.
        self.discovery_healthy = Gauge("kvferry_proxy_discovery_healthy", "1 while the --discovery source (etcd, "
                                       "Kubernetes or file) reads, 0 from a failed read until one works again (the "
                                       "last view stays in use meanwhile)", ["source"], registry=r, mode="livemin")
        self.discovery_errors = Counter("kvferry_proxy_discovery_errors", "Failed reads of the --discovery source "
                                        "(etcd unreachable or refusing, a bad file), about one a second while it "
                                        "lasts", ["source"], registry=r)
        self.migrations = Counter("kvferry_proxy_migrations", "Requests moved to another decoder after their "
                                  "decode leg failed mid-stream, by the failure's kind (stream_broken, "
                                  "stream_error, stall, timeout, unreachable, upstream_5xx)", ["reason"], registry=r)
        self.total = Histogram("kvferry_proxy_request_seconds", "Client request total time", _LAT, registry=r)
        self.dropped_connections = Counter("kvferry_proxy_dropped_connections", "Client connections the front door "
                                           "refused or closed: max_connections (past --max-connections), "
                                           "request_timeout (its request did not arrive within --request-timeout)",
                                           ["reason"], registry=r)
        self.board_full = Counter("kvferry_proxy_board_full", "Instances added while every row of the --workers "
                                  "load board was held: routed, on each worker's own load", registry=r)

    def forget_instance(self, iid: str) -> None:
        """Every series labelled `instance=iid` leaves the page (and this process's memory and files)."""
        for metric in self.families:
            if "instance" in metric.labelnames:
                at = metric.labelnames.index("instance")
                for values in [v for v in metric.children if v[at] == iid]:
                    metric.remove(*values)
        if _files is not None:
            _files.drop(iid)

    def render(self) -> bytes:
        registry = CollectorRegistry()
        if self.folder is None:
            registry.register(_Own(self.families))
        else:
            registry.register(_LiveOnly(mp_metrics.MultiProcessCollector(None, self.folder), self.live_instances))
        return generate_latest(registry)


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


def multiprocess(folder: str) -> None:
    """This process's metrics from now on live in `folder`, summed with its peers' on /metrics
    (a worker of `--workers N`, before it makes its ProxyMetrics)."""
    global _files
    _files = _Files(folder)


def worker_died(pid: int, folder: str) -> None:
    """A dead worker's live gauges leave /metrics (its counters stay in the totals)."""
    mp_metrics.mark_process_dead(pid, folder)
