"""proxy/http/front_door.py: the proxy's one HTTP server.

First a FrontDoor on a real socket in this process, with a small handler. Then the proxy against
stub engines: raw HTTP/1.1 on one connection, mixing the client routes and the others, pipelined,
chunked and malformed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import httpx
import pytest

from kvferry.common.netutil import free_port
from kvferry.proxy.http import front_door
from kvferry.proxy.http.exchange import Request, Response, json_response
from kvferry.proxy.http.front_door import FrontDoor, Handler
from kvferry.proxy.http.sse import Answer, SSEResponse
from tests.polling import until, until_async
from tests.stub_procs import (
    Proc,
    log,
    proxy,
    stub,
    stubs,
)


@asynccontextmanager
async def door_server(handle: Handler, max_body: int = 1 << 20,
                      stall_s: float = 60.0) -> AsyncIterator[tuple[int, set[FrontDoor]]]:
    """A FrontDoor on a free port."""
    doors: set[FrontDoor] = set()
    server = await asyncio.get_running_loop().create_server(
        lambda: FrontDoor(handle, max_body, doors), "127.0.0.1", 0)
    sweep = asyncio.get_running_loop().create_task(front_door.close_idle(doors, stall_s))
    try:
        yield server.sockets[0].getsockname()[1], doors
    finally:
        sweep.cancel()
        server.close()
        for d in list(doors):
            d.close()


async def echo(request: Request) -> Answer:
    return json_response({"method": request.method, "path": request.path, "body": request.body.decode(),
                          "x": request.headers.get("x-test"), "query": request.query})


def post_bytes(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: t", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_answer(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer: status, headers (lower-cased), body (Content-Length or chunked)."""
    status = int((await r.readline()).split()[1])
    if status == 100:  # "100 Continue": nothing follows until the body is sent
        await r.readline()
        return status, {}, b""
    headers: dict[str, str] = {}
    while (line := await r.readline()) != b"\r\n":
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        return status, headers, await r.readexactly(int(headers["content-length"]))
    body = b""
    while (size := int((await r.readline()).strip(), 16)) > 0:
        body += await r.readexactly(size)
        await r.readexactly(2)
    await r.readexactly(2)
    return status, headers, body


def test_requests_on_one_connection_are_answered_in_order_whatever_their_route() -> None:
    async def run() -> None:
        async with door_server(echo) as (port, _):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            # Two requests in one write (pipelined), split mid-head from a third.
            w.write(post_bytes("/v1/completions", b'{"a":1}', "X-Test: one")
                    + post_bytes("/v1/chat/completions", b"{}") + b"POST /v1/compl")
            for want in ({"method": "POST", "path": "/v1/completions", "body": '{"a":1}', "x": "one", "query": {}},
                         {"method": "POST", "path": "/v1/chat/completions", "body": "{}", "x": None, "query": {}}):
                status, _, body = await read_answer(r)
                assert status == 200 and json.loads(body) == want
            w.write(post_bytes("/v1/completions", b"[1]")[len(b"POST /v1/compl"):])
            assert json.loads((await read_answer(r))[2])["body"] == "[1]"
            # Another route and method on the same connection, then a client route again.
            w.write(b"GET /other%20page?a=1&b=two HTTP/1.1\r\nHost: t\r\n\r\n")
            status, _, body = await read_answer(r)
            assert status == 200 and json.loads(body) == {"method": "GET", "path": "/other page", "body": "",
                                                           "x": None, "query": {"a": "1", "b": "two"}}
            w.write(post_bytes("/v1/completions", b"xyz"))
            assert json.loads((await read_answer(r))[2])["body"] == "xyz"
            w.close()
    asyncio.run(run())


def test_every_framing_is_read_and_what_is_not_http_is_refused() -> None:
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    cases = {  # name: (bytes, status, body, closed after)
        "chunked": (chunked, 200, "abcde", False),
        "http/1.0": (post_bytes("/v1/completions", b"ab").replace(b"HTTP/1.1", b"HTTP/1.0", 1), 200, "ab", True),
        "query": (post_bytes("/v1/completions?x=1", b"ab"), 200, "ab", False),
        "too large": (post_bytes("/v1/completions", b"x" * 2000), 413, None, True),
        "too large, named": (post_bytes("/v1/completions", b"x" * 2000, "X-Request-Id: job-9"), 413, None, True),
        "too large, chunked": (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                               + b"400\r\n" + b"x" * 1024 + b"\r\n" + b"0\r\n\r\n", 413, None, True),
        "bad header": (b"POST /v1/completions HTTP/1.1\r\nHost t\r\nContent-Length: 0\r\n\r\n", 400, None, True),
        "two lengths": (post_bytes("/v1/completions", b"ab", "Content-Length: 2"), 400, None, True),
        "length and chunked": (post_bytes("/v1/completions", b"ab", "Transfer-Encoding: chunked"), 400, None, True),
        "not http": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400, None, True),
        "head too long": (b"GET / HTTP/1.1\r\nX-Big: " + b"y" * (front_door.MAX_HEAD + 10), 431, None, True),
        "unknown expect": (post_bytes("/v1/completions", b"ab", "Expect: something"), 417, None, True),
    }

    async def run() -> None:
        async with door_server(echo, max_body=1000) as (port, _):
            for name, (raw, status, body, closed) in cases.items():
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(raw)
                got = await read_answer(r)
                assert got[0] == status, (name, got)
                if status in (413, 417):  # refused from its head or its chunks, yet named like every answer
                    want = "job-9" if "named" in name else None
                    assert got[1]["x-request-id"] == want or (want is None and len(got[1]["x-request-id"]) == 32), got
                assert body is None or json.loads(got[2])["body"] == body, (name, got)
                if closed:
                    assert await asyncio.wait_for(r.read(), 5) == b"", name
                else:  # kept: the next request is answered
                    w.write(post_bytes("/v1/completions", b"next"))
                    assert json.loads((await read_answer(r))[2])["body"] == "next", name
                w.close()
            # Expect: 100-continue: "100 Continue", then the body, then its answer.
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(post_bytes("/v1/completions", b"", "Expect: 100-continue").replace(
                b"Content-Length: 0", b"Content-Length: 2"))
            assert (await read_answer(r))[0] == 100
            w.write(b"ok")
            status, _, body = await read_answer(r)
            assert status == 200 and json.loads(body)["body"] == "ok"
            # HEAD: the head alone.
            w.write(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await r.readline()).startswith(b"HTTP/1.1 200")
            head = b""
            while (line := await r.readline()) != b"\r\n":
                head += line
            assert b"Content-Length: " in head and b"Content-Length: 0" not in head
            w.write(post_bytes("/v1/completions", b"after"))  # nothing of HEAD's body came before this answer
            assert json.loads((await read_answer(r))[2])["body"] == "after"
            w.close()
    asyncio.run(run())


def test_a_pipelined_head_is_judged_when_its_turn_comes() -> None:
    """A request that arrives while a stream is answered gets nothing (no "100 Continue", no
    refusal) until that stream ended: the answers on a connection never interleave."""
    release = asyncio.Event()

    async def slow_stream(request: Request) -> Answer:
        if request.path == "/stream":
            resp = SSEResponse()
            await resp.prepare(request)
            await resp.write(b"data: 1\n\n")
            await release.wait()
            await resp.write(b"data: 2\n\n")
            return resp
        return await echo(request)

    def refuse(method: str, path: str, headers) -> Response | None:
        return None if headers.get("Authorization") else json_response({"refused": True}, 401)

    async def run() -> None:
        doors: set[FrontDoor] = set()
        bounds = front_door.Bounds(front_door.UNBOUNDED.conns, refuse)
        server = await asyncio.get_running_loop().create_server(
            lambda: FrontDoor(slow_stream, 1 << 20, doors, bounds), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await r.readline()).startswith(b"HTTP/1.1 200")
            while await r.readline() != b"\r\n":
                pass
            assert await r.readexactly(14) == b"9\r\ndata: 1\n\n\r\n"  # the first event's chunk
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: k\r\nContent-Length: 2\r\n"
                    b"Expect: 100-continue\r\n\r\n")
            with pytest.raises(TimeoutError):  # a sleep (window): nothing may come meanwhile
                await asyncio.wait_for(r.readline(), 0.5)
            release.set()
            rest = b""
            while not rest.endswith(b"\r\n0\r\n\r\n"):  # the stream's second event, then its end
                rest += await r.readline()
            assert rest == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n", rest
            assert (await read_answer(r))[0] == 100  # now its turn: asked for its body
            w.write(b"ok")
            assert json.loads((await read_answer(r))[2])["body"] == "ok"
            # A refused head waiting its turn behind another request is answered in order, then closed.
            w.write(post_bytes("/v1/completions", b"12", "Authorization: k")
                    + post_bytes("/v1/completions", b"34"))
            assert json.loads((await read_answer(r))[2])["body"] == "12"
            status, headers, body = await read_answer(r)
            assert status == 401 and json.loads(body) == {"refused": True} and headers["connection"] == "close"
            assert len(headers["x-request-id"]) == 32  # a refusal is named like every answer
            assert await asyncio.wait_for(r.read(), 5) == b""
        finally:
            server.close()
            for d in list(doors):
                d.close()
    asyncio.run(run())


def test_a_slow_client_pauses_the_stream_and_one_that_leaves_cancels_it() -> None:
    progress = {"sent": 0, "cancelled": False}

    async def flood(request: Request) -> Answer:
        resp = SSEResponse()
        await resp.prepare(request)
        try:
            for _ in range(4096):  # 256 MiB if nothing held it back
                await resp.write(b"data: " + b"x" * 65536 + b"\n\n")
                progress["sent"] += 1
        except asyncio.CancelledError:
            progress["cancelled"] = True
            raise
        return resp

    async def run() -> None:
        async with door_server(flood) as (port, doors):
            r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
            w.transport.set_write_buffer_limits(0)
            w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            w.write(post_bytes("/v1/completions", b"{}"))
            await r.readline()
            await asyncio.sleep(1.0)  # a sleep (window): the client reads nothing more meanwhile
            (door,) = doors
            assert door.transport is not None
            assert progress["sent"] < 200, progress  # the writer waited, it did not buffer the stream
            assert door.transport.get_write_buffer_size() < 16 << 20
            w.transport.abort()
            await until_async(lambda: progress["cancelled"], 60, "the handler to be cancelled", every=0.02)
    asyncio.run(run())


def test_an_idle_connection_closes(monkeypatch) -> None:
    monkeypatch.setattr(front_door, "IDLE_S", 0.3)

    async def run() -> None:
        async with door_server(echo) as (port, _):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(post_bytes("/v1/completions", b"{}"))
            assert (await read_answer(r))[0] == 200
            assert await asyncio.wait_for(r.read(), 5) == b""  # closed by the proxy after 0.3 s idle
    asyncio.run(run())


def test_connection_close_is_honoured() -> None:
    async def run() -> None:
        async with door_server(echo) as (port, _):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(post_bytes("/v1/completions", b"{}", "Connection: close"))
            status, headers, _ = await read_answer(r)
            assert status == 200 and headers["connection"] == "close"
            assert await asyncio.wait_for(r.read(), 5) == b""
    asyncio.run(run())


def anonymous(events: list[str]) -> list:
    """SSE events without what differs per request (id, created)."""
    out = []
    for e in events:
        body = e.removeprefix("data: ")
        c = json.loads(body) if body.startswith("{") else body
        if isinstance(c, dict):
            c.pop("id", None)
            c.pop("created", None)
        out.append(c)
    return out


def test_the_proxy_streams_and_serves_every_route_on_one_connection() -> None:
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0])
    u = urlsplit(px.url)

    async def run() -> None:
        r, w = await asyncio.open_connection(u.hostname, u.port)
        body = json.dumps({"model": "stub", "prompt": "hello there", "max_tokens": 5, "stream": True}).encode()
        for _ in range(2):  # keep-alive: the same connection twice
            w.write(post_bytes("/v1/completions", body, "Content-Type: application/json"))
            status, headers, raw = await read_answer(r)
            assert status == 200 and headers["content-type"] == "text/event-stream", headers
            events = [e for e in raw.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and len(events) == 6, events  # 5 tokens, then [DONE]
        w.write(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, raw = await read_answer(r)
        assert status == 200 and json.loads(raw)["data"]
        w.write(post_bytes("/v1/completions", b"{not json"))  # a JSON error, the connection kept
        status, headers, raw = await read_answer(r)
        assert status == 400 and json.loads(raw)["error"]["code"] == "bad_json"
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"  # chunked
                + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        status, headers, raw = await read_answer(r)
        assert status == 200 and headers["content-type"] == "text/event-stream", headers
        assert anonymous([e for e in raw.decode().split("\n\n") if e]) == anonymous(events), raw
        w.close()
    asyncio.run(run())


def test_a_client_that_reads_nothing_for_the_stall_timeout_is_cut_off() -> None:
    """Nothing waits forever on a client that stopped reading: its connection is cut and its
    handler cancelled after `stall_s` (--stall-timeout), so what the handler holds comes back. A
    client that reads, however slowly, is not cut."""
    progress = {"cancelled": False}

    async def flood(request: Request) -> Answer:
        resp = SSEResponse()
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"data: " + b"x" * 65536 + b"\n\n")
        except asyncio.CancelledError:
            progress["cancelled"] = True
            raise

    async def run() -> None:
        async with door_server(flood, stall_s=1.0) as (port, doors):
            r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
            w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            w.write(post_bytes("/v1/completions", b"{}"))
            await r.readline()
            for _ in range(15):  # 1.5 s reading slowly, far slower than the handler writes: not cut
                await r.read(1 << 15)
                await asyncio.sleep(0.1)  # a sleep (pacing): a slow reader
            assert doors and not progress["cancelled"]
            await asyncio.sleep(0.3)  # a sleep (window): not cut within this time
            assert doors and not progress["cancelled"]  # not yet: the bound has not passed
            await until_async(lambda: progress["cancelled"], 60, "the stalled stream to be cut", every=0.02)
            assert progress["cancelled"] and not doors
            with contextlib.suppress(ConnectionResetError):  # what was in flight, then the end
                while await r.read(1 << 16):
                    pass
            w.close()
    asyncio.run(run())


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_the_proxy_cuts_a_stream_its_client_stopped_reading_and_frees_the_decoder(framing: str) -> None:
    """The client reads the head of a long stream, then nothing: after --stall-timeout its
    connection is cut and its decode leg ended, whether its request came with a Content-Length or
    chunked; the decoder is not blamed (no error, still healthy)."""
    p0, d0 = stub(0, False), cheap_token_stub()
    p0.wait(), d0.wait()
    # --health-interval 60: a stub writing its stream yields to its event loop only while its
    # socket is full, so the harness's 0.3 s probes may go unanswered and eject it meanwhile
    # (healthy False, through no failure of a leg: seen under load).
    px = proxy([p0], [d0], "--stall-timeout", "2", "--workers", "1", "--health-interval", "60")
    u = urlsplit(px.url)
    body = json.dumps({"model": "stub", "prompt": "hello there", "max_tokens": 60_000, "stream": True}).encode()
    if framing == "length":
        raw = post_bytes("/v1/completions", body, "Content-Type: application/json")
    else:
        raw = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)

    def decoder() -> dict:
        return next(i for i in httpx.get(px.url + "/health").json()["instances"] if i["role"] == "decoder")

    async def run() -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 12)
        s.connect((u.hostname, u.port))
        r, w = await asyncio.open_connection(sock=s, limit=1 << 12)
        w.write(raw)
        assert (await r.readline()).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.5)  # a sleep (window): reading nothing more, not yet cut
        assert decoder()["in_flight"] == 1
        await until_async(lambda: decoder()["in_flight"] == 0, 60, "the decode leg to end", every=0.1)
        d = decoder()
        assert d["in_flight"] == 0 and d["errors"] == 0 and d["healthy"], d
        got = 0
        with contextlib.suppress(ConnectionResetError):  # what was in flight, then the end: no [DONE]
            while chunk := await asyncio.wait_for(r.read(1 << 16), 10):
                got += len(chunk)
        w.close()
        assert 0 < got < 11 << 20  # the stream's 60,000 events are about 12 MiB
    asyncio.run(run())
    # The decoder is freed. Mostly it sees the cut (its write fails mid-stream); but the kernel
    # may hold what is left of these 12 MiB (the proxy's receive buffer grows up to tcp_rmem's
    # max, 32 MiB on this VM, besides both send buffers: 9 MB were seen held), and then the
    # stream ends by itself before the cut. Either way nothing may still run on it: a
    # connection the proxy left open would hold the stub's write, and its request, for good.
    until(lambda: running(d0) == 0, 60, "nothing left running on the decoder", every=0.1)
    assert running(d0) == 0 and log(d0)["cut_streams"] <= 1, log(d0)["cut_streams"]


# A stub engine whose tokens cost next to nothing. A stub computes its whole answer before it
# sends its head: 60,000 of its usual tokens take 0.3 s on an idle machine, and took over the 2 s
# --stall-timeout on a loaded CI one, where the proxy rightly failed the decode leg as a stall (no
# byte from the decoder for 2 s; the client was not full then, it had read all there was).
_CHEAP_TOKENS = ("from kvferry.testing import stub_engine as s\n"
                 "assert callable(s.next_token)\n"
                 "s.next_token = lambda seq, mix=0: 300 + len(seq) % 500\n"
                 "s.main()\n")


def cheap_token_stub() -> Proc:
    port = free_port()
    return Proc(["-c", _CHEAP_TOKENS, "--port", str(port)], f"http://127.0.0.1:{port}", "/health", wait=False)


def running(stub) -> float:
    """The requests a stub engine is answering (vLLM's gauge on its /metrics)."""
    text = httpx.get(stub.url + "/metrics").text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")))
