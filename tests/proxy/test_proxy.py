"""The disaggregation proxy against stub engines (separate processes, real HTTP): flags, the two
legs, one well-formed stream, edge cases, errors, routing, health, metrics, admin, disconnects,
and trust (no client kv_transfer_params, no added seeds, dead engines ejected, the admin key, the
cluster secret on the ZMQ ports)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvferry.common import secret, zsock
from kvferry.common.netutil import free_port
from kvferry.proxy.instance_flags import OptionError
from kvferry.proxy.options import parse
from tests.polling import until
from tests.stub_procs import (
    Proc,
    events,
    log,
    post,
    proxy,
    stub,
    stubs,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def cluster(request) -> Iterator[dict]:
    """2 stub prefillers, 2 stub decoders, a plain stub for reference, one proxy in front (one
    process, or two workers: the same answers either way)."""
    *p, ref = stubs(0, 0, 0, 0, 0)
    procs = {"p": p[:2], "d": p[2:], "ref": ref}
    procs["proxy"] = proxy(procs["p"], procs["d"], "--policy", "round_robin", "--workers", str(request.param))
    try:
        yield procs
    finally:
        for p in [procs["proxy"], *procs["p"], *procs["d"], procs["ref"]]:
            p.stop()


def reset(c: dict) -> None:
    for s in [*c["p"], *c["d"]]:
        httpx.post(s.url + "/stub/reset")


# ---- flags ----

def test_lmcache_flags_with_consecutive_ports() -> None:
    o = parse(["--prefiller-host", "localhost", "--prefiller-port", "7100", "--num-prefillers", "2",
               "--decoder-host", "localhost", "--decoder-port", "7200", "--decoder-init-port", "7300",
               "--decoder-alloc-port", "7400", "--num-decoders", "2", "--proxy-host", "localhost",
               "--proxy-port", "7500", "--port", "9100"])
    assert [p.url for p in o.prefillers] == ["http://localhost:7100", "http://localhost:7101"]
    assert [(d.url, d.init_port, d.alloc_port) for d in o.decoders] == [
        ("http://localhost:7200", 7300, 7400), ("http://localhost:7201", 7301, 7401)]
    assert (o.port, o.proxy_port, o.host) == (9100, 7500, "127.0.0.1")
    o = parse(["--prefiller-host", "a,b", "--prefiller-port", "1,2", "--decoder", "http://c:3,4+5,6+7"])
    assert [p.url for p in o.prefillers] == ["http://a:1", "http://b:2"]
    assert o.decoders[0].init_ports == (4, 5) and o.decoders[0].alloc_ports == (6, 7)


def test_yaml_config_and_flags_win(tmp_path: Path) -> None:
    f = tmp_path / "proxy.yaml"
    f.write_text("prefiller: [http://p:1]\ndecoder: ['http://d:2,3,4']\nport: 9200\npolicy: round_robin\n")
    o = parse(["--config", str(f), "--port", "9300"])
    assert (o.port, o.policy, o.prefillers[0].url, o.decoders[0].alloc_port) == (9300, "round_robin", "http://p:1", 4)


def test_every_option_is_declared_once_for_flag_yaml_and_help(tmp_path: Path) -> None:
    """proxy/options.py's OPTIONS table makes the flags, the YAML keys and the help: every
    ProxyOptions setting has one entry, and a checked option reads alike from a flag and from YAML."""
    import dataclasses

    from kvferry.proxy.options import OPTIONS, ProxyOptions, parser

    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names))
    structured = {"prefillers", "decoders", "admin", "kv_events"}  # made from raw options by parse()
    fields = {f.name for f in dataclasses.fields(ProxyOptions)} - structured
    assert fields <= set(names), fields - set(names)
    helps = parser().format_help()
    assert all("--" + n.replace("_", "-") in helps for n in names)
    base = ["--prefiller", "http://p:1", "--decoder", "http://d:2,3,4"]
    f = tmp_path / "p.yaml"
    for opt, good, bad in [("stall_timeout", "2.5", "-1"), ("max_migrations", "3", "-1"), ("max_n", "4", "0"),
                           ("proxy_port", "7500", "70000"), ("policy", "load", None)]:
        flag = "--" + opt.replace("_", "-")
        f.write_text(f"{opt}: {good}\n")
        assert getattr(parse([*base, flag, good]), opt) == getattr(parse([*base, "--config", str(f)]), opt)
        if bad is not None:
            f.write_text(f"{opt}: {bad}\n")
            with pytest.raises(OptionError, match=flag):
                parse([*base, "--config", str(f)])
    f.write_text("max_n: many\n")
    with pytest.raises(OptionError, match="--max-n must be a positive integer, got 'many'"):
        parse([*base, "--config", str(f)])
    f.write_text("no_admin: 'yes'\n")
    with pytest.raises(OptionError, match="no_admin must be true or false"):
        parse([*base, "--config", str(f)])
    f.write_text("no_admin: true\ninsecure_discovery: false\n")
    o = parse([*base, "--config", str(f)])
    assert o.admin is False and o.insecure_discovery is False
    assert parse(base).admin is True


@pytest.mark.parametrize("argv,flag", [
    (["--decoder", "http://d:2,3,4"], "no prefiller"),
    (["--prefiller", "http://p:1"], "no decoder"),
    (["--prefiller", "ftp://p", "--decoder", "http://d:2,3,4"], "--prefiller"),
    (["--prefiller", "p:1", "--decoder", "http://d:2"], "--decoder"),
    (["--prefiller", "p:1", "--decoder", "http://d:2,3"], "--decoder"),
    (["--prefiller-host", "a,b,c", "--prefiller-port", "1,2", "--decoder", "d:2,3,4"], "--prefiller-host"),
    (["--prefiller-host", "a", "--decoder", "d:2,3,4"], "--prefiller-port"),
    (["--prefiller", "p:1", "--decoder-host", "d", "--decoder-port", "2"], "--decoder-init-port"),
    (["--prefiller", "p:1", "--decoder", "d:2,3,4", "--port", "70000"], "--port"),
    (["--prefiller", "p:1", "--decoder", "d:2,3,4", "--read-timeout", "0"], "--read-timeout"),
])
def test_bad_flags_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(OptionError, match=flag.replace("+", r"\+")):
        parse(argv)


def test_three_ways_to_run_it_and_one_line_errors() -> None:
    r = subprocess.run([sys.executable, "-m", "kvferry.proxy", "--prefiller", "http://a:1", "--decoder",
                        "http://a:1,2,3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "already registered" in r.stderr
    for cmd in ([sys.executable, str(REPO / "proxy" / "disagg_proxy_server.py")],
                [sys.executable, "-m", "kvferry.proxy"], [str(Path(sys.executable).parent / "kvferry-proxy")]):
        r = subprocess.run([*cmd, "--prefiller", "p:1"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("kvferry-proxy: error: no decoder")
        assert "Traceback" not in r.stderr


# ---- the two legs ----

def test_completion_equals_one_engine_and_legs_are_right(cluster) -> None:
    reset(cluster)
    url, ref = cluster["proxy"].url, cluster["ref"].url
    for prompt in ("Tell me a story", [11, 12, 13, 14, 15]):
        body = {"model": "stub", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        got = post(url, "/v1/completions", body).json()
        want = post(ref, "/v1/completions", body).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["choices"][0]["finish_reason"] == "length"
        assert got["usage"] == want["usage"]
        assert "kv_transfer_params" not in got and "token_ids" not in got["choices"][0]
    plogs = [r for p in cluster["p"] for r in log(p)["requests"]]
    dlogs = [r for d in cluster["d"] for r in log(d)["requests"]]
    assert len(plogs) == len(dlogs) == 2
    by_tid = {r["kv_transfer_params"]["transfer_id"]: r for r in dlogs}
    for pr in plogs:
        assert pr["max_tokens"] == 1 and pr["stream"] is False
        kv = pr["kv_transfer_params"]
        assert kv["ret_first_tok"] and set(kv["disagg_spec"]) == {"receiver_host", "receiver_init_port",
                                                                  "receiver_alloc_port"}
        dr = by_tid[kv["transfer_id"]]
        assert dr["kv_transfer_params"] == {"transfer_id": kv["transfer_id"], "kvferry_version": 1}
        assert dr["max_tokens"] == 5 and isinstance(dr["prompt"], list)  # token ids: no /tokenize call


def test_stream_is_one_well_formed_stream_with_usage(cluster) -> None:
    url, ref = cluster["proxy"].url, cluster["ref"].url
    body = {"model": "stub", "prompt": "Once upon a time", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    ev = events(url, "/v1/completions", body)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {"stub"}
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    want = post(ref, "/v1/completions", dict(body, stream=False)).json()
    assert text == want["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == want["usage"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_a_decoder_with_a_gap_between_tokens_streams_the_same_answer() -> None:
    """A real decoder sends a token per step: each read is relayed in the decoder connection's
    callback (StreamRelay.direct), not by the leg's task. The client's stream is the
    one the burst path gives: one id and time, the text, the token ids only when asked, the usage."""
    p0, d0, ref = stubs(0, 0.02, 0)
    px = proxy([p0], [d0], "--workers", "1")
    try:
        for want_ids in (False, True):
            body = {"model": "stub", "prompt": "a gap between tokens", "max_tokens": 8, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": want_ids}
            want = post(ref.url, "/v1/completions", dict(body, stream=False, return_token_ids=True)).json()
            ev = events(px.url, "/v1/completions", body)
            assert ev[-1] == "[DONE]"
            chunks = ev[:-1]
            assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
            assert len({c["created"] for c in chunks}) == 1
            toks = [c["choices"][0] for c in chunks if c["choices"]]
            assert len(toks) == 8  # a token a chunk: the first from the prefiller, each of the rest a read
            assert "".join(t["text"] for t in toks) == want["choices"][0]["text"]
            if want_ids:
                assert [i for t in toks for i in t["token_ids"]] == want["choices"][0]["token_ids"]
            else:
                assert all(t["token_ids"] is None for t in toks)
            assert toks[-1]["finish_reason"] == "length" and chunks[-1]["usage"] == want["usage"]
        # Chat: the prefiller's first token and the decoder's repeat dropped (greedy), or the decoder's
        # whole stream (sampled); either way the rest relayed a read at a time (StreamRelay), each
        # read's gap counted as a completion's is.
        def gaps() -> float:
            return sum(float(ln.split()[-1]) for ln in httpx.get(px.url + "/metrics", timeout=10).text.splitlines()
                       if ln.startswith("kvferry_proxy_inter_token_seconds_count"))
        for extra in ({"temperature": 0, "return_token_ids": True}, {"return_token_ids": False}):
            body = {"model": "stub", "messages": [{"role": "user", "content": "a gap in a chat"}], "max_tokens": 8,
                    "stream": True, "stream_options": {"include_usage": True}, **extra}
            want = post(ref.url, "/v1/chat/completions", dict(body, stream=False, return_token_ids=True)).json()
            counted = gaps()
            chunks = events(px.url, "/v1/chat/completions", body)[:-1]
            assert gaps() >= counted + 6, "a read at a time: at least the decoder's last 6 tokens' gaps"
            assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
            toks = [c["choices"][0] for c in chunks if c["choices"]]
            assert toks[0]["delta"]["role"] == "assistant"
            assert "".join(t["delta"].get("content") or "" for t in toks) == want["choices"][0]["message"]["content"]
            ids = [i for t in toks for i in t.get("token_ids") or []]
            assert ids == (want["choices"][0]["token_ids"] if extra["return_token_ids"] else [])
            assert toks[-1]["finish_reason"] == "length" and chunks[-1]["usage"] == want["usage"]
    finally:
        for p in (px, p0, d0, ref):
            p.stop()


def test_chat_both_ways_equals_one_engine(cluster) -> None:
    url, ref = cluster["proxy"].url, cluster["ref"].url
    body = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 7}
    want = post(ref, "/v1/chat/completions", body).json()
    got = post(url, "/v1/chat/completions", body).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"] == want["usage"]
    ev = events(url, "/v1/chat/completions", dict(body, stream=True, stream_options={"include_usage": True}))
    chunks = ev[:-1]
    assert ev[-1] == "[DONE]" and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == want["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == want["usage"]


def test_edge_cases(cluster) -> None:
    reset(cluster)
    url, ref = cluster["proxy"].url, cluster["ref"].url
    # max_tokens 1: one prefiller call, no KV sent, no decode leg.
    r = post(url, "/v1/completions", {"model": "stub", "prompt": "abc", "max_tokens": 1}).json()
    assert r["usage"]["completion_tokens"] == 1
    assert not any(log(d)["requests"] for d in cluster["d"])
    assert all("kv_transfer_params" not in q for p in cluster["p"] for q in log(p)["requests"])
    # The first token is EOS: no decode leg.
    r = post(url, "/v1/completions", {"model": "stub", "prompt": "<eos-first> x", "max_tokens": 9}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and not any(log(d)["requests"] for d in cluster["d"])
    # max_tokens missing: vLLM's default of 16 in total.
    r = post(url, "/v1/completions", {"model": "stub", "prompt": "abc"}).json()
    assert r["usage"]["completion_tokens"] == 16
    # A batch of prompts, logprobs and echo.
    body = {"model": "stub", "prompt": ["first one", "second one"], "max_tokens": 4, "logprobs": 1, "echo": True}
    r = post(url, "/v1/completions", body).json()
    for i, p in enumerate(body["prompt"]):
        want = post(ref, "/v1/completions", dict(body, prompt=p)).json()["choices"][0]
        got = r["choices"][i]
        assert got["index"] == i and got["text"] == want["text"] and got["text"].startswith(p)
        assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
    # n > 1: n samples, indexed and counted as vLLM does (prompt tokens once); streamed, a clear 400.
    body = {"model": "stub", "prompt": "x y", "n": 2, "max_tokens": 3}
    r = post(url, "/v1/completions", body).json()
    want = post(ref, "/v1/completions", dict(body, n=1)).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == [want["choices"][0]["text"]] * 2
    assert r["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert r["usage"]["completion_tokens"] == 2 * want["usage"]["completion_tokens"]
    r = post(url, "/v1/completions", dict(body, stream=True))
    assert r.status_code == 400 and "n=2" in r.json()["error"]["message"] and r.json()["error"]["param"] == "n"
    r = post(url, "/v1/completions", dict(body, n=1000))
    assert r.status_code == 400 and "--max-n" in r.json()["error"]["message"]


@pytest.mark.parametrize("raw,status", [(b"{not json", 400), (b"[1,2]", 400), (b'{"prompt": 5}', 400),
                                        (b'{"prompt": "x", "max_tokens": -1}', 400),
                                        (b'{"prompt": "x", "stream": "yes"}', 400), (b'{"messages": []}', 400)])
def test_malformed_bodies_get_a_json_400_and_change_nothing(cluster, raw: bytes, status: int) -> None:
    url = cluster["proxy"].url
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status and r.json()["error"]["message"]
    assert post(url, "/v1/completions", {"prompt": "still fine", "max_tokens": 3}).status_code == 200


def test_upstream_errors(cluster) -> None:
    url = cluster["proxy"].url
    body = {"model": "stub", "prompt": "retry me", "max_tokens": 3}
    # One prefiller fails once: retried on the other, the client never sees it.
    reset(cluster)
    httpx.post(cluster["p"][0].url + "/stub/fail", json={"status": 500, "count": 1})
    assert [post(url, "/v1/completions", body).status_code for _ in range(2)] == [200, 200]
    assert sum(len(log(p)["requests"]) for p in cluster["p"]) == 3  # two answered, one failed and retried
    # Both fail: a decoder serves the request whole (no prefiller could), the client never sees it.
    for p in cluster["p"]:
        httpx.post(p.url + "/stub/fail", json={"status": 503, "count": 1})
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200 and sum(len(log(p)["requests"]) for p in cluster["p"]) == 5
    assert sum(1 for d in cluster["d"] for b in log(d)["requests"] if "kv_transfer_params" not in b) == 1
    reset(cluster)
    # Both fail and every decoder too: a 502 with an OpenAI-style error and no traceback.
    for s in [*cluster["p"], *cluster["d"]]:
        httpx.post(s.url + "/stub/fail", json={"status": 503, "count": 1})
    r = post(url, "/v1/completions", body)
    assert r.status_code == 502 and "answered 503" in r.json()["error"]["message"] and "Traceback" not in r.text
    reset(cluster)
    # An engine 4xx is passed through as the engine wrote it.
    for p in cluster["p"]:
        httpx.post(p.url + "/stub/fail", json={"status": 400, "count": 1})
    r = post(url, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["message"] == "stub failure 400"
    reset(cluster)


def test_metrics_and_models(cluster) -> None:
    """Every family is on /metrics after one request whose prefillers both failed once (the decoder
    served it): with --workers N a counter shows only once it has a sample, so the test makes one
    rather than count on what ran before on the cluster."""
    url = cluster["proxy"].url
    reset(cluster)
    for p in cluster["p"]:
        httpx.post(p.url + "/stub/fail", json={"status": 500, "count": 1})
    assert post(url, "/v1/completions", {"prompt": "m", "max_tokens": 3}).status_code == 200
    reset(cluster)
    text = httpx.get(url + "/metrics").text
    for name in ("kvferry_proxy_prefill_seconds_bucket", "kvferry_proxy_ttft_seconds_bucket",
                 "kvferry_proxy_request_seconds_bucket", "kvferry_proxy_decoder_first_token_seconds_bucket",
                 "kvferry_proxy_inter_token_seconds_bucket", "kvferry_proxy_kv_transfer_wait_seconds_bucket",
                 'kvferry_proxy_requests_total{endpoint="/v1/completions",status="200"}',
                 "kvferry_proxy_in_flight", "kvferry_proxy_errors_total", "kvferry_proxy_instance_healthy"):
        assert name in text, name
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "stub"


def test_round_robin_and_affinity(cluster) -> None:
    reset(cluster)
    url = cluster["proxy"].url
    for i in range(4):
        post(url, "/v1/completions", {"prompt": f"rr {i}", "max_tokens": 2})
    assert [len(log(p)["requests"]) for p in cluster["p"]] == [2, 2]


def test_affinity_header_sticks() -> None:
    *ps, d0, d1 = stubs(0, 0, 0, 0)
    ds = [d0, d1]
    px = proxy(ps, ds, "--affinity-header", "x-session-id")
    try:
        for i in range(6):
            httpx.post(px.url + "/v1/completions", json={"prompt": f"a{i}", "max_tokens": 2},
                       headers={"x-session-id": "user-42"}, timeout=30).raise_for_status()
        counts = sorted(len(log(p)["requests"]) for p in ps)
        assert counts == [0, 6]
        assert sorted(len(log(d)["requests"]) for d in ds) == [0, 6]
    finally:
        for p in [px, *ps, *ds]:
            p.stop()


def test_a_burst_routed_while_its_prefills_run_spreads_evenly_over_idle_decoders() -> None:
    """Each request counts on its decoder from its route on: sixteen routed together, while the
    prefiller still holds every one of them, go eight to each decoder (counted only once their
    decode legs began, each route would see two idle decoders and pick either)."""
    p = stub(0, False, "--prompt-delay", "0.5")
    d0, d1 = stubs(0, 0)
    p.wait()
    px = proxy([p], [d0, d1], "--workers", "1")
    try:
        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as c:
                rs = await asyncio.gather(*(c.post(px.url + "/v1/completions",
                                                   json={"prompt": f"burst {i}", "max_tokens": 2})
                                            for i in range(16)))
            return [r.status_code for r in rs]
        assert asyncio.run(burst()) == [200] * 16
        assert [len(log(d)["requests"]) for d in (d0, d1)] == [8, 8]
        health = httpx.get(px.url + "/health").json()["instances"]
        assert [i["in_flight"] for i in health] == [0, 0, 0], health  # every claim given back
    finally:
        for x in (px, p, d0, d1):
            x.stop()


def test_health_ejects_dead_instances_and_admin_api() -> None:
    p0, *ds = stubs(0, 0, 0)
    ps = [p0]
    px = proxy(ps, ds)
    try:
        h = httpx.get(px.url + "/health").json()
        assert h["status"] == "ok" and len(h["instances"]) == 3
        ds[0].stop()
        # health checks every 0.3 s; two failures eject. Each worker checks for itself, so the read
        # that shows the eject is the one the test goes on with (another may not have seen it yet).
        reads: list[httpx.Response] = []

        def ejected() -> bool:
            reads.append(httpx.get(px.url + "/health"))
            return not {i["url"]: i for i in reads[-1].json()["instances"]}[ds[0].url]["healthy"]
        until(ejected, 60, "the dead decoder's eject")
        h = reads[-1]
        assert h.status_code == 200
        dead = [i for i in h.json()["instances"] if i["url"] == ds[0].url][0]
        assert not dead["healthy"]
        assert f'kvferry_proxy_instance_healthy{{instance="{dead["id"]}"' in httpx.get(px.url + "/metrics").text
        for i in range(4):  # all served by the live decoder
            assert httpx.post(px.url + "/v1/completions", json={"prompt": f"h{i}", "max_tokens": 3},
                              timeout=30).status_code == 200
        # Drain the last decoder: no decoder left, /health says 503 and requests get a JSON 503.
        live = [i for i in h.json()["instances"] if i["url"] == ds[1].url][0]
        assert httpx.post(f"{px.url}/admin/instances/{live['id']}/drain").json()["draining"]
        assert httpx.get(px.url + "/health").status_code == 503
        r = httpx.post(px.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 503 and "no healthy decoder" in r.json()["error"]["message"]
        # Add a fresh decoder at run time; remove the drained one.
        new = stub()
        ds.append(new)
        r = httpx.post(px.url + "/admin/instances", json={"role": "decoder", "url": new.url, "init_port": 7301,
                                                          "alloc_port": 7401})
        assert r.status_code == 201
        assert httpx.delete(f"{px.url}/admin/instances/{live['id']}").status_code == 200
        assert httpx.post(px.url + "/v1/completions", json={"prompt": "y", "max_tokens": 3},
                          timeout=30).status_code == 200
        assert len(log(new)["requests"]) == 1
        bad = httpx.post(px.url + "/admin/instances", json={"role": "decoder", "url": new.url})
        assert bad.status_code == 400
    finally:
        for p in [px, *ps, *ds]:
            p.stop()


def test_client_disconnect_cancels_the_decode_leg() -> None:
    p0, d0 = stubs(0, 0.05)
    ps, ds = [p0], [d0]
    px = proxy(ps, ds)
    try:
        with httpx.stream("POST", px.url + "/v1/completions", timeout=30,
                          json={"prompt": "long one", "max_tokens": 200, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break
        until(lambda: log(ds[0])["cut_streams"] != 0, 60, "the decode leg to be cut")
        assert log(ds[0])["cut_streams"] == 1
        assert httpx.post(px.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2},
                          timeout=30).status_code == 200
    finally:
        for p in [px, *ps, *ds]:
            p.stop()


def test_trust_a_client_that_closes_its_side_during_prefill_has_left() -> None:
    """A client that gives up closes its connection (FIN, not a reset) while the prefiller computes:
    the proxy takes it as gone, as vLLM's own server does, and sends no decode leg. (Taken as a
    half-close, the prompt was computed, sent and decoded for nobody.)"""
    p0 = stub(0, False, "--prompt-delay", "3")
    d0 = stub(0, False)
    p0.wait(), d0.wait()
    px = proxy([p0], [d0], "--health-interval", "60")
    u = urlsplit(px.url)

    def legs(role: str) -> int:
        return sum(i["in_flight"] for i in httpx.get(px.url + "/health").json()["instances"] if i["role"] == role)

    try:
        raw = json.dumps({"model": "stub", "prompt": "a prompt", "max_tokens": 8, "stream": True}).encode()
        with socket.create_connection((u.hostname, u.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
            until(lambda: legs("prefiller") == 1, 60, "the prefill leg sent")
        until(lambda: legs("prefiller") == 0 and legs("decoder") == 0, 60, "no leg in flight")
        assert log(d0)["requests"] == [], log(d0)["requests"]
        assert httpx.post(px.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2},
                          timeout=30).status_code == 200
    finally:
        for p in (px, p0, d0):
            p.stop()


def test_api_key_and_admin_key() -> None:
    p0, d0 = stubs(0, 0)
    ps, ds = [p0], [d0]
    px = proxy(ps, ds, "--api-key", "sekret", "--upstream-api-key", "up", "--admin-key", "admin-sekret")
    try:
        assert httpx.post(px.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        r = httpx.post(px.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer sekret"}, timeout=30)
        assert r.status_code == 200
        assert httpx.get(px.url + "/health").status_code == 200
        # /admin/* takes the admin key, and only it; the admin key is no client key.
        for auth in (None, "Bearer sekret", "Bearer admin-sekreT", "Bearer admin-sekret2", "admin-sekret"):
            r = httpx.get(px.url + "/admin/instances", headers={"Authorization": auth} if auth else {})
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", auth
            r = httpx.post(px.url + "/admin/instances/p0/drain", headers={"Authorization": auth} if auth else {})
            assert r.status_code == 401, auth
        assert not any(i["draining"] for i in httpx.get(px.url + "/health").json()["instances"])
        admin = {"Authorization": "Bearer admin-sekret"}
        assert len(httpx.get(px.url + "/admin/instances", headers=admin).json()["instances"]) == 2
        assert httpx.post(px.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=admin,
                          timeout=30).status_code == 401
    finally:
        for p in [px, *ps, *ds]:
            p.stop()


def test_admin_key_options(tmp_path: Path, monkeypatch) -> None:
    base = ["--prefiller", "p:1", "--decoder", "d:2,3,4"]
    monkeypatch.delenv("KVFERRY_ADMIN_KEY", raising=False)
    assert parse(base).admin_key is None and not parse(base).require_cluster_secret
    with pytest.raises(OptionError, match="--admin-key must differ from --api-key"):
        parse([*base, "--api-key", "same", "--admin-key", "same"])
    with pytest.raises(OptionError, match="--admin-key"):
        parse([*base, "--admin-key", " "])
    monkeypatch.setenv("KVFERRY_ADMIN_KEY", "from-env")
    assert parse(base).admin_key == "from-env"
    with pytest.raises(OptionError, match="must differ"):
        parse([*base, "--api-key", "from-env"])
    cfg = tmp_path / "p.yaml"
    cfg.write_text("admin_key: from-yaml\nrequire_cluster_secret: true\ncluster_secret_file: /x/s\n")
    o = parse([*base, "--config", str(cfg)])
    assert (o.admin_key, o.require_cluster_secret, o.cluster_secret_file) == ("from-yaml", True, "/x/s")
    assert parse([*base, "--config", str(cfg), "--admin-key", "flag"]).admin_key == "flag"
    cfg.write_text("require_cluster_secret: 'yes'\n")
    with pytest.raises(OptionError, match="require_cluster_secret"):
        parse([*base, "--config", str(cfg)])


def test_exposed_admin_api_warns_or_fails_at_start(monkeypatch) -> None:
    from kvferry.proxy.app import Proxy
    monkeypatch.delenv("KVFERRY_ADMIN_KEY", raising=False)
    monkeypatch.delenv("KVFERRY_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("KVFERRY_CLUSTER_SECRET_FILE", raising=False)
    base = ["--prefiller", "http://127.0.0.1:1", "--decoder", "http://127.0.0.1:2,3,4"]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("kvferry")  # the warning comes from common/zsock.py's one exposure rule
    log.addHandler(handler)
    try:
        wild = [*base, "--host", "0.0.0.0"]
        for argv in (base, [*wild, "--no-admin"], [*wild, "--admin-key", "k"]):
            records.clear()
            Proxy(parse(argv)).transfers.close()
            assert not [r.getMessage() for r in records if "--admin-key" in r.getMessage()], argv
    finally:
        log.removeHandler(handler)
    with pytest.raises(OptionError, match="--admin-key"):  # the admin API beyond loopback without one: never
        Proxy(parse([*base, "--host", "0.0.0.0"]))
    with pytest.raises(OptionError, match="--proxy-port"):  # a notification port open to all, no secret
        Proxy(parse([*base, "--admin-key", "k", "--proxy-host", "0.0.0.0", "--proxy-port", str(free_port()),
                     "--require-cluster-secret"]))
    # Without --proxy-host the notification socket binds loopback, not every interface.
    px = Proxy(parse([*base, "--proxy-port", str(free_port()), "--require-cluster-secret"]))
    assert px.notify_host == "127.0.0.1"
    px.transfers.close()
    Proxy(parse([*base, "--proxy-host", "127.0.0.1", "--proxy-port", "7500",
                 "--require-cluster-secret"])).transfers.close()
    # The one-line start-up error, exit code 2.
    r = subprocess.run([sys.executable, "-m", "kvferry.proxy", *base, "--host", "0.0.0.0", "--port", str(free_port()),
                        "--require-cluster-secret"], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("kvferry-proxy: error: ") and "--admin-key" in lines[0]


def test_locust_file_runs_headless_against_the_proxy(cluster, tmp_path: Path) -> None:
    r = subprocess.run([str(Path(sys.executable).parent / "locust"), "-f", str(REPO / "benchmarks" / "locustfile.py"),
                        "--headless", "-u", "4", "-r", "4", "-t", "4s", "--host", cluster["proxy"].url,
                        "--csv", str(tmp_path / "l"), "--only-summary"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, KVFERRY_LOCUST_MODEL="stub"))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = (tmp_path / "l_stats.csv").read_text().splitlines()
    agg = [x for x in rows if x.startswith(",Aggregated") or ",Aggregated," in x][0].split(",")
    head = rows[0].split(",")
    assert int(agg[head.index("Request Count")]) > 10 and int(agg[head.index("Failure Count")]) == 0


def test_refused_and_slow_upstreams_become_503_and_504() -> None:
    slow, fast = stubs(0.5, 0)
    dead, dead2 = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"  # nothing listens

    def start(*instances: str) -> Proc:
        port = free_port()
        return Proc(["-m", "kvferry.proxy", "--port", str(port), *instances, "--read-timeout", "0.3",
                     "--health-interval", "60"], f"http://127.0.0.1:{port}", "/metrics", wait=False)
    # The slow prefiller times out with nobody to retry on (504; its decoder would be as slow); the
    # refused prefiller's request goes to its decoder, which refuses too (503).
    timed, refused = start("--prefiller", slow.url, "--decoder", f"{fast.url},7300,7400"), \
        start("--prefiller", dead, "--decoder", f"{dead2},7300,7400")
    try:
        codes = set()
        for px in (timed.wait(), refused.wait()):
            r = httpx.post(px.url + "/v1/completions", json={"prompt": "s", "max_tokens": 3}, timeout=30)
            assert r.headers["content-type"].startswith("application/json") and "Traceback" not in r.text
            codes.add((r.status_code, r.json()["error"]["code"]))
        assert codes == {(503, "unreachable"), (504, "timeout")}, codes
        assert 'kvferry_proxy_errors_total{instance="p0",kind="timeout"}' in httpx.get(timed.url + "/metrics").text
        text = httpx.get(refused.url + "/metrics").text
        assert 'kvferry_proxy_errors_total{instance="p0",kind="unreachable"}' in text
        assert re.search(r'kvferry_proxy_errors_total\{instance="d\d+",kind="unreachable"\}', text), text
    finally:
        for p in (timed, refused, slow, fast):
            p.stop()


def test_receiver_notifications_feed_the_kv_wait_histogram() -> None:
    import zmq

    from kvferry.common.wire import messages as m
    p0, d0 = stubs(0, 0)
    ps, ds = [p0], [d0]
    note_port = free_port()
    px = proxy(ps, ds, "--proxy-host", "127.0.0.1", "--proxy-port", str(note_port))
    r = httpx.post(px.url + "/v1/completions", json={"prompt": "notify me", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200
    tid = log(ps[0])["requests"][0]["kv_transfer_params"]["transfer_id"]
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(f"tcp://127.0.0.1:{note_port}")
        push.send(b"garbage")  # dropped with a warning
        push.send(m.encode(m.ProxyNotification(transfer_id=tid, receiver_id="d0", num_chunks=1, num_tokens=9)))

        def counted() -> str | None:
            text = httpx.get(px.url + "/metrics").text
            return text if "kvferry_proxy_kv_transfer_wait_seconds_count 1.0" in text else None
        text = until(counted, 60, "the transfer wait's sample", every=0.1)
        assert "kvferry_proxy_kv_transfer_wait_seconds_count 1.0" in text
        assert 'kvferry_proxy_notifications_total{result="bad"} 1.0' in text
        assert 'kvferry_proxy_notifications_total{result="arrived"} 1.0' in text
        h = httpx.get(px.url + "/health")
        assert h.status_code == 200
        assert h.json()["background"]["notifications"] == {"ok": True, "restarts": 0, "last_error": None}
        assert h.json()["background"]["health_checks"]["ok"]
    finally:
        ctx.destroy(linger=0)
    px.stop()
    assert "dropped a bad frame on --proxy-port" in px.proc.stderr.read()


# ---- trust ----

EVIL = {"transfer_id": "evil-tid", "ret_first_tok": True,
        "disagg_spec": {"receiver_host": "evil.example", "receiver_init_port": [1], "receiver_alloc_port": [2]}}


def _all_logged(c: dict) -> list[dict]:
    return [r for s in [*c["p"], *c["d"]] for r in log(s)["requests"]]


def test_no_client_kv_transfer_params_and_no_added_seed_reach_any_engine(cluster) -> None:
    reset(cluster)
    url = cluster["proxy"].url
    n = 0
    for max_tokens in (1, 4):
        for stream in (False, True):
            for prompt in ("where does KV go", [11, 12, 13]):
                body = {"model": "stub", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                        "kv_transfer_params": EVIL, "vllm_xargs": {"kv_transfer_params": "evil.example", "x": 1}}
                if stream:
                    assert events(url, "/v1/completions", body)[-1] == "[DONE]"
                else:
                    assert post(url, "/v1/completions", body).status_code == 200
                n += 1
            for temperature in (0, 0.7):
                body = {"model": "stub", "messages": [{"role": "user", "content": "where does KV go"}],
                        "max_tokens": max_tokens, "stream": stream, "temperature": temperature,
                        "kv_transfer_params": EVIL}
                if stream:
                    assert events(url, "/v1/chat/completions", body)[-1] == "[DONE]"
                else:
                    assert post(url, "/v1/chat/completions", body).status_code == 200
                n += 1
    r = post(url, "/v1/completions", {"model": "stub", "prompt": ["a batch", "of two"], "max_tokens": 3,
                                      "kv_transfer_params": EVIL})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    legs = _all_logged(cluster)
    assert len(legs) > n
    decoders = {d.url for d in cluster["d"]}
    for leg in legs:
        assert "evil" not in json.dumps(leg), leg
        assert "seed" not in leg, leg  # the client sent none: no leg gets one
        kv = leg.get("kv_transfer_params")
        if kv is not None:  # the proxy's own, naming a real decoder
            assert kv["transfer_id"].startswith("kvf-")
            if "disagg_spec" in kv:
                assert kv["disagg_spec"]["receiver_host"] == "127.0.0.1"
        assert leg.get("vllm_xargs", {}).get("kv_transfer_params") is None
    assert decoders
    # A seed the client sent reaches every leg, unchanged.
    reset(cluster)
    post(url, "/v1/completions", {"model": "stub", "prompt": "seeded", "max_tokens": 4, "seed": 7})
    post(url, "/v1/chat/completions", {"model": "stub", "messages": [{"role": "user", "content": "seeded"}],
                                       "max_tokens": 4, "seed": 7, "temperature": 0.7})
    legs = _all_logged(cluster)
    assert len(legs) == 4 and all(leg["seed"] == 7 for leg in legs)


def _content_times(url: str, body: dict) -> list[tuple[float, str]]:
    """(seconds since the request, text) of each chat chunk with content."""
    out = []
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if c["delta"].get("content"):
                        out.append((time.perf_counter() - t0, c["delta"]["content"]))
    return out


def test_chat_first_token_comes_from_the_prefiller_only_when_the_decoder_repeats_it() -> None:
    p0, d0 = stubs(0, 0.15)
    ps, ds = [p0], [d0]
    px = proxy(ps, ds)
    try:
        chat = {"model": "stub", "messages": [{"role": "user", "content": "first token"}], "max_tokens": 2}
        # Sampled, no seed: the decoder samples its own first token; the client gets the decoder's
        # whole answer, never the prefiller's token (the stubs' samples differ).
        got = _content_times(px.url, dict(chat, temperature=0.8))
        pre, dec = log(ps[0])["answers"][-1], log(ds[0])["answers"][-1]
        assert pre and dec and not dec.startswith(pre)
        assert "".join(t for _, t in got) == dec and got[0][1] == dec[:len(got[0][1])]
        r = post(px.url, "/v1/chat/completions", dict(chat, temperature=0.8)).json()
        assert r["choices"][0]["message"]["content"] == log(ds[0])["answers"][-1]
        assert all("seed" not in q for s in (*ps, *ds) for q in log(s)["requests"])
        # Greedy, and a client seed: the prefiller's first token at once, long before the decoder's.
        for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
            got = _content_times(px.url, dict(chat, **extra))
            pre, dec = log(ps[0])["answers"][-1], log(ds[0])["answers"][-1]
            assert got[0][1] == pre and "".join(t for _, t in got) == dec
            assert len(got) == 2 and got[1][0] - got[0][0] > 0.15, got  # the decoder sleeps 0.15 s a token
    finally:
        for p in [px, *ps, *ds]:
            p.stop()


def _instances(url: str) -> dict[str, dict]:
    return {i["url"]: i for i in httpx.get(url + "/health").json()["instances"]}


def test_a_dead_engine_is_ejected_at_once() -> None:
    *ps, d0, d1 = stubs(0, 0, 0, 0, 0)
    ds = [d0, d1]
    # Health checks every 60 s: only the probe after a failed request can eject in time. One
    # worker: /health answers from either of two, and the other learns of an eject a moment later
    # (under load, after the next requests were routed: seen with -n 2).
    # Health checks every 600 s: an eject within the waits below is the failure's own, never a check's.
    px = proxy(ps, ds, "--health-interval", "600", "--policy", "round_robin", "--workers", "1")
    body = {"model": "stub", "prompt": "are you alive", "max_tokens": 3}
    try:
        ids = {u: i["id"] for u, i in _instances(px.url).items()}
        # 1. p0's EngineCore died: requests get vLLM's 500, /health 503. The client never sees it
        #    (retried on another prefiller) and p0 is out at once.
        httpx.post(ps[0].url + "/stub/fail", json={"dead": True})
        assert post(px.url, "/v1/completions", body).status_code == 200
        assert len(log(ps[0])["requests"]) == 1
        until(lambda: not _instances(px.url)[ps[0].url]["healthy"], 60, "p0's eject")
        for _ in range(4):
            assert post(px.url, "/v1/completions", body).status_code == 200
        assert len(log(ps[0])["requests"]) == 1
        # 2. p1 is killed: the next request that picks it is retried, and p1 is out at once.
        os.killpg(ps[1].proc.pid, signal.SIGKILL)
        ps[1].proc.wait(5)
        for _ in range(2):  # round robin over p1 and p2: one of these picks p1
            assert post(px.url, "/v1/completions", body).status_code == 200
        until(lambda: not _instances(px.url)[ps[1].url]["healthy"], 60, "p1's eject")
        # 3. A decoder dies mid-stream (vLLM's error event): the stream migrates to the other
        #    decoder (no error event, the whole answer), the decoder is out at once, and the next
        #    streams go to the other one.
        httpx.post(ds[0].url + "/stub/fail", json={"die_mid_stream": True})
        n0 = len(log(ds[0])["requests"])
        for _ in range(2):  # round robin over the decoders: one of these picks d0
            ev = events(px.url, "/v1/completions", dict(body, stream=True, max_tokens=4))
            assert ev[-1] == "[DONE]" and not any("error" in e for e in ev[:-1])
        assert len(log(ds[0])["requests"]) == n0 + 1
        until(lambda: not _instances(px.url)[ds[0].url]["healthy"], 60, "d0's eject")
        n = len(log(ds[0])["requests"])
        for _ in range(3):
            ev = events(px.url, "/v1/completions", dict(body, stream=True, max_tokens=4))
            assert not any("error" in e for e in ev[:-1])
        assert len(log(ds[0])["requests"]) == n
        h = httpx.get(px.url + "/health")
        assert h.status_code == 200  # p2 and d1 serve
        text = httpx.get(px.url + "/metrics").text
        assert 'kvferry_proxy_migrations_total{reason="stream_error"} 1.0' in text
        for inst, kind in ((ps[0], "upstream_5xx"), (ps[1], "unreachable"), (ds[0], "stream_error")):
            assert f'kvferry_proxy_errors_total{{instance="{ids[inst.url]}",kind="{kind}"}}' in text, kind
            assert f'kvferry_proxy_instance_healthy{{instance="{ids[inst.url]}",role=' in text
            role = "decoder" if inst in ds else "prefiller"
            assert f'instance="{ids[inst.url]}",role="{role}",url="{inst.url}"}} 0.0' in text
    finally:
        px.stop()
        for p in [*ps, *ds]:
            p.stop()
    err = px.proc.stderr.read()
    for inst, leg, kind in ((ps[0], "prefill", "upstream_5xx"), (ps[1], "prefill", "unreachable"),
                            (ds[0], "decode", "stream_error")):
        role = "decoder" if inst in ds else "prefiller"
        assert f"{role} {inst.url} ({ids[inst.url]}) failed on the {leg} leg: {kind}" in err, err
        assert f"{role} {inst.url} ({ids[inst.url]}) ejected" in err, err
    assert "answered 500" in err and "EngineCore encountered an issue" in err


def test_cluster_secret_on_the_proxys_zmq_sockets(tmp_path: Path) -> None:
    import zmq

    from kvferry.common.wire import messages as m
    path = tmp_path / "secret"
    secret.write_file(str(path), "s3cret-" * 6)
    right = zsock.Trust(secret.from_file(str(path), "test"))
    wrong = zsock.Trust(secret.from_text("another-secret-" * 3, "test"))
    ctx = zmq.Context()
    alloc_port, note_port = free_port(), free_port()
    alloc = zsock.listen(ctx, zmq.ROUTER, right, "127.0.0.1", alloc_port, "test alloc port")
    p0, d0 = stubs(0, 0)
    ps, ds = [p0], [d0]
    port = free_port()
    px = Proc(["-m", "kvferry.proxy", "--port", str(port), "--prefiller", ps[0].url,
               "--decoder", f"{ds[0].url},{free_port()},{alloc_port}", "--proxy-host", "127.0.0.1",
               "--proxy-port", str(note_port), "--cluster-secret-file", str(path), "--require-cluster-secret"],
              f"http://127.0.0.1:{port}", "/metrics")
    try:
        # An abort reaches a decoder's alloc port that takes only the cluster's peers.
        r = post(px.url, "/v1/completions", {"model": "stub", "prompt": "<eos-first> now", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        tid = log(ps[0])["requests"][-1]["kv_transfer_params"]["transfer_id"]
        assert alloc.poll(5000), "no abort reached the alloc port"
        _, frame = alloc.recv_multipart()
        abort = m.decode(frame, expect=m.AbortTransfer)
        assert (abort.transfer_id, abort.generation, abort.final) == (tid, 0, False)
        # Notifications: only a peer with the secret gets through.
        r = post(px.url, "/v1/completions", {"model": "stub", "prompt": "notify", "max_tokens": 3})
        assert r.status_code == 200
        tid = log(ps[0])["requests"][-1]["kv_transfer_params"]["transfer_id"]
        note = m.encode(m.ProxyNotification(transfer_id=tid, receiver_id="d0", num_chunks=1, num_tokens=6))
        url = f"tcp://127.0.0.1:{note_port}"
        strangers = [ctx.socket(zmq.PUSH), zsock.connect(ctx, zmq.PUSH, wrong, url)]
        strangers[0].connect(url)
        for s in strangers:
            s.send(note)
        time.sleep(0.5)  # a sleep (window): the strangers' notices are given time to (not) count
        text = httpx.get(px.url + "/metrics").text
        assert "kvferry_proxy_kv_transfer_wait_seconds_count 0.0" in text
        assert "kvferry_proxy_notifications_total{" not in text
        friend = zsock.connect(ctx, zmq.PUSH, right, url)  # kept open: no linger, a closed socket drops its queue
        friend.send(note)
        until(lambda: "kvferry_proxy_kv_transfer_wait_seconds_count 1.0" in httpx.get(px.url + "/metrics").text, 5.0,
              "the friend's notice to count")
        assert 'kvferry_proxy_notifications_total{result="arrived"} 1.0' in httpx.get(px.url + "/metrics").text
        assert post(px.url, "/v1/completions", {"model": "stub", "prompt": "still", "max_tokens": 3}).status_code == 200
        assert httpx.get(px.url + "/health").json()["background"]["notifications"]["ok"]
    finally:
        px.stop()
        ctx.destroy(linger=0)
    assert "s3cret" not in px.proc.stderr.read()
