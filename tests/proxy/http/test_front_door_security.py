"""The proxy's front door and admin API against hostile clients (real proxy processes in front of
stub engines, real sockets): no client key opens the admin API, a browser's cross-site or
DNS-rebinding admin call changes nothing, an unauthenticated body is refused from its head
before it is sent, a request that stops arriving is closed within --request-timeout, and
connections past --max-connections get a clear 503."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from kvferry.common.netutil import free_port
from kvferry.proxy.options import parse
from tests.polling import until
from tests.raw_http import answer, closed_by_the_timeout, closed_within, connect
from tests.stub_procs import Proc, proxy, stubs

CLIENT, ADMIN = "client-key-0123", "admin-key-4567"
REQUEST_S = 1.0  # the guarded proxy's --request-timeout
CAP = 4  # the client-key proxy's --max-connections


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Proc]]:
    procs = stubs(0, 0.05)  # the decoder streams a token per 50 ms: a stream outlasts --request-timeout
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def client_key_only(engines: list[Proc]) -> Iterator[Proc]:
    """--api-key and no --admin-key: the admin API is closed; at most CAP connections (one process:
    the cap is each worker's)."""
    px = proxy(engines[:1], engines[1:], "--api-key", CLIENT, "--max-connections", str(CAP), "--workers", "1")
    yield px
    px.stop()


@pytest.fixture(scope="module")
def guarded(engines: list[Proc]) -> Iterator[Proc]:
    px = proxy(engines[:1], engines[1:], "--api-key", CLIENT, "--admin-key", ADMIN, "--request-timeout", str(REQUEST_S))
    yield px
    px.stop()


@pytest.fixture(scope="module")
def keyless(engines: list[Proc]) -> Iterator[Proc]:
    """No key at all (loopback, LMCache's drop-in): the admin API is open to local callers."""
    px = proxy(engines[:1], engines[1:], "--allowed-host", "proxy.test")
    yield px
    px.stop()


def _port(px: Proc) -> int:
    port = urlsplit(px.url).port
    assert port is not None
    return port


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _instances(px: Proc, **headers: str) -> list[tuple]:
    """What the admin API can change: each instance's id, role, URL and drain mark."""
    r = httpx.get(px.url + "/admin/instances", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return [(i["id"], i["role"], i["url"], i["draining"]) for i in r.json()["instances"]]


def test_connections_past_the_cap_get_a_clear_503_security(client_key_only: Proc) -> None:
    held = [connect(_port(client_key_only)) for _ in range(CAP)]
    try:
        for s in held:  # each one is served (none was refused)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert answer(s)[0] == 200
        extra = connect(_port(client_key_only))
        status, headers, body = answer(extra)
        err = json.loads(body)["error"]
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close", headers
        assert err["code"] == "too_many_connections" and "--max-connections" in err["message"], err
        closed_within(extra, 5)
        held.pop().close()

        def served() -> bool:
            with connect(_port(client_key_only)) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                return answer(s)[0] == 200
        until(served, 60, "a connection served once one of the capped ones closed")
    finally:
        for s in held:
            s.close()
    metrics = httpx.get(client_key_only.url + "/metrics", timeout=10).text
    assert 'kvferry_proxy_dropped_connections_total{reason="max_connections"} 1.0' in metrics


def test_a_client_key_never_opens_the_admin_api_security(client_key_only: Proc, guarded: Proc) -> None:
    # --api-key without --admin-key: the admin API is closed, whatever key is sent.
    n = len(httpx.get(client_key_only.url + "/health", timeout=10).json()["instances"])
    for auth in ({}, {"Authorization": f"Bearer {CLIENT}"}):
        err = _error(httpx.get(client_key_only.url + "/admin/instances", headers=auth, timeout=10), 403)
        assert err["code"] == "admin_closed" and "--admin-key" in err["message"], err
        assert "KVFERRY_ADMIN_KEY" in err["message"]
        r = httpx.post(client_key_only.url + "/admin/instances", headers=auth, timeout=10,
                       json={"role": "prefiller", "url": "http://127.0.0.1:9"})
        assert _error(r, 403)["code"] == "admin_closed"
    assert len(httpx.get(client_key_only.url + "/health", timeout=10).json()["instances"]) == n
    r = httpx.post(client_key_only.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {CLIENT}"}, timeout=30)
    assert r.status_code == 200, r.text  # the client key still does what it is for
    # With both keys: only the admin key opens it.
    r = httpx.post(guarded.url + "/admin/instances/p0/drain", headers={"Authorization": f"Bearer {CLIENT}"},
                   timeout=10)
    assert _error(r, 401)["code"] == "unauthorized"
    assert not any(i[3] for i in _instances(guarded, Authorization=f"Bearer {ADMIN}"))


def test_a_cross_site_admin_post_is_refused_and_changes_nothing_security(keyless: Proc) -> None:
    before = _instances(keyless)
    iid = before[0][0]
    add = json.dumps({"role": "prefiller", "url": "http://127.0.0.1:9"}).encode()
    for browser in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site", "Origin": "http://localhost:8888"}):
        headers = {"Content-Type": "text/plain", **browser}
        r = httpx.post(keyless.url + "/admin/instances", content=add, headers=headers, timeout=10)
        assert "cross-site" in _error(r, 403)["message"], browser
        r = httpx.post(f"{keyless.url}/admin/instances/{iid}/drain", headers=browser, timeout=10)
        assert _error(r, 403)["code"] == "forbidden", browser
        assert httpx.delete(f"{keyless.url}/admin/instances/{iid}", headers=browser, timeout=10).status_code == 403
    assert _instances(keyless) == before
    # The proxy's own origin, or a client that is no browser, passes.
    own = {"Origin": keyless.url, "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(f"{keyless.url}/admin/instances/{iid}/drain", headers=own, timeout=10).json()["draining"]
    assert not httpx.post(f"{keyless.url}/admin/instances/{iid}/undrain", timeout=10).json()["draining"]


def test_a_rebinding_host_is_refused_security(keyless: Proc) -> None:
    port = _port(keyless)
    before = _instances(keyless)
    evil = {"Host": "evil:9000", "Origin": "http://evil:9000"}  # same origin to the browser, after rebinding
    err = _error(httpx.get(keyless.url + "/admin/instances", headers=evil, timeout=10), 403)
    assert "--allowed-host" in err["message"] and "--admin-key" in err["message"], err
    r = httpx.post(keyless.url + "/admin/instances", headers={**evil, "Content-Type": "text/plain"}, timeout=10,
                   content=json.dumps({"role": "prefiller", "url": "http://127.0.0.1:9"}).encode())
    assert r.status_code == 403
    assert _instances(keyless) == before
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"proxy.test:{port}", f"PROXY.test:{port}"):
        assert _instances(keyless, Host=host) == before, host
    assert httpx.get(keyless.url + "/health", headers=evil, timeout=10).status_code == 200  # not the admin API


def test_an_unauthenticated_body_is_refused_from_its_head_security(guarded: Proc) -> None:
    heads = {  # each refused from its head, whatever its length (over --max-body-bytes too) or framing
        "60 MB": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 60000000\r\n\r\n",
        "over the limit": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100000000\r\n"
                          b"Authorization: Bearer wrong\r\n\r\n",
        "chunked": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n",
        "100-continue": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 60000000\r\n"
                        b"Expect: 100-continue\r\n\r\n",  # answered 401, never "100 Continue"
    }
    for what, head in heads.items():
        with connect(_port(guarded)) as s:
            s.sendall(head)  # the head only: the answer must come before any of the body is sent
            status, headers, body = answer(s)
            assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized", (what, body)
            assert headers.get("connection") == "close", (what, headers)
            try:
                s.sendall(b"x" * (1 << 20))  # the client goes on regardless: dropped, never buffered
            except (BrokenPipeError, ConnectionResetError):
                pass
            closed_within(s, 5)
    # With the key, the same head waits for its body (or is asked for it).
    head = f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 60000000\r\nAuthorization: Bearer {CLIENT}\r\n"
    with connect(_port(guarded)) as s:
        s.sendall(head.encode() + b"\r\n")
        s.settimeout(REQUEST_S / 2)
        with pytest.raises(TimeoutError):
            s.recv(1)
    with connect(_port(guarded)) as s:
        s.sendall(head.encode() + b"Expect: 100-continue\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n")


def _timed_out(px: Proc) -> float:
    """kvferry_proxy_dropped_connections_total{reason="request_timeout"}, summed over the workers."""
    text = httpx.get(px.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(
        r'^kvferry_proxy_dropped_connections_total\{reason="request_timeout"\} (\S+)$', text, re.M))


def test_requests_that_stop_arriving_are_closed_within_the_timeout_security(guarded: Proc) -> None:
    auth = f"Authorization: Bearer {CLIENT}\r\n".encode()
    partial = {
        "head": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n" + auth,
        "body": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n" + auth + b"\r\n" + b"{" * 500,
        "a GET's head": b"GET /health HTTP/1.1\r\nHo",
        "a chunked body": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
                                  + auth + b"\r\n5\r\nab",
        "a second request's head": b"GET /health HTTP/1.1\r\nHost: t\r\n\r\nGET /metr",
    }
    before = _timed_out(guarded)
    closed_by_the_timeout(_port(guarded), partial, REQUEST_S)
    assert _timed_out(guarded) - before == len(partial)
    # What arrives whole is not timed: a keep-alive connection idle past the timeout, and a stream
    # answered for longer than it.
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {CLIENT}"}) as c:
        assert c.post(guarded.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
        time.sleep(REQUEST_S * 1.5)  # a sleep (window): the connection must still be there after it
        assert c.post(guarded.url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}).status_code == 200
        assert c.get(guarded.url + "/health").status_code == 200
        with c.stream("POST", guarded.url + "/v1/completions",
                      json={"prompt": "long", "max_tokens": 40, "stream": True}) as r:
            t0 = time.monotonic()
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and time.monotonic() - t0 > REQUEST_S


def test_the_admin_api_beyond_loopback_needs_an_admin_key_security() -> None:
    base = ["--prefiller", "http://127.0.0.1:1", "--decoder", "http://127.0.0.1:2,3,4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")}
    r = subprocess.run([sys.executable, "-m", "kvferry.proxy", *base, "--host", "0.0.0.0", "--port", str(free_port()),
                        "--api-key", CLIENT], capture_output=True, text=True, timeout=60, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--admin-key" in lines[0] and "--no-admin" in lines[0] and "beyond loopback" in lines[0], lines


def test_the_options_repr_shows_no_key_security() -> None:
    o = parse(["--prefiller", "http://p:1", "--decoder", "http://d:2,3,4", "--api-key", CLIENT, "--admin-key", ADMIN,
               "--upstream-api-key", "upstream-key-89"])
    assert (o.api_key, o.admin_key, o.upstream_api_key) == (CLIENT, ADMIN, "upstream-key-89")
    assert not any(k in repr(o) for k in (CLIENT, ADMIN, "upstream-key-89")), repr(o)
