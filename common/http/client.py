"""The library's one HTTP/1.1 client: keep-alive connections per host on asyncio Protocols,
parsed by httptools (llhttp, the parser aiohttp's server and uvicorn use). It carries the proxy's
legs to the engines (its hot path) and health checks, etcd's JSON gateway (common/discovery/etcd.py) and
the launcher's health checks (launcher/join.py): one set of bounds and one set of errors.

Why not aiohttp's client (or httpx): per request it builds request, response, stream-reader and
timer objects and runs ~500 Python calls; the proxy only POSTs a JSON body and reads the whole
answer or its pieces as they arrive. Here a piece goes from the socket to the waiting leg in one
callback. What the other callers need costs the legs nothing per request: a TLS context of their
own (etcd's CA and client certificate) is the pool's, headers that change (etcd's auth token) are
set on the pool (`set_headers`), and a long stream's bound (etcd's watch) is a pool's
`stall_timeout`.

Bounds: a connect within `connect_timeout`; a free connection (at most `limit` per instance)
within `wait_timeout`; and while a leg waits for bytes, no more than `read_timeout` between them,
checked by one sweep per pool rather than a timer per read. A connection is reused only after a
whole answer the engine did not mark `Connection: close`; an answer left half-read closes it.
Buffered pieces are capped: the socket stops being read until the leg takes them. A stream's
usual reads can be relayed in the connection's callback itself (`ClientResponse.sink`), without waking
the leg's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from kvferry.common.errors import UnavailableError
from kvferry.common.log import get_logger

logger = get_logger(__name__)

MAX_BUFFERED = 1 << 20  # bytes of an answer held before the socket stops being read
MAX_ANSWER = 1 << 28  # a whole (non-streamed) answer: a long prompt's ids and logprobs fit many times
_NO_TIME = float("inf")


class Unreachable(UnavailableError, OSError):
    """No connection to the engine, or it closed one before its answer began."""


class Broken(UnavailableError, ConnectionError):
    """The engine's answer stopped part way (its connection closed, or bytes that are not HTTP)."""


class ClosedEarly(Unreachable):
    """The peer closed a connection it had accepted before any answer: an engine's idle timeout
    racing the request, or a TLS 1.3 server refusing the client's certificate (with TLS 1.3 the
    client's handshake ends before the server has checked it, so the refusal comes as a close)."""


class TooLarge(Broken):
    """An answer past the reader's `limit` (`ClientResponse.read`): the caller may ask again for less."""


class Timeout(UnavailableError, TimeoutError):
    """A bound passed: `what` is "connect", "wait" (for a free connection), "read" or "stall" (a
    stream's)."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


class _Conn(asyncio.Protocol):
    """One connection; httptools calls back into it as the answer is parsed."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: ClientResponse | None = None
        self.host: _Host | None = None  # set once connected; None again once closed
        self.closed = False
        self.ticks = 0  # reads so far: the sweep's sign of life
        self.seen = -1
        self.quiet_since = _NO_TIME

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:  # bytes nobody asked for: the connection is not safe to reuse
            self.close()
            return
        self.ticks += 1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            r.fail(Broken(f"not an HTTP answer ({e})"))
            self.close()
        w = r.waiter  # the sink only while the task waits, not woken yet: what it takes goes out in order
        if r.sink is not None and w is not None and not w.done() and r.parts and not r.complete and r.error is None:
            blob = r._take()
            try:
                if r.sink(blob):
                    return  # relayed here: the leg's task sleeps on
            except Exception:  # noqa: BLE001 - a sink's bug must not lose the bytes: the task takes them
                logger.exception("a stream's direct relay failed; its leg reads the rest itself")
                r.sink = None
            r.parts.append(blob)
            r.size = len(blob)
        if r.size > MAX_BUFFERED and self.transport is not None and not r.paused:
            r.paused = True
            self.transport.pause_reading()
        r.wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        r = self.resp
        if r is not None and not r.complete:
            cause = f": {exc}" if exc else ""
            r.fail(Broken(f"connection closed mid-answer{cause}") if r.status else
                   ClosedEarly(f"connection closed before an answer{cause}"))
            r.wake()

    def on_headers_complete(self) -> None:
        r = self.resp
        assert r is not None
        r.status = self.parser.get_status_code()
        r.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        r = self.resp
        assert r is not None
        r.parts.append(body)
        r.size += len(body)

    def on_message_complete(self) -> None:
        r = self.resp
        assert r is not None
        r.complete = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.close()


class ClientResponse:
    """An engine's answer: `status` once `Pool.request` returns; the body whole (`read`) or in
    the pieces each read brought (`pieces`). `release()` always, when done with it."""

    __slots__ = ("conn", "status", "keep_alive", "parts", "size", "complete", "error", "waiter", "paused", "stream",
                 "sink")

    def __init__(self, conn: _Conn, stream: bool = False) -> None:
        self.conn = conn
        self.stream = stream  # bounded by the pool's stall_timeout rather than its read_timeout
        self.status = 0
        self.keep_alive = False
        self.parts: list[bytes] = []
        self.size = 0
        self.complete = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        # A stream's direct relay: while the leg's task waits in pieces(), each read's body bytes go
        # to sink() in the connection's callback; True: taken (the task is not woken), False: they
        # stay for pieces(). One wakeup and task switch less per token; it must not raise.
        self.sink: Callable[[bytes], bool] | None = None

    def fail(self, e: Exception) -> None:
        if self.error is None:
            self.error = e

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        c = self.conn
        if self.paused and c.transport is not None:
            self.paused = False
            c.transport.resume_reading()
        self.waiter = w = c.pool.loop.create_future()  # not get_running_loop(): a getpid() syscall per call
        c.seen, c.quiet_since = c.ticks, c.pool.loop.time()
        try:
            await w
        finally:
            self.waiter = None
            c.quiet_since = _NO_TIME

    def _take(self) -> bytes:
        parts = self.parts
        blob = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        self.size = 0
        return blob

    async def read(self, limit: int = MAX_ANSWER) -> bytes:
        """The whole body; TooLarge (a Broken) once it passes `limit` bytes (an engine's answer is
        not trusted to be small: the connection is dropped rather than the answer held)."""
        while not self.complete:
            if self.error is not None:
                raise self.error
            if self.size > limit:
                self.conn.close()
                raise TooLarge(f"an answer larger than {limit} bytes")
            await self._wait()
        if self.size > limit:
            raise TooLarge(f"an answer larger than {limit} bytes")
        return self._take()

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: everything read since the last piece, joined."""
        while True:
            if self.parts:
                yield self._take()
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            await self._wait()

    def release(self) -> None:
        """Give the connection back (a whole answer on a keep-alive connection) or close it."""
        c = self.conn
        if c.resp is not self:
            return
        c.resp = None
        if self.complete and self.keep_alive and self.error is None and not c.closed:
            if self.paused and c.transport is not None:
                c.transport.resume_reading()
            c.pool.put_back(c)
        else:
            c.close()


class _Host:
    """One instance's connections: idle ones, how many are open, who waits for one."""

    __slots__ = ("host", "port", "head", "tls", "idle", "open", "waiters", "dropped")

    def __init__(self, host: str, port: int, head: bytes, tls: ssl.SSLContext | None) -> None:
        self.host, self.port, self.head, self.tls = host, port, head, tls
        self.idle: deque[_Conn] = deque()
        self.open = 0
        self.waiters: deque[asyncio.Future[_Conn | None]] = deque()
        self.dropped = False  # its instance left: a connection freed now closes rather than idles


class Pool:
    """Keep-alive connections, at most `limit` per host (an engine instance, an etcd endpoint),
    each request carrying `headers`. `tls`: the context https:// connects with (a private CA, a
    client certificate); by default the system's, verified as aiohttp's client verifies.
    Created, used and closed on one running event loop."""

    def __init__(self, limit: int, connect_timeout: float, wait_timeout: float, read_timeout: float,
                 headers: dict[str, str], stall_timeout: float | None = None, *,
                 tls: ssl.SSLContext | None = None) -> None:
        self.limit, self.connect_timeout, self.wait_timeout = limit, connect_timeout, wait_timeout
        self.read_timeout = read_timeout
        self.stall_timeout = read_timeout if stall_timeout is None else stall_timeout
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.hosts: dict[str, _Host] = {}
        self.busy: set[_Conn] = set()
        self._tls = tls
        self.loop = asyncio.get_running_loop()
        self._sweep = self.loop.create_task(self._sweeper())

    def _host(self, base: str) -> _Host:
        h = self.hosts.get(base)
        if h is None:
            u = urlsplit(base)
            if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
                raise Unreachable(f"{base}: not http(s)://host:port")
            tls = None
            if u.scheme == "https":  # by default verified as aiohttp's client does (SSL_CERT_FILE is honoured)
                tls = self._tls = self._tls or ssl.create_default_context()
            h = self.hosts[base] = _Host(u.hostname, u.port or (443 if tls else 80),
                                         f"Host: {u.netloc}\r\n{self.extra}".encode(), tls)
        return h

    def set_headers(self, headers: dict[str, str]) -> None:
        """The headers every request carries from now on (one already sent keeps its own). Each
        host's request head holds them, built here rather than per request: for headers that
        change rarely (etcd's auth token, fetched again when it expires)."""
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        for base, h in self.hosts.items():
            h.head = f"Host: {urlsplit(base).netloc}\r\n{self.extra}".encode()

    async def request(self, method: str, base: str, path: str, body: bytes | None = None,
                      stream: bool = False, headers: bytes = b"") -> ClientResponse:
        """Send one request to the engine at `base` (http://host:port); the answer once its head came.
        `stream`: a stream whose waits are bounded by `stall_timeout` (Timeout "stall"). `headers`:
        this request's own header lines ("Name: value\r\n" each, checked by the caller), after the
        pool's. Raises Unreachable, Broken or Timeout."""
        h = self._host(base)
        for attempt in (0, 1):
            conn, reused = await self._conn(h)
            r = ClientResponse(conn, stream)
            conn.resp = r
            self.busy.add(conn)
            head = f"{method} {path} HTTP/1.1\r\n".encode() + h.head + headers
            assert conn.transport is not None
            if body is None:
                conn.transport.write(head + b"\r\n")
            else:
                conn.transport.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
            try:
                while not r.status:
                    if r.error is not None:
                        raise r.error
                    await r._wait()
            except Unreachable:
                r.release()
                # A kept connection the engine closed as the request went out (its idle timeout):
                # it read nothing of it, so one fresh connection may try again.
                if reused and not attempt:
                    continue
                raise
            except BaseException:
                r.release()
                raise
            return r
        raise AssertionError("unreachable")

    async def _conn(self, h: _Host) -> tuple[_Conn, bool]:
        """An idle connection (reused: True), else a new one while fewer than `limit` are open,
        else the first one freed, waited for within `wait_timeout`."""
        deadline = None
        while True:
            while h.idle:
                c = h.idle.pop()
                if not c.closed:
                    return c, True
            if h.open < self.limit:
                return await self._open(h), False
            if deadline is None:
                deadline = self.loop.time() + self.wait_timeout
            w: asyncio.Future[_Conn | None] = self.loop.create_future()
            h.waiters.append(w)
            try:
                async with asyncio.timeout_at(deadline):
                    got = await w
            except BaseException as e:
                if w.done() and not w.cancelled() and (lost := w.result()) is not None:
                    self.put_back(lost)  # handed over as the wait ended: not this request's
                if isinstance(e, TimeoutError):
                    raise Timeout("wait", f"no free connection of {self.limit} within {self.wait_timeout:g}s"
                                  ) from None
                raise
            finally:
                with contextlib.suppress(ValueError):
                    h.waiters.remove(w)
            if got is not None:
                return got, True
            # None: a connection closed, so one may be opened in its place (checked again above).

    async def _open(self, h: _Host) -> _Conn:
        h.open += 1
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, c = await self.loop.create_connection(lambda: _Conn(self), h.host, h.port, ssl=h.tls)
        except BaseException as e:
            h.open -= 1
            self._hand_on(h, None)
            if isinstance(e, TimeoutError):
                raise Timeout("connect", f"no connection within {self.connect_timeout:g}s") from None
            if isinstance(e, OSError):
                raise Unreachable(str(e)) from None
            raise
        c.host = h
        return c

    def _hand_on(self, h: _Host, c: _Conn | None) -> bool:
        """A freed connection (or, None, a freed slot) to the first waiter still waiting."""
        while h.waiters:
            w = h.waiters.popleft()
            if not w.done():
                w.set_result(c)
                return True
        return False

    def put_back(self, c: _Conn) -> None:
        self.busy.discard(c)
        h = c.host
        if h is not None and not self._hand_on(h, c):
            if h.dropped:
                c.close()
            else:
                h.idle.append(c)

    def drop(self, base: str) -> None:
        """The instance at `base` left: its idle connections close now, its busy ones when their
        requests end (a later request to `base` starts afresh)."""
        h = self.hosts.pop(base, None)
        if h is not None:
            h.dropped = True
            for c in list(h.idle):
                c.close()

    def forget(self, c: _Conn) -> None:
        """A closed connection leaves its host's count (once); a waiter may open one in its place."""
        self.busy.discard(c)
        h, c.host = c.host, None
        if h is None:
            return
        with contextlib.suppress(ValueError):
            h.idle.remove(c)
        h.open -= 1
        self._hand_on(h, None)

    async def _sweeper(self) -> None:
        """Fails a leg that waited `read_timeout` (a stream: `stall_timeout`) with no byte from its
        engine: one sweep for every connection, rather than a timer per read."""
        every = min(1.0, self.read_timeout / 4, self.stall_timeout / 4)
        while True:
            await asyncio.sleep(every)
            now = self.loop.time()
            for c in list(self.busy):
                r = c.resp
                if r is None or r.waiter is None:
                    continue
                bound = self.stall_timeout if r.stream else self.read_timeout
                if c.ticks != c.seen:
                    c.seen, c.quiet_since = c.ticks, now
                elif now - c.quiet_since >= bound:
                    r.fail(Timeout("stall" if r.stream else "read", f"nothing received for {bound:g}s"))
                    c.close()
                    r.wake()

    async def close(self) -> None:
        self._sweep.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sweep
        for h in self.hosts.values():
            for c in list(h.idle):
                c.close()
        for c in list(self.busy):
            c.close()
