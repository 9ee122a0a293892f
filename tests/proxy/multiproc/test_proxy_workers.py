"""`kvferry-proxy --workers N`: several processes on one port route as one proxy (shared load,
admin changes and ejections), /metrics counts every worker's requests, a dead worker is replaced,
and nothing outlives the proxy."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import httpx

from tests.polling import until
from tests.stub_procs import (
    Proc,
    log,
    proxy,
    stub,
    stubs,
)


def _workers(pid: int) -> set[int]:
    out: set[int] = set()
    for t in os.listdir(f"/proc/{pid}/task"):
        out |= {int(c) for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()}
    return out


def _listeners(port: int) -> int:
    """Sockets listening on 127.0.0.1:`port` (each worker has its own: SO_REUSEPORT)."""
    rows = (ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:])
    return sum(1 for r in rows if r[1] == f"0100007F:{port:04X}" and r[3] == "0A")


def _both_workers(px: Proc) -> set[int]:
    """The two workers' pids once both listen. The port answers as soon as the first one does,
    and the supervisor starts the second only then: /metrics answering says nothing of it."""
    until(lambda: _listeners(urlsplit(px.url).port or 0) == 2, 30, "both workers listening")
    return _workers(px.proc.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def _blast(url: str, n: int, clients: int) -> list[int]:
    """`n` completions from `clients` clients at once, each its own connection per request (the
    kernel spreads connections over the workers); their statuses."""
    async def run() -> list[int]:
        todo = list(range(n))
        statuses: list[int] = []

        async def client() -> None:
            while todo:
                i = todo.pop()
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                        s.post(url + "/v1/completions", json={"model": "stub", "prompt": f"balance {i} " * 20,
                                                              "max_tokens": 3}) as r:
                    await r.read()
                    statuses.append(r.status)
        await asyncio.gather(*(client() for _ in range(clients)))
        return statuses
    return asyncio.run(run())


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_two_workers_balance_prefillers_and_count_every_request() -> None:
    # A prefill takes a while: the in-flight counts the workers share decide.
    p0, p1 = (stub(0, False, "--prompt-delay", "0.005") for _ in range(2))
    d0 = stub(0)
    p0.wait(), p1.wait()
    # --health-interval 60: the harness's probes (every 0.3 s, each given 0.3 s) go unanswered in
    # time on a loaded machine while the workers and stubs are busy with the blast, and two in a
    # row eject the instance: 503s (the decoder) or one prefiller taking every prompt.
    px = proxy([p0, p1], [d0], "--workers", "2", "--health-interval", "60")
    try:
        assert len(_both_workers(px)) == 2
        statuses = _blast(px.url, 400, 48)
        assert statuses.count(200) == 400, statuses
        counts = [len(log(p)["requests"]) for p in (p0, p1)]
        # Both are used, neither starved: not an even split, which holds only while both stubs run
        # at one speed (on a loaded machine one answers slower, and load-aware routing then sends
        # it less, as it should).
        assert sum(counts) == 400 and min(counts) >= 400 // 4, counts
        text = httpx.get(px.url + "/metrics").text
        assert _metric(text, 'kvferry_proxy_requests_total{endpoint="/v1/completions",status="200"}') == 400
        assert _metric(text, "kvferry_proxy_request_seconds_count") == 400
        assert _metric(text, 'kvferry_proxy_in_flight{instance="p0",role="prefiller"}') == 0
        # /health's served counts are every worker's, whichever worker answers (new connections)
        for _ in range(4):
            with httpx.Client() as c:
                health = {i["url"]: i for i in c.get(px.url + "/health").json()["instances"]}
            assert [health[p.url]["served"] for p in (p0, p1)] == counts, (health, counts)
            assert health[d0.url]["served"] == 400 and health[d0.url]["in_flight"] == 0
    finally:
        for p in (px, p0, p1, d0):
            p.stop()


def test_admin_changes_and_ejections_reach_every_worker() -> None:
    p0, p1, d0 = stubs(0, 0, 0)
    px = proxy([p0, p1], [d0], "--workers", "2", "--health-interval", "60")
    try:
        ids = {i["url"]: i["id"] for i in httpx.get(px.url + "/admin/instances").json()["instances"]}
        assert httpx.post(f"{px.url}/admin/instances/{ids[p0.url]}/drain").json()["draining"]
        for i in range(20):  # new connections: both workers answer some
            with httpx.Client() as c:
                assert c.post(px.url + "/v1/completions", json={"prompt": f"d{i}", "max_tokens": 2},
                              timeout=30).status_code == 200
        assert len(log(p0)["requests"]) == 0
        httpx.post(f"{px.url}/admin/instances/{ids[p0.url]}/undrain").raise_for_status()
        # p1 dies: the worker that meets it ejects it, and no worker sends to it after that.
        p1.stop()
        for i in range(20):
            with httpx.Client() as c:
                assert c.post(px.url + "/v1/completions", json={"prompt": f"e{i}", "max_tokens": 2},
                              timeout=30).status_code == 200
        time.sleep(0.5)  # a sleep (window): the probe that confirms the ejection, and any late errors, come by now
        text = httpx.get(px.url + "/metrics").text
        assert _metric(text, f'kvferry_proxy_errors_total{{instance="{ids[p1.url]}",kind="unreachable"}}') <= 2
    finally:
        for p in (px, p0, p1, d0):
            p.stop()


def test_a_killed_worker_is_replaced_and_none_outlives_the_proxy() -> None:
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0], "--workers", "2")
    try:
        before = _both_workers(px)
        assert len(before) == 2
        for i in range(6):
            with httpx.Client() as c:
                assert c.post(px.url + "/v1/completions", json={"prompt": f"j{i}", "max_tokens": 2},
                              timeout=30).status_code == 200
        served_before = 6
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        until(lambda: len(now := _workers(px.proc.pid)) == 2 and victim not in now, 60,
              "the killed worker to be replaced", every=0.1)
        now = _workers(px.proc.pid)
        assert len(now) == 2 and victim not in now, now
        for i in range(10):
            with httpx.Client() as c:
                assert c.post(px.url + "/v1/completions", json={"prompt": f"k{i}", "max_tokens": 2},
                              timeout=30).status_code == 200
        pages: list[httpx.Response] = []

        def counted() -> bool:  # the dead worker's count is kept; a count may follow its answer's last byte
            pages.append(httpx.get(px.url + "/metrics"))
            ok = _metric(pages[-1].text, 'kvferry_proxy_requests_total{endpoint="/v1/completions",status="200"}')
            assert ok <= 10 + served_before, pages[-1].text
            return ok == 10 + served_before
        until(counted, 60, lambda: f"{10 + served_before} requests counted; the last /metrics answered "
                                   f"{pages[-1].status_code}: {pages[-1].text[-3000:]}", every=0.2)
        for _ in range(4):  # the replaced worker's served count is kept
            with httpx.Client() as c:
                health = {i["url"]: i for i in c.get(px.url + "/health").json()["instances"]}
            assert health[d0.url]["served"] == 10 + served_before, health
    finally:
        px.proc.send_signal(signal.SIGTERM)  # the supervisor alone: it stops its workers
        px.proc.wait(15)
        for p in (px, p0, d0):
            p.stop()
    assert not any(_alive(pid) for pid in now)


def test_workers_flag() -> None:
    from kvferry.proxy.instance_flags import OptionError
    from kvferry.proxy.options import parse
    base = ["--prefiller", "http://127.0.0.1:1", "--decoder", "http://127.0.0.1:2,3,4"]
    assert parse(base).workers == len(os.sched_getaffinity(0))
    assert parse([*base, "--workers", "1"]).workers == 1
    assert parse([*base, "--proxy-port", "7000"]).workers == 1
    assert parse(["--discovery", "file:///tmp/none.yaml"]).workers == 1
    try:
        parse([*base, "--proxy-port", "7000", "--workers", "2"])
        raise AssertionError("--workers 2 with --proxy-port was accepted")
    except OptionError as e:
        assert "--workers 1" in str(e)


def test_a_worker_that_never_listens_is_killed_after_the_start_deadline(monkeypatch) -> None:
    """No unbounded wait: the supervisor gives up on a worker stuck before it listens, kills it,
    and stops (nothing left running)."""
    from kvferry.proxy.multiproc import supervisor as workers
    from kvferry.proxy.options import parse

    monkeypatch.setattr(workers, "START_S", 1.0)

    def stuck(opts, board, peers, index, ready) -> int:
        time.sleep(600)  # a sleep (pacing): a worker that never calls ready()
        return 0

    opts = parse(["--prefiller", "http://127.0.0.1:1", "--decoder", "http://127.0.0.1:2,7000,7001"])
    sup = workers.Supervisor(opts, 1, stuck)
    t0 = time.monotonic()
    assert sup.run() == 1
    assert time.monotonic() - t0 < 60  # START_S (1 s) ended it, not the stuck worker's 600 s
    assert not sup.pids
