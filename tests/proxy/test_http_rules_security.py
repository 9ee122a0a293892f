"""The proxy's front door holds HTTP/1.1's rules against hostile clients (real proxy processes in
front of stub engines, raw sockets): every Transfer-Encoding line is read, and a body is judged
from its head (keys, route, method, framing) before "100 Continue" or any of it is read; and Host
is checked as RFC 9112 says."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.raw_http import answer, closed_within, connect
from tests.stub_procs import Proc, proxy, stubs

KEY = "client-key-0123"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
BIG = b"Content-Length: 60000000\r\n"  # a body far over what any test sends


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Proc]]:
    procs = stubs(0, 0)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def keyed(engines: list[Proc]) -> Iterator[Proc]:
    px = proxy(engines[:1], engines[1:], "--api-key", KEY, "--workers", "1")
    yield px
    px.stop()


@pytest.fixture(scope="module")
def keyless(engines: list[Proc]) -> Iterator[Proc]:
    """No key (loopback): the admin API is open to local callers."""
    px = proxy(engines[:1], engines[1:], "--workers", "1")
    yield px
    px.stop()


def _port(px: Proc) -> int:
    port = urlsplit(px.url).port
    assert port is not None
    return port


def _head_only(px: Proc, head: bytes) -> tuple[int, dict[str, str], dict]:
    """Send a request's head alone and read its answer: one that comes is judged from the head,
    none of the body having been sent (so none read); its connection then closes."""
    with connect(_port(px)) as s:
        s.sendall(head)
        assert not s.recv(65536, socket.MSG_PEEK).startswith(b"HTTP/1.1 100"), "100 Continue before the judgement"
        status, headers, body = answer(s)
        closed_within(s, 10)
    return status, headers, json.loads(body)["error"]


def test_every_transfer_encoding_line_is_read_and_judged_from_the_head_security(keyed: Proc) -> None:
    split = b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n"
    post = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
    # Without the key: refused from the head, "100 Continue" never sent, the body never read.
    for framing in (split, b"Transfer-Encoding: gzip, chunked\r\n", b"Transfer-Encoding: gzip\r\n"):
        status, headers, err = _head_only(keyed, post + framing + b"Expect: 100-continue\r\n\r\n")
        assert status == 401 and err["code"] == "unauthorized", (framing, err)
        assert headers["connection"] == "close", headers
    # With it: a coding other than chunked is not implemented (501); chunked not last, or a coding
    # alone, frames no body (400); Transfer-Encoding on HTTP/1.0 is faulty framing (400).
    cases = {
        "split": (post + split, 501),
        "one line": (post + b"Transfer-Encoding: gzip, chunked\r\n", 501),
        "three lines": (post + b"Transfer-Encoding: br\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
                        501),
        "chunked not last": (post + b"Transfer-Encoding: chunked, gzip\r\n", 400),
        "chunked not last, split": (post + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n", 400),
        "no chunked": (post + b"Transfer-Encoding: gzip\r\n", 400),
        "chunked twice": (post + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", 400),
        "with Content-Length": (post + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", 400),
        "HTTP/1.0": (post.replace(b"HTTP/1.1", b"HTTP/1.0") + b"Transfer-Encoding: chunked\r\n", 400),
    }
    for what, (head, want) in cases.items():
        status, headers, err = _head_only(keyed, head + AUTH + b"Expect: 100-continue\r\n\r\n")
        assert status == want and headers["connection"] == "close", (what, status, err)
        assert "Transfer-Encoding" in err["message"], (what, err)
        if want == 501:
            assert err["code"] == "bad_transfer_encoding" and "chunked" in err["message"], err
    # Chunked alone is read and served.
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    with connect(_port(keyed)) as s:
        s.sendall(post + b"Transfer-Encoding: Chunked\r\n" + AUTH + b"\r\n"
                  + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        assert answer(s)[0] == 200


def test_a_body_is_refused_from_its_heads_route_and_method_security(keyed: Proc) -> None:
    for head, want in ((b"POST /v1/nothing HTTP/1.1\r\n", 404), (b"POST /health HTTP/1.1\r\n", 405),
                       (b"DELETE /v1/completions HTTP/1.1\r\n", 405)):
        status, headers, err = _head_only(keyed, head + b"Host: t\r\n" + AUTH + BIG + b"Expect: 100-continue\r\n\r\n")
        assert status == want, (head, err)
        if want == 405:
            assert headers["allow"] in ("GET, HEAD", "POST"), headers
    # Who asks comes first: without the key, an unknown route is a 401 too.
    status, _, err = _head_only(keyed, b"POST /v1/nothing HTTP/1.1\r\nHost: t\r\n" + BIG + b"\r\n")
    assert status == 401, err


def test_host_is_checked_as_rfc_9112_says_security(keyless: Proc) -> None:
    port = _port(keyless)
    bad = {
        "none": b"GET /health HTTP/1.1\r\n\r\n",
        "two": b"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: localhost\r\n\r\n",
        "two, differing": b"GET /admin/instances HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n",
        "a space": b"GET /health HTTP/1.1\r\nHost: local host\r\n\r\n",
        "a path": b"GET /health HTTP/1.1\r\nHost: localhost/x\r\n\r\n",
        "user info": b"GET /health HTTP/1.1\r\nHost: me@localhost\r\n\r\n",
        "an open bracket": b"GET /health HTTP/1.1\r\nHost: [::1\r\n\r\n",
        "a bad port": b"GET /health HTTP/1.1\r\nHost: localhost:80a\r\n\r\n",
        "two, with a body": b"POST /admin/instances HTTP/1.1\r\nHost: localhost\r\nHost: evil\r\n" + BIG + b"\r\n",
    }
    for what, head in bad.items():
        status, headers, err = _head_only(keyless, head)
        assert status == 400 and err["code"] == "bad_host" and "Host" in err["message"], (what, err)
        assert headers["connection"] == "close", (what, headers)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "proxy.example", "", "xn--bcher-kva.de"):
        with connect(port) as s:
            s.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert answer(s)[0] == 200, host
    with connect(port) as s:  # HTTP/1.0 needs none
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert answer(s)[0] == 200
