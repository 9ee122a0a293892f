"""The disaggregation proxy against stub engines (separate processes, real HTTP): flags, the two
legs, one well-formed stream, edge cases, errors, routing, health, metrics, admin, disconnects."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.common.netutil import free_port
from kvferry.proxy.options import OptionError, parse

REPO = Path(__file__).resolve().parent.parent


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(url)


_ALL: list[Proc] = []


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    """Stops what a test started even when the test failed before its own cleanup."""
    n = len(_ALL)
    yield
    for p in _ALL[n:]:
        p.stop()
    del _ALL[n:]


class Proc:
    def __init__(self, args: list[str], url: str, probe: str) -> None:
        self.url = url
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        _ALL.append(self)
        wait_http(url + probe, self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def stub(delay: float = 0.0) -> Proc:
    port = free_port()
    return Proc(["-m", "kvferry.proxy.stub_engine", "--port", str(port), "--token-delay", str(delay)],
                f"http://127.0.0.1:{port}", "/health")


def proxy(prefillers: list[Proc], decoders: list[Proc], *extra: str) -> Proc:
    port = free_port()
    args = ["-m", "kvferry.proxy", "--port", str(port), "--health-interval", "0.3"]
    for p in prefillers:
        args += ["--prefiller", p.url]
    for d in decoders:
        args += ["--decoder", f"{d.url},{free_port()},{free_port()}"]
    return Proc(args + list(extra), f"http://127.0.0.1:{port}", "/metrics")


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:
    """2 stub prefillers, 2 stub decoders, a plain stub for reference, one proxy in front."""
    procs = {"p": [stub(), stub()], "d": [stub(), stub()], "ref": stub()}
    procs["proxy"] = proxy(procs["p"], procs["d"], "--policy", "round_robin")
    try:
        yield procs
    finally:
        for p in [procs["proxy"], *procs["p"], *procs["d"], procs["ref"]]:
            p.stop()


def reset(c: dict) -> None:
    for s in [*c["p"], *c["d"]]:
        httpx.post(s.url + "/stub/reset")


def log(s: Proc) -> dict:
    return httpx.get(s.url + "/stub/log").json()


def post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30, **kw)


def events(url: str, path: str, body: dict) -> list:
    out = []
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


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
        assert dr["kv_transfer_params"] == {"transfer_id": kv["transfer_id"]}
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
    # n > 1: a clear 400.
    r = post(url, "/v1/completions", {"model": "stub", "prompt": "x", "n": 2})
    assert r.status_code == 400 and "n=2" in r.json()["error"]["message"]


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
    # Both fail: a 502 with an OpenAI-style error and no traceback.
    for p in cluster["p"]:
        httpx.post(p.url + "/stub/fail", json={"status": 503, "count": 1})
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
    url = cluster["proxy"].url
    post(url, "/v1/completions", {"prompt": "m", "max_tokens": 3})
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
    ps, ds = [stub(), stub()], [stub(), stub()]
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


def test_health_ejects_dead_instances_and_admin_api() -> None:
    ps, ds = [stub()], [stub(), stub()]
    px = proxy(ps, ds)
    try:
        h = httpx.get(px.url + "/health").json()
        assert h["status"] == "ok" and len(h["instances"]) == 3
        ds[0].stop()
        time.sleep(1.2)  # health checks every 0.3 s; two failures eject
        h = httpx.get(px.url + "/health")
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
    ps, ds = [stub()], [stub(delay=0.05)]
    px = proxy(ps, ds)
    try:
        with httpx.stream("POST", px.url + "/v1/completions", timeout=30,
                          json={"prompt": "long one", "max_tokens": 200, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break
        deadline = time.monotonic() + 5
        while log(ds[0])["cut_streams"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log(ds[0])["cut_streams"] == 1
        assert httpx.post(px.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2},
                          timeout=30).status_code == 200
    finally:
        for p in [px, *ps, *ds]:
            p.stop()


def test_api_key() -> None:
    ps, ds = [stub()], [stub()]
    px = proxy(ps, ds, "--api-key", "sekret", "--upstream-api-key", "up")
    try:
        assert httpx.post(px.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        r = httpx.post(px.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer sekret"}, timeout=30)
        assert r.status_code == 200
        assert httpx.get(px.url + "/health").status_code == 200
    finally:
        for p in [px, *ps, *ds]:
            p.stop()


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
    ps = [stub(delay=0.5)]
    dead, dead2 = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"  # nothing listens
    port = free_port()
    px = Proc(["-m", "kvferry.proxy", "--port", str(port), "--prefiller", ps[0].url, "--prefiller", dead,
               "--decoder", f"{dead2},7300,7400", "--read-timeout", "0.3", "--health-interval", "60",
               "--policy", "round_robin"], f"http://127.0.0.1:{port}", "/metrics")
    try:
        codes = set()
        # The slow prefiller times out, the retry finds the other one dead (503); then the dead one
        # is ejected and the next timeout has nobody to retry on (504).
        for i in range(2):
            r = httpx.post(px.url + "/v1/completions", json={"prompt": f"s{i}", "max_tokens": 3}, timeout=30)
            assert r.headers["content-type"].startswith("application/json") and "Traceback" not in r.text
            codes.add((r.status_code, r.json()["error"]["code"]))
        assert codes == {(503, "unreachable"), (504, "timeout")}, codes
        text = httpx.get(px.url + "/metrics").text
        assert 'kvferry_proxy_errors_total{instance="p1",kind="unreachable"}' in text
        assert 'kvferry_proxy_errors_total{instance="p0",kind="timeout"}' in text
    finally:
        for p in [px, *ps]:
            p.stop()


def test_receiver_notifications_feed_the_kv_wait_histogram() -> None:
    import zmq

    from kvferry.common import messages as m
    ps, ds = [stub()], [stub()]
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
        deadline = time.monotonic() + 5
        text = ""
        while time.monotonic() < deadline:
            text = httpx.get(px.url + "/metrics").text
            if "kvferry_proxy_kv_transfer_wait_seconds_count 1.0" in text:
                break
            time.sleep(0.1)
        assert "kvferry_proxy_kv_transfer_wait_seconds_count 1.0" in text
        assert httpx.get(px.url + "/health").status_code == 200
    finally:
        ctx.destroy(linger=0)
