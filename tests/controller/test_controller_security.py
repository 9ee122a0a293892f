"""kvferry-controller's HTTP API against hostile clients (real processes, real sockets): the admin
key is judged from the head before the body is sent, a DNS-rebinding Host and a cross-site state
change are refused, a request that stops arriving (or a connection that sends nothing) is closed
within --request-timeout, and connections past --max-connections get a clear 503."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.common.netutil import free_port
from kvferry.launcher.services import Proc
from tests.polling import until
from tests.raw_http import answer, closed_by_the_timeout, closed_within, connect

ADMIN = "an-admin-key-for-the-security-tests"
REQUEST_S = 1.0
CAP = 4


class Ctl(Proc):
    def __init__(self, work: Path, admin_key: str | None, *extra: str) -> None:
        port = free_port()
        ports = json.dumps({"pull": free_port(), "reply": free_port()})
        super().__init__(f"kvferry-controller :{port}", [
            sys.executable, "-m", "kvferry.controller.server", "--host", "127.0.0.1", "--port", str(port),
            "--monitor-ports", ports, "--request-timeout", str(REQUEST_S), *extra], port,
            work / f"controller-{port}.log", env={"KVFERRY_ADMIN_KEY": admin_key or "",
                                                  "KVFERRY_CLUSTER_SECRET": "", "KVFERRY_CLUSTER_SECRET_FILE": ""})
        self.url = f"http://127.0.0.1:{port}"
        # Served, not only listening (the port accepts into its backlog before uvicorn runs).
        until(lambda: httpx.get(self.url + "/health", timeout=5).status_code == 200, 30, "the controller's /health")


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctl]:
    c = Ctl(tmp_path_factory.mktemp("ctl"), None, "--max-connections", str(CAP), "--allowed-host", "ctl.test")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctl]:
    c = Ctl(tmp_path_factory.mktemp("ctl"), ADMIN)
    yield c
    c.stop()


def test_connections_past_the_cap_get_a_clear_503_security(keyless: Ctl) -> None:
    held = [connect(keyless.port) for _ in range(CAP)]
    try:
        for s in held:  # each one is served (none was refused)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert answer(s)[0] == 200
        extra = connect(keyless.port)
        status, headers, body = answer(extra)
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close", headers
        assert "--max-connections" in json.loads(body)["error"]
        closed_within(extra, 5)
        held.pop().close()

        def served() -> bool:
            with connect(keyless.port) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
                return answer(s)[0] == 200
        until(served, 60, "a connection served once one of the capped ones closed")
    finally:
        for s in held:
            s.close()
    counters = httpx.get(keyless.url + "/health", timeout=5).json()["counters"]
    assert counters["dropped_connections"] >= 1, counters


def test_a_rebinding_host_and_a_cross_site_change_are_refused_security(keyless: Ctl, keyed: Ctl) -> None:
    evil = {"Host": "evil:9000", "Origin": "http://evil:9000"}  # same origin to the browser, after rebinding
    r = httpx.get(keyless.url + "/api/state", headers=evil, timeout=10)
    assert r.status_code == 403 and "--allowed-host" in r.json()["error"], r.text
    r = httpx.post(keyless.url + "/clear", content=b"{}", headers={**evil, "Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 403, r.text
    for host in ("ctl.test", f"localhost:{keyless.port}", f"[::1]:{keyless.port}"):
        assert httpx.get(keyless.url + "/api/state", headers={"Host": host}, timeout=10).status_code == 200, host
    assert httpx.get(keyless.url + "/health", headers=evil, timeout=10).status_code == 200  # probes: any name
    # Another origin on the same site (another port of localhost) is another origin.
    r = httpx.post(keyless.url + "/lookup", json={"tokens": [1]}, timeout=10,
                   headers={"Origin": "http://localhost:8888", "Sec-Fetch-Site": "same-site"})
    assert r.status_code == 403 and "cross-site" in r.json()["error"], r.text
    own = {"Origin": keyless.url, "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(keyless.url + "/lookup", json={"tokens": [1]}, headers=own, timeout=10).status_code == 200
    # With an admin key any name may be used (a rebound page cannot send the key); cross-site is refused still.
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(keyed.url + "/api/state", headers={**auth, "Host": "evil:9000"}, timeout=10).status_code == 200
    r = httpx.post(keyed.url + "/clear", content=b"{}", timeout=10,
                   headers={**auth, "Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert r.status_code == 403 and "cross-site" in r.json()["error"], r.text


def test_the_admin_key_is_checked_from_the_head_security(keyed: Ctl) -> None:
    with connect(keyed.port) as s:
        s.sendall(b"POST /clear HTTP/1.1\r\nHost: localhost\r\nContent-Length: 60000000\r\n\r\n")  # no body yet
        status, headers, body = answer(s)
        assert status == 401 and "--admin-key" in json.loads(body)["error"], body
        assert headers.get("connection") == "close", headers
        closed_within(s, 5)


def test_requests_that_stop_arriving_are_closed_within_the_timeout_security(keyless: Ctl) -> None:
    partial = {
        "nothing": b"",
        "head": b"POST /lookup HTTP/1.1\r\nHost: localhost\r\n",
        "body": b"POST /lookup HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{\"tokens\": [",
        "a second request's head": b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\nGET /api/st",
    }
    closed_by_the_timeout(keyless.port, partial, REQUEST_S)
    # A keep-alive connection idle past the timeout between two whole requests is not cut.
    with httpx.Client(timeout=10) as c:
        assert c.get(keyless.url + "/health").status_code == 200
        time.sleep(REQUEST_S * 1.5)  # a sleep (window): the connection must still be there after it
        assert c.post(keyless.url + "/lookup", json={"tokens": [1]}).status_code == 200
        assert c.get(keyless.url + "/health").status_code == 200
