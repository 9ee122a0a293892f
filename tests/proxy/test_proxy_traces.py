"""The proxy's traces against stub engines (separate processes, real HTTP) and a real OTLP receiver
(gRPC): a client's traceparent is continued; the request, route and legs are spans of one trace;
each leg's context reaches its engine in its headers and in its kv_transfer_params; a retried
prefill leg and a migrated stream show as spans; the sample ratio decides, a client's sampled
flag only when trusted; X-Request-Id checked, made, returned, forwarded and on the proxy's log
lines, traced or not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvferry.testing.otlp_receiver import OTLPReceiver, ReceivedSpan
from tests.polling import until
from tests.stub_procs import Proc, log, post, proxy, stubs

CLIENT_SPAN = "00f067aa0ba902b7"


def _tp(trace_id: str, flags: str = "01") -> str:
    return f"00-{trace_id}-{CLIENT_SPAN}-{flags}"


@pytest.fixture(scope="module")
def traced() -> Iterator[dict]:
    """2 stub prefillers, 2 stub decoders, a traced proxy (round robin) and the receiver."""
    with OTLPReceiver() as rx:
        p0, p1, d0, d1 = stubs(0, 0, 0.002, 0.002)
        px = proxy([p0, p1], [d0, d1], "--policy", "round_robin", "--workers", "1", "--stall-timeout", "2",
                   "--otlp-traces-endpoint", rx.grpc_endpoint)
        try:
            yield {"rx": rx, "p": [p0, p1], "d": [d0, d1], "url": px.url}
        finally:
            for s in (px, p0, p1, d0, d1):
                s.stop()


def _reset(c: dict) -> None:
    for s in [*c["p"], *c["d"]]:
        httpx.post(s.url + "/stub/reset")


def _trace(rx: OTLPReceiver, trace_id: str, names: set[str],
           counts: dict[str, int] | None = None) -> dict[str, list[ReceivedSpan]]:
    """The trace's spans by name, once it holds every one of `names`, and `counts[name]` of those
    named there (the proxy exports spans in batches: one trace's spans may arrive in two)."""
    def got() -> dict[str, list[ReceivedSpan]] | None:
        out: dict[str, list[ReceivedSpan]] = {}
        for s in rx.trace(trace_id):
            out.setdefault(s.name, []).append(s)
        if not names <= out.keys() or any(len(out.get(n, ())) < k for n, k in (counts or {}).items()):
            return None
        return out
    return until(got, 60, lambda: f"spans {sorted(names)} of trace {trace_id}, got {[s.name for s in rx.spans()]}")


def _seen(c: dict) -> list[tuple[str, dict, dict]]:
    """Every (stub URL, body, headers) the stubs got since the last reset."""
    out = []
    for s in [*c["p"], *c["d"]]:
        got = log(s)
        out += [(s.url, b, h) for b, h in zip(got["requests"], got["headers"], strict=True)]
    return out


@pytest.mark.parametrize("path,stream", [("/v1/completions", False), ("/v1/completions", True),
                                         ("/v1/chat/completions", True)], ids=["whole", "stream", "chat"])
def test_trace_continues_the_clients_traceparent_through_route_and_both_legs(traced, path: str, stream: bool) -> None:
    _reset(traced)
    trace_id = ("ab" if stream else "cd") * 15 + ("01" if "chat" in path else "02")
    body: dict = {"max_tokens": 5, "stream": stream}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "tell me about the sea"}]
    else:
        body["prompt"] = "tell me about the sea"
    hdrs = {"traceparent": _tp(trace_id), "tracestate": "vendor=abc", "X-Request-Id": "client-42"}
    if stream:
        with httpx.stream("POST", traced["url"] + path, json=body, headers=hdrs, timeout=30) as r:
            r.read()
    else:
        r = httpx.post(traced["url"] + path, json=body, headers=hdrs, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42"
    spans = _trace(traced["rx"], trace_id, {f"POST {path}", "route", "prefill", "decode"})
    req, = spans[f"POST {path}"]
    assert req.parent_id == CLIENT_SPAN and req.kind == 2 and req.service == "kvferry-proxy"
    assert req.attributes["kvferry.request_id"] == "client-42" and req.attributes["http.response.status_code"] == 200
    route, = spans["route"]
    assert route.attributes["kvferry.route.reason"] == "round_robin"
    assert route.attributes["kvferry.route.mode"] == "disaggregated"
    legs = {n: spans[n][0] for n in ("prefill", "decode")}
    assert legs["prefill"].attributes["kvferry.transfer_id"] == legs["decode"].attributes["kvferry.transfer_id"]
    for s in (route, *legs.values()):
        assert s.parent_id == req.span_id and req.start_ns <= s.start_ns and s.end_ns <= req.end_ns
    seen = _seen(traced)
    assert len(seen) == 2
    for stub_url, leg_body, leg_headers in seen:
        leg = legs["decode" if "disagg_spec" not in leg_body["kv_transfer_params"] else "prefill"]
        want = f"00-{trace_id}-{leg.span_id}-01"
        # The engine's own spans (vLLM reads these headers) and the connector's (its kv_transfer_params)
        # both go under the leg's span.
        assert leg_headers["traceparent"] == want and leg_body["kv_transfer_params"]["traceparent"] == want
        assert leg_headers["tracestate"] == "vendor=abc" and leg_headers["x-request-id"] == "client-42"
        assert leg.attributes["server.address"] == stub_url


def test_trace_shows_a_retried_prefill_leg_and_a_migrated_stream(traced) -> None:
    _reset(traced)
    rx, url = traced["rx"], traced["url"]
    httpx.post(traced["p"][0].url + "/stub/fail", json={"status": 500, "count": 1})
    for i in range(2):  # round robin: the failing prefiller takes one of two requests
        trace_id = f"{i + 1:02x}" * 16  # all zeros is no trace id
        assert post(url, "/v1/completions", {"prompt": f"retry {i}", "max_tokens": 3},
                    headers={"traceparent": _tp(trace_id)}).status_code == 200
        if log(traced["p"][0])["requests"]:  # it took this one, and failed it
            break
    spans = _trace(rx, trace_id, {"retry", "prefill"}, {"prefill": 2})
    assert len(spans["prefill"]) == 2
    failed, ok = sorted(spans["prefill"], key=lambda s: s.start_ns)
    assert failed.status == 2 and failed.attributes["error.type"] == "upstream_5xx" and ok.status != 2
    retry, = spans["retry"]
    assert retry.attributes["kvferry.retry.from"] == failed.attributes["kvferry.instance"]
    assert retry.attributes["kvferry.retry.to"] == ok.attributes["kvferry.instance"] != retry.attributes[
        "kvferry.retry.from"]
    assert failed.attributes["server.address"] == traced["p"][0].url
    assert retry.parent_id == failed.parent_id == ok.parent_id

    httpx.post(traced["d"][0].url + "/stub/fail", json={"die_mid_stream": True})  # after its next first token
    for i in range(2):  # round robin: the dying decoder takes one of two streams
        trace_id = f"e{i}" * 16
        got = _stream(url, {"prompt": f"move me {i}", "max_tokens": 8, "stream": True}, _tp(trace_id))
        assert got[-1] == "[DONE]" and not any("error" in e for e in got[:-1] if isinstance(e, dict))
        if httpx.get(traced["d"][0].url + "/health").status_code == 503:  # it took this stream, and died
            break
    spans = _trace(rx, trace_id, {"migration", "decode"}, {"decode": 2})
    assert len(spans["decode"]) == 2
    first, second = sorted(spans["decode"], key=lambda s: s.start_ns)
    mig, = spans["migration"]
    assert first.status == 2 and first.attributes["error.type"] == "stream_error"
    assert mig.attributes["kvferry.migration.from"] == first.attributes["kvferry.instance"]
    assert mig.attributes["kvferry.migration.to"] == second.attributes["kvferry.instance"] != mig.attributes[
        "kvferry.migration.from"]
    assert first.end_ns <= mig.end_ns <= second.start_ns
    assert first.parent_id == second.parent_id == mig.parent_id
    _reset(traced)


def test_trace_marks_a_leg_the_engine_refused_4xx_as_failed(traced) -> None:
    _reset(traced)
    for p in traced["p"]:  # whichever prefiller round robin picks refuses it
        httpx.post(p.url + "/stub/fail", json={"status": 400, "count": 1})
    trace_id = "4a" * 16
    r = post(traced["url"], "/v1/completions", {"prompt": "refused", "max_tokens": 2},
             headers={"traceparent": _tp(trace_id)})
    assert r.status_code == 400
    spans = _trace(traced["rx"], trace_id, {"POST /v1/completions", "prefill"})
    leg, = spans["prefill"]
    assert leg.status == 2 and leg.attributes["error.type"] == "upstream_4xx"
    req, = spans["POST /v1/completions"]
    assert req.attributes["http.response.status_code"] == 400
    _reset(traced)


def _stream(url: str, body: dict, traceparent: str) -> list:
    out: list = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"traceparent": traceparent},
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def _leg_traceparents(*stubs_: Proc) -> list[str]:
    """The traceparent each stub got on its last request."""
    return [log(s)["headers"][-1]["traceparent"] for s in stubs_]


def test_trace_sampling_follows_a_client_only_when_trusted() -> None:
    """--trace-sample-ratio decides whatever a client's sampled flag says, and the client's trace id
    goes on to the engines with the proxy's decision; --trust-client-trace-sampling follows the flag."""
    with OTLPReceiver() as rx:
        p, d = stubs(0, 0)
        traced = ["--workers", "1", "--otlp-traces-endpoint", rx.grpc_endpoint]
        never = proxy([p], [d], *traced, "--trace-sample-ratio", "0")
        always = proxy([p], [d], *traced)  # ratio 1
        trusting = proxy([p], [d], *traced, "--trace-sample-ratio", "0", "--trust-client-trace-sampling",
                         "--service-name", "edge-proxy")
        forced, refused, trusted = "12" * 16, "34" * 16, "56" * 16
        # Not trusted: a client's sampled flag samples nothing at ratio 0 ...
        assert post(never.url, "/v1/completions", {"prompt": "sampled?", "max_tokens": 2},
                    headers={"traceparent": _tp(forced)}).status_code == 200
        for tp in _leg_traceparents(p, d):  # ... while its trace id reaches both engines, unsampled
            assert tp.startswith(f"00-{forced}-") and tp.endswith("-00") and CLIENT_SPAN not in tp, tp
        assert post(never.url, "/v1/completions", {"prompt": "no traceparent", "max_tokens": 2}).status_code == 200
        assert all(tp.endswith("-00") for tp in _leg_traceparents(p, d))
        # ... and its unsampled flag does not stop the proxy's ratio 1.
        assert post(always.url, "/v1/completions", {"prompt": "not sampled?", "max_tokens": 2},
                    headers={"traceparent": _tp(refused, "00")}).status_code == 200
        assert all(tp.startswith(f"00-{refused}-") and tp.endswith("-01") for tp in _leg_traceparents(p, d))
        _trace(rx, refused, {"POST /v1/completions", "prefill", "decode"})
        # Trusted: the client's flag decides, at ratio 0 too.
        assert post(trusting.url, "/v1/completions", {"prompt": "sampled", "max_tokens": 2},
                    headers={"traceparent": _tp(trusted)}).status_code == 200
        assert all(tp.endswith("-01") for tp in _leg_traceparents(p, d))
        spans = _trace(rx, trusted, {"POST /v1/completions", "prefill", "decode"})
        assert spans["prefill"][0].service == "edge-proxy"
        assert post(trusting.url, "/v1/completions", {"prompt": "unsampled", "max_tokens": 2},
                    headers={"traceparent": _tp("78" * 16, "00")}).status_code == 200
        for px in (never, always, trusting):
            px.stop()  # each sends what it batched before it exits
        assert {s.trace_id for s in rx.spans()} == {refused, trusted}, "an unsampled request left spans"


def test_request_id_is_checked_made_returned_forwarded_and_logged_without_tracing() -> None:
    p0, p1, d = stubs(0, 0, 0)
    px = proxy([p0, p1], [d], "--policy", "round_robin", "--workers", "1")
    httpx.post(p0.url + "/stub/fail", json={"status": 500, "count": 1})
    ids = []
    for rid in ("job-7:step/2", "bad id with spaces", "x" * 129, None):
        r = post(px.url, "/v1/completions", {"prompt": "who", "max_tokens": 2},
                 headers={} if rid is None else {"X-Request-Id": rid})
        assert r.status_code == 200
        ids.append(r.headers["x-request-id"])
    assert ids[0] == "job-7:step/2"
    for made in ids[1:]:  # not the client's: a fresh one
        assert len(made) == 32 and int(made, 16) >= 0
    assert len(set(ids)) == 4
    seen = [h for s in (p0, p1, d) for h in log(s)["headers"]]
    assert all(h["traceparent"] is None for h in seen), "a traceparent went out with tracing off"
    assert {h["x-request-id"] for h in seen} == set(ids)
    px.stop()
    err = px.proc.stderr.read() if px.proc.stderr is not None else ""
    retried = [line for line in err.splitlines() if "retrying the prefill leg" in line]
    assert retried and any(retried[0].endswith(f" [request {i}]") for i in ids), err[-2000:]
