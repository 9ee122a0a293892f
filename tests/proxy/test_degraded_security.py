"""With no usable prefiller, decoders serve whole requests (degraded) instead of the proxy refusing
them, counted and shown; disaggregation resumes as soon as a prefiller passes its health check."""

from __future__ import annotations

import os
import signal

import httpx

from tests.polling import until
from tests.stub_procs import Proc, events, log, post, proxy, stubs

BODY = {"model": "stub", "prompt": "the prefiller is gone", "max_tokens": 4}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}


def _metric(url: str, line: str) -> float:
    for row in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def _with_transfer(s: Proc) -> int:
    return sum(1 for r in log(s)["requests"] if "kv_transfer_params" in r)


def test_decoders_serve_whole_requests_while_no_prefiller_lives_trust() -> None:
    p0, d0, d1 = stubs(0, 0, 0)
    port = p0.url.rsplit(":", 1)[1]
    px = proxy([p0], [d0, d1], "--health-interval", "1", "--workers", "1")
    assert post(px.url, "/v1/completions", BODY).status_code == 200
    assert len(log(p0)["requests"]) == 1 and sum(_with_transfer(d) for d in (d0, d1)) == 1
    # The only prefiller fails a prefill leg: its decoder serves that request whole.
    httpx.post(p0.url + "/stub/fail", json={"status": 500, "count": 1})
    r = post(px.url, "/v1/completions", BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert _metric(px.url, 'kvferry_proxy_served_total{mode="degraded"}') == 1
    # It dies: no request is refused meanwhile, and once the proxy knows, /health says degraded.
    os.killpg(p0.proc.pid, signal.SIGKILL)
    p0.proc.wait(5)

    def degraded() -> bool:
        r = post(px.url, "/v1/completions", BODY)
        assert r.status_code == 200, r.text
        return httpx.get(px.url + "/health", timeout=10).json()["status"] == "degraded"
    until(degraded, 60, "/health degraded")
    assert httpx.get(px.url + "/health", timeout=10).status_code == 200, "decoders serve: up, degraded"
    before = {d.url: len(log(d)["requests"]) for d in (d0, d1)}
    r = post(px.url, "/v1/completions", dict(BODY, max_tokens=1))
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    ev = events(px.url, "/v1/completions", dict(BODY, stream=True))
    assert ev[-1] == "[DONE]" and not any("error" in e for e in ev[:-1])
    r = post(px.url, "/v1/chat/completions", CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    ev = events(px.url, "/v1/chat/completions", dict(CHAT, stream=True))
    assert ev[-1] == "[DONE]" and not any("error" in e for e in ev[:-1])
    served = [r for d in (d0, d1) for r in log(d)["requests"][before[d.url]:]]
    assert len(served) == 4, "each request served by a decoder, once"
    assert not [r for r in served if "kv_transfer_params" in r], "no transfer to wait for"
    assert _metric(px.url, "kvferry_proxy_degraded") == 1.0
    assert _metric(px.url, 'kvferry_proxy_served_total{mode="degraded"}') >= 5
    # It comes back on its port: disaggregation resumes with the health check that sees it.
    back = Proc(["-m", "kvferry.testing.stub_engine", "--port", port], p0.url, "/health")
    until(lambda: httpx.get(px.url + "/health", timeout=10).json()["status"] == "ok", 60, "the prefiller back")
    assert post(px.url, "/v1/completions", BODY).status_code == 200
    assert len(log(back)["requests"]) == 1, "disaggregated again"
    assert _metric(px.url, "kvferry_proxy_degraded") == 0.0
