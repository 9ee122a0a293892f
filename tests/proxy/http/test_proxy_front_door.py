"""The proxy's front door against stub engines (real processes, real sockets): its limits answer
with OpenAI-shaped JSON errors while other requests keep flowing, an engine's answer without
token ids or with wrong-typed fields never becomes a truncated 200, and anonymous callers see no
internal ports."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.stub_procs import (
    events,
    log,
    post,
    proxy,
    stub,
    stubs,
)


def _openai_error(r: httpx.Response, status: int) -> dict:
    """The error body, after checking it is OpenAI's shape."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


@contextlib.contextmanager
def _two_streams(url: str, body: dict) -> Iterator[list[httpx.Response]]:
    """Two streamed /v1/completions requests open at once, each on its own connection."""
    with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
        with c1.stream("POST", url + "/v1/completions", json=body) as r1, \
                c2.stream("POST", url + "/v1/completions", json=body) as r2:
            yield [r1, r2]


# ---- limits ----

def test_body_size_and_batch_limits_are_json_errors() -> None:
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0], "--max-body-bytes", "100000", "--max-batch-prompts", "4")
    big = {"model": "stub", "prompt": "x" * 200_000, "max_tokens": 2}
    err = _openai_error(post(px.url, "/v1/completions", big), 413)
    assert "--max-body-bytes" in err["message"] and err["code"] == "body_too_large"
    # Without a Content-Length (chunked), refused as the count passes the limit.
    chunks = (json.dumps(big)[i:i + 8192].encode() for i in range(0, len(json.dumps(big)), 8192))
    r = httpx.post(px.url + "/v1/chat/completions", content=chunks, headers={"content-type": "application/json"})
    assert _openai_error(r, 413)["code"] == "body_too_large"
    err = _openai_error(post(px.url, "/v1/completions", {"model": "stub", "prompt": [f"p{i}" for i in range(5)],
                                                         "max_tokens": 2}), 400)
    assert err["param"] == "prompt" and "--max-batch-prompts" in err["message"]
    assert not log(p0)["requests"]  # nothing was fanned out
    r = post(px.url, "/v1/completions", {"model": "stub", "prompt": [f"p{i}" for i in range(4)], "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_a_full_proxy_answers_503_with_retry_after_and_recovers() -> None:
    p0, d0 = stubs(0, 0.05)
    px = proxy([p0], [d0], "--max-in-flight", "2")
    with _two_streams(px.url, {"model": "stub", "prompt": "hold", "max_tokens": 30, "stream": True}) as rs:
        its = [r.iter_lines() for r in rs]  # kept: a dropped iterator closes its stream
        assert all(next(it).startswith("data: ") for it in its)  # both are in flight now
        r = post(px.url, "/v1/completions", {"model": "stub", "prompt": "third", "max_tokens": 2})
        err = _openai_error(r, 503)
        assert r.headers["retry-after"] == "1" and "--max-in-flight" in err["message"]
        assert httpx.get(px.url + "/health").status_code == 200  # not gated
        for it in its:
            assert [x for x in it if x][-1] == "data: [DONE]"
    assert post(px.url, "/v1/completions", {"model": "stub", "prompt": "after", "max_tokens": 2}).status_code == 200
    assert 'kvferry_proxy_errors_total{instance="proxy",kind="overloaded"} 1.0' in httpx.get(px.url + "/metrics").text


def test_a_failed_sample_cancels_the_others() -> None:
    # Two prompts fan out; the decoder fails the first decode leg it sees (400, not retried) and
    # takes 600 x 0.1 s = 60 s over the other: the client hears the 400 and the other leg ends with
    # it, not after (the answer comes far sooner than the other leg would end), outside --max-in-flight.
    p0, d0 = stubs(0, 0.1)
    px = proxy([p0], [d0])
    httpx.post(d0.url + "/stub/fail", json={"status": 400, "count": 1})
    t0 = time.monotonic()
    r = post(px.url, "/v1/completions", {"model": "stub", "prompt": ["a", "b"], "max_tokens": 601})
    assert r.status_code == 400 and time.monotonic() - t0 < 30, r.text
    dec = [i for i in httpx.get(px.url + "/health").json()["instances"] if i["role"] == "decoder"]
    assert dec[0]["in_flight"] == 0, dec


def test_upstream_connections_are_pooled_per_instance() -> None:
    p0, d0 = stubs(0, 0.02)
    px = proxy([p0], [d0], "--upstream-connections", "1", "--workers", "1")  # with N workers: N, one each
    with _two_streams(px.url, {"model": "stub", "prompt": "pool", "max_tokens": 10, "stream": True}) as rs:
        texts = [list(r.iter_lines()) for r in rs]
    assert all(t[-2] == "data: [DONE]" for t in texts)  # the second waited for the connection
    assert log(d0)["max_active"] == 1 and len(log(d0)["requests"]) == 2


def test_a_body_that_trickles_in_does_not_hold_up_other_requests() -> None:
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0])
    u = urlsplit(px.url)
    s = socket.create_connection((u.hostname, u.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000000\r\n\r\n" + b'{"prompt": "' + b"a" * 1_000_000)
        for i in range(3):  # the large body is still arriving: these are answered meanwhile
            assert post(px.url, "/v1/completions", {"model": "stub", "prompt": f"meanwhile {i}",
                                                    "max_tokens": 3}).status_code == 200
    finally:
        s.close()
    assert post(px.url, "/v1/completions", {"model": "stub", "prompt": "after", "max_tokens": 3}).status_code == 200


# ---- what engines answer ----

def test_a_prefiller_without_token_ids_never_truncates() -> None:
    """An engine that ignores return_token_ids: the decoder gets the client's prompt and
    regenerates the first token; every answer is whole (it was one token with 200 OK)."""
    ref, p0, d0 = [s.wait() for s in (stub(0, False), stub(0, False, "--no-token-ids"),
                                       stub(0, False, "--no-token-ids"))]
    px = proxy([p0], [d0])
    body = {"model": "stub", "prompt": "no ids here", "max_tokens": 9, "temperature": 0}
    want = post(ref.url, "/v1/completions", body).json()
    got = post(px.url, "/v1/completions", body).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]
    assert got["choices"][0]["finish_reason"] == "length"
    for _ in range(5):
        ev = events(px.url, "/v1/completions", dict(body, stream=True, stream_options={"include_usage": True}))
        assert ev[-1] == "[DONE]" and not any("error" in e for e in ev[:-1])
        text = "".join(c["choices"][0]["text"] for c in ev[:-1] if c["choices"])
        assert text == want["choices"][0]["text"] and ev[-2]["usage"] == want["usage"]
        assert len({c["id"] for c in ev[:-1]}) == 1
    legs = log(d0)["requests"]
    assert len(legs) == 6 and all(q["prompt"] == "no ids here" and q["max_tokens"] == 9 for q in legs)
    assert all(q["kv_transfer_params"]["transfer_id"].startswith("kvf-") for q in legs)
    assert 'kvferry_proxy_errors_total{instance="p0",kind="no_token_ids"} 6.0' in httpx.get(px.url + "/metrics").text


@pytest.mark.parametrize("path,answer,field", [
    ("/v1/completions", {"choices": []}, "choices[0]"),
    ("/v1/completions", {"id": "x"}, "choices[0]"),
    ("/v1/completions", [1, 2], "not a JSON object"),
    ("/v1/completions", {"choices": [{"text": 5, "finish_reason": "length"}]}, "choices[0].text"),
    ("/v1/completions", {"choices": [{"text": "a", "finish_reason": 3}]}, "finish_reason"),
    ("/v1/completions", {"choices": [{"text": "a", "token_ids": [5], "prompt_token_ids": [1]}], "usage": "many"},
     "usage"),
    ("/v1/completions", {"choices": [{"text": "a", "token_ids": [5], "prompt_token_ids": [1]}],
                         "usage": {"prompt_tokens": "1"}}, "usage.prompt_tokens"),
    ("/v1/chat/completions", {"choices": [{"message": "hi"}]}, "choices[0].message"),
    ("/v1/chat/completions", {"choices": [{"message": {"content": ["x"]}}]}, "message.content"),
])
def test_a_wrong_answer_is_a_502_naming_the_field(path: str, answer, field: str) -> None:
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0])
    httpx.post(p0.url + "/stub/fail", json={"answer": answer})
    body = {"model": "stub", "max_tokens": 4}
    body.update({"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]})
    err = _openai_error(post(px.url, path, body), 502)
    assert field in err["message"] and "prefiller" in err["message"] and err["code"] == "bad_answer", err
    assert post(px.url, path, body).status_code == 200  # a bad answer ejects nobody


@pytest.mark.parametrize("kvp,reason", [
    ({"error": "kv_transfer_params.disagg_spec.receiver_host: Expected `str`"}, "did not send the KV: "
                                                                                "kv_transfer_params"),
    ({"transfer_id": "t", "first_tok": 5, "kvferry_version": 2}, "version 2; this kvferry speaks version 1"),
    ({"transfer_id": 7}, "kv_transfer_params.transfer_id"),
])
def test_a_prefiller_that_refused_the_transfer_is_a_502_and_no_decode_leg(kvp: dict, reason: str) -> None:
    """The prefiller's connector refused kv_transfer_params (or is another kvferry version): the
    client hears why at once, and the decoder never waits for KV that will not come."""
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0])
    answer = {"choices": [{"text": " w1", "token_ids": [301], "prompt_token_ids": [1, 2], "finish_reason": "length"}],
              "kv_transfer_params": kvp}
    httpx.post(p0.url + "/stub/fail", json={"answer": answer})
    err = _openai_error(post(px.url, "/v1/completions", {"model": "stub", "prompt": "x", "max_tokens": 4}), 502)
    assert err["code"] == "kv_refused" and reason in err["message"] and p0.url in err["message"], err
    assert log(d0)["requests"] == []
    assert 'kvferry_proxy_errors_total{instance="p0",kind="kv_refused"} 1.0' in httpx.get(px.url + "/metrics").text
    ok = post(px.url, "/v1/completions", {"model": "stub", "prompt": "x", "max_tokens": 4})
    assert ok.status_code == 200 and log(d0)["requests"][0]["kv_transfer_params"]["kvferry_version"] == 1


def test_a_decoder_answer_that_does_not_fit_is_a_502() -> None:
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0])
    httpx.post(d0.url + "/stub/fail", json={"answer": {"choices": [{"text": None, "token_ids": 7}]}})
    err = _openai_error(post(px.url, "/v1/completions", {"model": "stub", "prompt": "x", "max_tokens": 4}), 502)
    assert "decoder" in err["message"] and "token_ids" in err["message"]


# ---- request shapes the prefill-only path and echo got wrong ----

def test_max_tokens_1_streamed_with_usage_and_echo() -> None:
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0])
    body = {"model": "stub", "prompt": "one token", "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    ev = events(px.url, "/v1/completions", body)
    assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 1
    leg = log(p0)["requests"][-1]
    assert leg["stream"] is False and "stream_options" not in leg
    # echo: the prompt, then the completion, as one engine answers (both legs and the single one).
    ref = stub()
    for max_tokens in (1, 5):
        for stream in (False, True):
            body = {"model": "stub", "prompt": "echo me", "max_tokens": max_tokens, "echo": True, "stream": stream}
            want = post(ref.url, "/v1/completions", dict(body, stream=False)).json()["choices"][0]["text"]
            if stream:
                got = "".join(c["choices"][0]["text"] for c in events(px.url, "/v1/completions", body)[:-1]
                              if c["choices"])
            else:
                got = post(px.url, "/v1/completions", body).json()["choices"][0]["text"]
            assert got == want and got.startswith("echo me") and len(got) > len("echo me"), (max_tokens, stream)


# ---- internal ports ----

def test_health_shows_receiver_ports_only_to_the_admin_key() -> None:
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0], "--admin-key", "adm")
    anon = httpx.get(px.url + "/health").json()
    dec = [i for i in anon["instances"] if i["role"] == "decoder"][0]
    assert "init_ports" not in dec and "alloc_ports" not in dec and dec["healthy"]
    assert "init_ports" not in httpx.get(px.url + "/health", headers={"Authorization": "Bearer nope"}).text
    full = httpx.get(px.url + "/health", headers={"Authorization": "Bearer adm"}).json()
    assert [i for i in full["instances"] if i["role"] == "decoder"][0]["init_ports"]
    metrics = httpx.get(px.url + "/metrics").text
    for port in dec.get("init_ports", []) + [i for i in full["instances"] if i["role"] == "decoder"][0]["alloc_ports"]:
        assert str(port) not in metrics
