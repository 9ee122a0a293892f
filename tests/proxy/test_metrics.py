"""proxy/metrics.py: its own lock-free values leave every metric exactly as prometheus-client's own
classes would show it, one process or several (its multiprocess files)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import prometheus_client as prom
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import multiprocess as mp_metrics

from kvferry.proxy import metrics
from kvferry.proxy.metrics import ProxyMetrics

# On bounds (a sample equal to a bound goes in that bound's bucket), between them, past the last
# one, zero and negative.
SAMPLES = [0.0, -0.5, 0.001, 0.0010001, 0.0024, 0.0025, 0.7, 1, 59.9, 60, 61, 1e9, 0.003, 0.003]


def _lines(text: bytes, prefix: str = "") -> list[str]:
    """The page's samples (creation times aside: prometheus-client's classes add them, ours not)."""
    return [ln for ln in text.decode().splitlines()
            if ln.startswith(prefix) and "_created" not in ln and not ln.startswith("#")]


def test_observe_all_equals_one_observe_per_sample() -> None:
    each, together = ProxyMetrics(), ProxyMetrics()
    for s in SAMPLES:
        each.itl.observe(s)
    together.itl.observe_all(SAMPLES[:5])
    together.itl.observe_all(SAMPLES[5:])
    together.itl.observe_all([])
    itl = "kvferry_proxy_inter_token_seconds"
    assert _lines(together.render(), itl) == _lines(each.render(), itl)
    text = "\n".join(_lines(together.render(), itl))
    assert 'kvferry_proxy_inter_token_seconds_bucket{le="0.001"} 3.0' in text
    assert 'kvferry_proxy_inter_token_seconds_bucket{le="60.0"} 12.0' in text
    assert "kvferry_proxy_inter_token_seconds_count 14.0" in text


def test_values_count_as_prometheus_clients_own_classes_do() -> None:
    """The same changes made to ours and to prometheus-client's Counter, Gauge and Histogram show
    the same page, comments (HELP, TYPE) included."""
    ours = ProxyMetrics()
    reg = CollectorRegistry()
    ref_ttft = prom.Histogram("kvferry_proxy_ttft_seconds", "Client time to first token",
                              buckets=metrics._LAT, registry=reg)
    ref_requests = prom.Counter("kvferry_proxy_requests", "Client requests by endpoint and status",
                                ["endpoint", "status"], registry=reg)
    ref_in_flight = prom.Gauge("kvferry_proxy_in_flight", "Requests in flight per instance", ["instance", "role"],
                               registry=reg)
    ref_errors = prom.Counter("kvferry_proxy_errors", "Errors by kind and instance", ["kind", "instance"],
                              registry=reg)
    for s in SAMPLES:
        ref_ttft.observe(s)
        ours.ttft.observe(s)
    for requests, in_flight, errors in ((ours.requests, ours.in_flight, ours.errors),
                                        (ref_requests, ref_in_flight, ref_errors)):
        for _ in range(3):
            requests.labels("/v1/completions", "200").inc()
        g = in_flight.labels("d0", "decoder")
        g.inc()
        g.inc()
        g.dec()
        errors.labels("timeout", "d0").inc(2.5)
    names = ("kvferry_proxy_ttft_seconds", "kvferry_proxy_requests", "kvferry_proxy_in_flight",
             "kvferry_proxy_errors")

    def page(text: bytes) -> list[str]:
        return [ln for ln in text.decode().splitlines() if "_created" not in ln
                and any(ln.split(" ")[2 if ln.startswith("#") else 0].startswith(n) for n in names)]
    assert sorted(page(ours.render())) == sorted(page(generate_latest(reg)))
    assert 'kvferry_proxy_ttft_seconds_bucket{le="0.0025"} 6.0' in page(ours.render())
    assert 'kvferry_proxy_in_flight{instance="d0",role="decoder"} 1.0' in page(ours.render())


def test_a_gone_instances_series_leave_the_page() -> None:
    m = ProxyMetrics()
    m.errors.labels("timeout", "d0").inc()
    m.errors.labels("timeout", "d1").inc()
    m.healthy.labels("d0", "decoder", "http://d0").set(1)
    m.forget_instance("d0")
    text = m.render().decode()
    assert 'instance="d0"' not in text and 'kvferry_proxy_errors_total{instance="d1",kind="timeout"} 1.0' in text


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



def _first_request(folder: str) -> None:
    metrics.multiprocess(folder)
    ProxyMetrics().requests.labels("/v1/completions", "200").inc()


def _workers_one_after_another(folder: str, n: int) -> None:
    """`n` workers in turn, each counting one request (which makes its files) and leaving; each in a
    folder of its own (`folder`/0, /1, ...), so that a reader's pass reads one worker's files."""
    ctx = multiprocessing.get_context("fork")
    for i in range(n):
        (Path(folder) / str(i)).mkdir()
        p = ctx.Process(target=_first_request, args=(str(Path(folder) / str(i)),))
        p.start()
        p.join(30)


def test_with_workers_a_page_read_while_a_worker_makes_its_files_is_whole(tmp_path: Path) -> None:
    """A worker that starts (a replaced one) makes its files while /metrics reads the folder: a file
    is never seen under its name before it holds its header (prometheus-client's reader fails on
    an empty one, and the page would be a 500)."""
    writer = multiprocessing.get_context("fork").Process(target=_workers_one_after_another,
                                                         args=(str(tmp_path), 300))
    writer.start()
    errors: list[str] = []
    passes, k = 0, 0
    deadline = time.monotonic() + 600  # far: 300 forks take seconds
    while writer.is_alive() and time.monotonic() < deadline:
        if (tmp_path / str(k + 1)).exists():
            k += 1
        if not (tmp_path / str(k)).exists():
            continue
        try:  # what the page's render reads, over the newest worker's folder
            list(mp_metrics.MultiProcessCollector(None, str(tmp_path / str(k))).collect())
        except Exception as e:
            errors.append(repr(e))
        passes += 1
    writer.join(30)
    assert writer.exitcode == 0 and k > 0
    assert not errors, f"{len(errors)} of {passes} reads failed, e.g. {errors[0]}"


def test_prometheus_clients_own_multiprocess_values_keep_a_removed_series(tmp_path: Path) -> None:
    """Why proxy/metrics.py writes the multiprocess files itself: with prometheus-client's own
    classes in multiprocess mode, a series removed (an instance gone) stays in the process's file,
    so MultiProcessCollector keeps showing it and instance churn grows /metrics."""
    code = ("from prometheus_client import Gauge\n"
            "g = Gauge('kvferry_probe_healthy', 'probe', ['instance'], multiprocess_mode='all')\n"
            "g.labels('gone:8000').set(1)\n"
            "g.remove('gone:8000')\n")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    registry = CollectorRegistry()
    mp_metrics.MultiProcessCollector(registry, path=str(tmp_path))
    assert 'instance="gone:8000"' in generate_latest(registry).decode()
