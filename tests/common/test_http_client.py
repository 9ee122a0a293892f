"""common/http/client.py against real sockets: engines that keep, close, stall, break or garble
their connections (raw asyncio servers in the test's loop), under asyncio's loop and uvloop's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from kvferry.common.http.client import MAX_BUFFERED, Broken, ClosedEarly, Pool, Timeout, TooLarge, Unreachable
from kvferry.common.netutil import free_port
from tests.polling import until_async

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


def ok(body: bytes = b'{"ok":true}', close: bool = False) -> bytes:
    extra = b"Connection: close\r\n" if close else b""
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        extra, len(body), body)


async def read_request(r: asyncio.StreamReader) -> bytes:
    """One request's head and body (Content-Length), b"" once the client closed."""
    head = await r.readuntil(b"\r\n\r\n") if not r.at_eof() else b""
    n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
             0)
    return head + (await r.readexactly(n) if n else b"")


class Engine:
    """A raw HTTP server: `handler(reader, writer, connection number)` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections = handler, 0
        self.port = free_port()

    async def __aenter__(self) -> Engine:
        async def on(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(r, w, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                w.close()
        self.server = await asyncio.start_server(on, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def run(coro_fn: Callable[[], Awaitable[None]], loop_kind: str) -> None:
    if loop_kind == "uvloop":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            r.run(coro_fn())
    else:
        asyncio.run(coro_fn())


def pool(limit: int = 4, read: float = 5.0, wait: float = 5.0) -> Pool:
    return Pool(limit, connect_timeout=2.0, wait_timeout=wait, read_timeout=read,
                headers={"Content-Type": "application/json", "Authorization": "Bearer k"})


LOOPS = pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])


@LOOPS
def test_a_whole_answer_keeps_its_connection_for_the_next_request(loop_kind: str) -> None:
    requests: list[bytes] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while req := await read_request(r):
            requests.append(req)
            w.write(ok(b'{"n":%d}' % len(requests)))
            await w.drain()

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool()
            for i in range(3):
                resp = await p.request("POST", e.url, "/v1/completions", b'{"prompt":"x"}')
                assert resp.status == 200 and await resp.read() == b'{"n":%d}' % (i + 1)
                resp.release()
            await p.close()
            assert e.connections == 1
        head = requests[0]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and head.endswith(b'\r\n\r\n{"prompt":"x"}')
        assert b"Host: 127.0.0.1:%d\r\n" % e.port in head and b"Authorization: Bearer k\r\n" in head
        assert b"Content-Length: 14\r\n" in head
    run(main, loop_kind)


@LOOPS
def test_connection_close_and_a_half_read_answer_are_not_reused(loop_kind: str) -> None:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await read_request(r):
            if n == 1:
                w.write(ok(close=True))
            else:  # a big answer the client leaves half read
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
            await w.drain()
            if n == 1:
                return

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool()
            resp = await p.request("GET", e.url, "/a")
            assert await resp.read() == b'{"ok":true}'
            resp.release()
            resp = await p.request("GET", e.url, "/b")
            assert resp.status == 200
            resp.release()  # half read: closed
            resp = await p.request("GET", e.url, "/c")
            resp.release()
            await p.close()
            assert e.connections == 3
    run(main, loop_kind)


@LOOPS
def test_at_most_limit_connections_and_waiting_for_one_is_bounded(loop_kind: str) -> None:
    open_now = peak = 0

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        nonlocal open_now, peak
        open_now += 1
        peak = max(peak, open_now)
        try:
            while await read_request(r):
                await asyncio.sleep(0.2)  # a sleep (pacing): a slow engine holds each connection
                w.write(ok())
                await w.drain()
        finally:
            open_now -= 1

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool(limit=2)

            async def one() -> bytes:
                resp = await p.request("POST", e.url, "/x", b"{}")
                try:
                    return await resp.read()
                finally:
                    resp.release()
            assert await asyncio.gather(*(one() for _ in range(6))) == [b'{"ok":true}'] * 6
            assert peak == 2 and e.connections == 2
            await p.close()
            p = pool(limit=1, wait=0.3)
            first = await p.request("POST", e.url, "/x", b"{}")  # holds the only connection
            with pytest.raises(Timeout) as ex:
                await p.request("POST", e.url, "/x", b"{}")
            assert ex.value.what == "wait" and "no free connection of 1 within 0.3s" in str(ex.value)
            first.release()
            await p.close()
    run(main, loop_kind)


@LOOPS
def test_an_engine_that_sends_nothing_times_out_on_the_read_timeout(loop_kind: str) -> None:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        if n == 2:  # the head, one piece, then silence
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await w.drain()
        await asyncio.sleep(60)  # a sleep (pacing): the engine's silence

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool(read=0.4)
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(Timeout) as ex:
                await p.request("POST", e.url, "/x", b"{}")
            took = asyncio.get_running_loop().time() - t0
            assert ex.value.what == "read" and 0.35 <= took < 30.0, took  # the engine is silent for 60 s
            resp = await p.request("POST", e.url, "/x", b"{}")
            got = []
            with pytest.raises(Timeout):
                async for piece in resp.pieces():
                    got.append(piece)
            resp.release()
            assert got == [b"hello"]
            assert not p.busy and all(not h.idle and h.open == 0 for h in p.hosts.values())
            await p.close()
    run(main, loop_kind)


@LOOPS
def test_a_stream_that_sends_nothing_fails_on_the_stall_timeout(loop_kind: str) -> None:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        if n >= 2:  # the head and one piece; then silence (the first: silence at once)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await w.drain()
        await asyncio.sleep(60)  # a sleep (pacing): the engine's silence

    async def main() -> None:
        async with Engine(serve) as e:
            p = Pool(4, connect_timeout=2.0, wait_timeout=5.0, read_timeout=60.0, headers={}, stall_timeout=0.4)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(Timeout) as ex:  # the wait for the head counts too
                await p.request("POST", e.url, "/x", b"{}", stream=True)
            assert ex.value.what == "stall" and 0.35 <= loop.time() - t0 < 30.0  # silent for 60 s
            resp = await p.request("POST", e.url, "/x", b"{}", stream=True)
            got, t0 = [], loop.time()
            with pytest.raises(Timeout) as ex:
                async for piece in resp.pieces():
                    got.append(piece)
                    await asyncio.sleep(0.8)  # a sleep (pacing): the caller's own time, not the engine's silence
            resp.release()
            assert ex.value.what == "stall" and got == [b"hello"] and 1.15 <= loop.time() - t0 < 30.0
            assert not p.busy and all(not h.idle and h.open == 0 for h in p.hosts.values())
            await p.close()
    run(main, loop_kind)


@LOOPS
def test_a_stream_cut_mid_answer_gives_its_pieces_then_broken(loop_kind: str) -> None:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"f\r\ndata: {\"a\":1}\n\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)  # a sleep (pacing): the piece is read before the cut
        w.transport.abort()

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool()
            resp = await p.request("POST", e.url, "/x", b"{}")
            got = []
            with pytest.raises(Broken, match="mid-answer"):
                async for piece in resp.pieces():
                    got.append(piece)
            resp.release()
            assert b"".join(got) == b'data: {"a":1}\n\n'
            await p.close()
    run(main, loop_kind)


@LOOPS
def test_a_sink_takes_reads_in_the_callback_and_leaves_the_rest_to_pieces_in_order(loop_kind: str) -> None:
    """Response.sink (a decode stream's direct relay): a read it takes never wakes the reader;
    one it refuses comes out of pieces(), and the two together are the stream, in order."""
    sent = [b"take 1.", b"take 2.", b"keep 3.", b"take 4.", b"keep 5.", b"take 6."]

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)  # a sleep (pacing): pieces paced to be one read each
        for piece in sent:  # one read each: the reader is back waiting before the next
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
            await asyncio.sleep(0.05)  # a sleep (pacing): as above
        w.write(b"0\r\n\r\n")
        await w.drain()

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool()
            resp = await p.request("POST", e.url, "/x", b"{}", stream=True)
            order: list[bytes] = []

            def sink(blob: bytes) -> bool:
                if blob.startswith(b"take"):
                    order.append(blob)
                    return True
                return False
            resp.sink = sink
            woken = []
            async for piece in resp.pieces():
                woken.append(piece)
                order.append(piece)
            resp.release()
            assert woken == [b"keep 3.", b"keep 5."]  # the taken reads never woke the reader
            assert order == sent
            assert p.hosts[e.url].idle  # a whole answer: the connection is kept
            # A sink that raises loses nothing: the read and the rest come out of pieces().
            resp = await p.request("POST", e.url, "/x", b"{}", stream=True)
            calls = []

            def broken(blob: bytes) -> bool:
                calls.append(blob)
                raise RuntimeError("a bug in a relay")
            resp.sink = broken
            got = [piece async for piece in resp.pieces()]
            resp.release()
            assert b"".join(got) == b"".join(sent) and calls == [sent[0]] and resp.sink is None
            await p.close()
    run(main, loop_kind)


@LOOPS
def test_bytes_that_are_not_http_and_a_refused_connection_are_errors_not_hangs(loop_kind: str) -> None:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await w.drain()
        await asyncio.sleep(5)  # a sleep (pacing): the peer keeps the connection open, saying no more

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool(read=3)
            with pytest.raises(Broken, match="not an HTTP answer"):
                await p.request("POST", e.url, "/x", b"{}")
            with pytest.raises(Unreachable):
                await p.request("POST", f"http://127.0.0.1:{free_port()}", "/x", b"{}")
            assert all(h.open == 0 for h in p.hosts.values())
            await p.close()
    run(main, loop_kind)


@LOOPS
def test_a_kept_connection_closed_as_the_request_went_out_is_tried_once_on_a_new_one(loop_kind: str) -> None:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        if n == 1:  # answers, then drops the next request unanswered (an idle timeout's race)
            w.write(ok(b'{"n":1}'))
            await w.drain()
            await read_request(r)
            return
        if n == 2:
            w.write(ok(b'{"n":2}'))
            await w.drain()
            await read_request(r)
        # connection 3: opened fresh, its request dropped: no retry

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool()
            resp = await p.request("POST", e.url, "/x", b"{}")
            assert await resp.read() == b'{"n":1}'
            resp.release()
            resp = await p.request("POST", e.url, "/x", b"{}")  # on connection 1, dropped: retried on 2
            assert await resp.read() == b'{"n":2}'
            resp.release()
            p2 = pool()
            e.connections = 2
            with pytest.raises(ClosedEarly, match="before an answer"):
                await p2.request("POST", e.url, "/x", b"{}")
            await p.close()
            await p2.close()
    run(main, loop_kind)


@LOOPS
def test_a_reader_slower_than_its_engine_stops_the_socket_not_the_memory(loop_kind: str) -> None:
    size = 8 * MAX_BUFFERED

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for i in range(size // 65536):
            w.write(bytes([i % 251]) * 65536)
            await w.drain()

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool()
            resp = await p.request("GET", e.url, "/big")
            # the engine sends on; the client does not read
            await until_async(lambda: resp.paused, 60, "the reader to pause")
            assert resp.paused and resp.size <= MAX_BUFFERED + (1 << 18)
            got = bytearray()
            async for piece in resp.pieces():
                got += piece
            resp.release()
            assert len(got) == size and got[:65536] == bytes([0]) * 65536 and got[-1] == (size // 65536 - 1) % 251
            await p.close()
    run(main, loop_kind)


def test_an_https_engine_is_verified_as_aiohttp_verifies_it(tmp_path, monkeypatch) -> None:
    """A TLS engine whose certificate the system trusts (SSL_CERT_FILE here) answers; one it does
    not trust is Unreachable, naming the verification failure."""
    import ssl
    import subprocess
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=engine",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def main(trusted: bool) -> None:
        async def on(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await read_request(r)
                w.write(ok(b'{"tls":true}'))
                await w.drain()
            except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
                pass
            finally:
                w.close()
        port = free_port()
        server = await asyncio.start_server(on, "127.0.0.1", port, ssl=server_ctx)
        try:
            p = pool()
            if trusted:
                resp = await p.request("GET", f"https://127.0.0.1:{port}", "/v1/models")
                assert await resp.read() == b'{"tls":true}'
                resp.release()
            else:
                with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
                    await p.request("GET", f"https://127.0.0.1:{port}", "/v1/models")
            await p.close()
        finally:
            server.close()
    asyncio.run(main(False))
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    asyncio.run(main(True))


def test_a_whole_answer_past_its_limit_is_refused_not_held() -> None:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (4 << 20))
        for _ in range(64):
            w.write(b"x" * 65536)
            await w.drain()

    async def main() -> None:
        async with Engine(serve) as e:
            p = pool()
            resp = await p.request("GET", e.url, "/big")
            with pytest.raises(TooLarge, match="larger than 1048576 bytes"):  # a Broken the caller can tell apart
                await resp.read(limit=1 << 20)
            resp.release()
            assert all(h.open == 0 for h in p.hosts.values())
            await p.close()
    asyncio.run(main())


@LOOPS
def test_headers_set_on_the_pool_go_with_every_later_request_on_kept_connections_too(loop_kind: str) -> None:
    """set_headers (etcd's auth token, fetched again): the next request carries the new headers,
    on the connection already kept; none are added per request."""
    requests: list[bytes] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while req := await read_request(r):
            requests.append(req)
            w.write(ok())
            await w.drain()

    async def main() -> None:
        async with Engine(serve) as e:
            p = Pool(2, connect_timeout=2.0, wait_timeout=2.0, read_timeout=2.0, headers={"X-A": "1"})
            for headers in ({"X-A": "1"}, {"Authorization": "token-2"}, {}):
                p.set_headers(headers)
                resp = await p.request("POST", e.url, "/v3/kv/range", b"{}")
                assert await resp.read() == b'{"ok":true}'
                resp.release()
            await p.close()
            assert e.connections == 1
        first, second, third = requests
        assert b"\r\nX-A: 1\r\n" in first and b"Authorization" not in first
        assert b"\r\nAuthorization: token-2\r\n" in second and b"X-A" not in second
        assert b"X-A" not in third and b"Authorization" not in third
        assert all(b"Host: 127.0.0.1:%d\r\n" % e.port in r for r in requests)
    run(main, loop_kind)


def test_a_pool_with_its_own_tls_context_trusts_its_ca_and_shows_its_client_certificate(tmp_path) -> None:
    """Pool(tls=...) (etcd's cacert=, cert=, key=): a server signed by a private CA, which checks
    client certificates, answers a pool whose context holds that CA and a client certificate; a
    pool with the CA but no certificate is refused, as an Unreachable (TLS 1.3: the server's
    refusal comes after the client's handshake ended); the system's trust knows no private CA."""
    import ssl

    from tests.tls_certs import make_certs
    certs = make_certs(tmp_path / "certs")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca))
    server_ctx.load_cert_chain(certs.server_cert, certs.server_key)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.create_default_context(cafile=str(certs.ca))
    client_ctx.load_cert_chain(certs.client_cert, certs.client_key)
    peers: list[object] = []

    async def main() -> None:
        async def on(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await read_request(r)
                peers.append(w.get_extra_info("peercert"))
                w.write(ok(b'{"tls":true}'))
                await w.drain()
            except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
                pass
            finally:
                w.close()
        port = free_port()
        server = await asyncio.start_server(on, "127.0.0.1", port, ssl=server_ctx)
        url = f"https://127.0.0.1:{port}"
        try:
            p = Pool(2, 2.0, 2.0, 2.0, {}, tls=client_ctx)
            resp = await p.request("GET", url, "/v3/maintenance/status")
            assert await resp.read() == b'{"tls":true}'
            resp.release()
            await p.close()
            assert peers and "kvferry-client" in str(peers[0])
            no_cert = Pool(2, 2.0, 2.0, 2.0, {}, tls=ssl.create_default_context(cafile=str(certs.ca)))
            with pytest.raises(Unreachable) as ex:
                await no_cert.request("GET", url, "/v3/maintenance/status")
            assert isinstance(ex.value, ClosedEarly) or "SSL" in str(ex.value), ex.value
            await no_cert.close()
            system = Pool(2, 2.0, 2.0, 2.0, {})
            with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
                await system.request("GET", url, "/v3/maintenance/status")
            await system.close()
        finally:
            server.close()
    asyncio.run(main())
