"""The proxy's front door holds HTTP/1.1's rules against hostile clients (real proxy processes in
front of stub engines, raw sockets): every Transfer-Encoding line is read, and a body is judged
from its head (keys, route, method, framing) before "100 Continue" or any of it is read; Host is
checked as RFC 9112 says; JSON nested past the proxy's bound is a 400 on every JSON route, never
a 500 or a logged traceback; and an idle keep-alive connection closes after --keep-alive-timeout."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.proxy.http import json_codec
from kvferry.proxy.http.json_codec import MAX_DEPTH, deeper_than
from kvferry.proxy.openai import answers
from kvferry.proxy.server import main
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


def _nested(levels: int, inner: bytes = b"1") -> bytes:
    return b"[" * levels + inner + b"]" * levels


def test_deep_json_is_a_400_on_every_json_route_and_logs_no_traceback_security(engines: list[Proc]) -> None:
    px = proxy(engines[:1], engines[1:], "--workers", "1")
    deep = _nested(100_000)
    objects = b'{"a":' * 2000 + b"1" + b"}" * 2000
    bodies = {
        "/v1/completions": [deep, objects, b"[" * 100_000, b'{"max_tokens":2,"prompt":' + deep + b"}",
                            b'{"prompt":"x","max_tokens":2,"logit_bias":' + objects + b"}"],
        "/v1/chat/completions": [deep, objects, b'{"max_tokens":2,"messages":' + deep + b"}",
                                 b'{"messages":[{"role":"user","content":' + objects + b"}]}"],
        "/admin/instances": [deep, objects, b'{"role":"prefiller","url":' + deep + b"}"],
    }
    with httpx.Client(base_url=px.url, timeout=30) as c:
        for path, raws in bodies.items():
            for raw in raws:
                r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, raw[:60], r.text[:300])
                err = r.json()["error"]
                assert err["code"] == "bad_json" and f"nested deeper than {MAX_DEPTH} levels" in err["message"], err
        # Within the bound, and brackets inside strings, are no nesting: read as ever.
        within = b'{"max_tokens":2,"prompt":"' + b"[" * 100_000 + b'","logit_bias":{},"user":"a"}'
        assert c.post("/v1/completions", content=within).status_code == 200
        assert c.post("/v1/completions", content=b'{"max_tokens":2,"prompt":"x","extra":'
                      + _nested(MAX_DEPTH - 1, b"") + b"}").status_code == 200
    px.stop()
    log = px.proc.stderr.read() if px.proc.stderr is not None else ""
    for sign in ("Traceback", "RecursionError", "proxy error"):
        assert sign not in log, log[-3000:]


def test_an_engine_answer_nested_too_deep_is_unreadable_not_an_internal_error_security() -> None:
    """The legs read an engine's answer with these; their ValueError is the leg's 502 (flows/upstream.py)."""
    ids = b'"prompt_token_ids":[' + b"1," * 64 + b"2]"
    for raw in (_nested(100_000), b'{"choices":[{' + ids + b',"x":' + _nested(100_000) + b"}]}"):
        for read in (json_codec.loads, answers.loads_answer):
            with pytest.raises(ValueError, match="nested deeper"):
                read(raw)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


_TRICKY = st.text(alphabet='[]{}"\\/a\u00e9', max_size=8)  # brackets, quotes and escapes inside strings
_JSON = st.recursive(st.none() | st.integers() | _TRICKY,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
                     max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_the_depth_scan_counts_only_brackets_outside_strings_security(value: object, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    depth = _depth(value)
    for limit in range(depth + 2):
        assert deeper_than(raw, limit) == (depth > limit), (raw, depth, limit)


def test_the_depth_scan_holds_across_long_bodies_security() -> None:
    wide = b",".join([b"[]"] * 1000)
    for depth, raw in ((MAX_DEPTH + 2, b"[" + wide + b"," + _nested(MAX_DEPTH + 1, b"") + b"]"),
                       (MAX_DEPTH, b"[" + wide + b"," + _nested(MAX_DEPTH - 1, b'"]]]]"') + b"," + wide + b"]"),
                       (MAX_DEPTH + 1, _nested(MAX_DEPTH - 10, b"1," + wide + b"," + _nested(11, b"") + b"," + wide)),
                       (MAX_DEPTH - 9, _nested(MAX_DEPTH - 10, b"1," + wide))):
        assert json.loads(raw) is not None and deeper_than(raw, MAX_DEPTH) == (depth > MAX_DEPTH), depth


def test_an_idle_keep_alive_connection_closes_after_the_keep_alive_timeout_security(engines: list[Proc]) -> None:
    idle_s = 0.5
    px = proxy(engines[:1], engines[1:], "--workers", "1", "--keep-alive-timeout", str(idle_s))
    with connect(_port(px)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(3):  # kept alive between requests that come within the bound
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert answer(s)[0] == 200
        answered = time.monotonic()
        closed_within(s, 60)  # generous: the sweep runs every quarter of the bound on a loaded machine
        assert time.monotonic() - answered >= idle_s * 0.8  # by the timer, not at once
    px.stop()


@pytest.mark.parametrize("value", ["0", "-1", "0.01", "soon", "nan"])
def test_the_keep_alive_timeout_flag_is_checked_security(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--prefiller", "http://127.0.0.1:1", "--decoder", "http://127.0.0.1:2,3,4", "--keep-alive-timeout", value]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--keep-alive-timeout" in lines[0] and "0.1 or more" in lines[0], lines
