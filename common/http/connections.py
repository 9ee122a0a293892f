"""Bounds on an HTTP server's connections that its library does not hold: each request's head
and body must arrive within `request_s` of its first byte, and the open connections are capped,
the one past the cap answered with a JSON 503 (Retry-After) and closed.

The proxy's server (proxy/http/front_door.py) holds `Conns` itself. uvicorn's (the controller)
waits forever for a head or a body that stops, and for a connection that sends nothing at all:
`Bounded` wraps such a server's protocol for one connection. It feeds the same bytes to
httptools' parser (llhttp, as uvicorn's own) to see where each request begins and ends, and
`Conns.sweep` closes a connection whose request began `request_s` ago and has not ended. A
request being answered is not timed: only its arrival.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import cast

import httptools

from kvferry.common.fd_limits import raise_fd_limit
from kvferry.common.log import RateLimitedLog, get_logger

logger = get_logger(__name__)

FD_RESERVE = 64  # descriptors for the process's own: listeners, epoll, logs, ZMQ and etcd sockets
FD_TARGET = 1 << 16  # the soft `ulimit -n` is raised toward the hard limit, at most to this
RETRY_AFTER_S = 1


def default_max_connections() -> int:
    """Client connections one process holds by default: half the descriptors beyond FD_RESERVE,
    so each client connection leaves one for the upstream connection it may need."""
    return max(16, (min(raise_fd_limit(FD_TARGET), FD_TARGET) - FD_RESERVE) // 2)


def busy_answer(body: dict) -> bytes:
    """A whole HTTP/1.1 503 answer with a JSON body, Retry-After and Connection: close."""
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: {RETRY_AFTER_S}"
            f"\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


class Conns:
    """One server's bounded connections (each process's own, with --workers N)."""

    def __init__(self, request_s: float, limit: int, busy: bytes, what: str,
                 dropped: Callable[[str], None] | None = None) -> None:
        """`busy`: the whole answer past `limit` (busy_answer); `what`: the server, in log lines;
        `dropped(reason)`: counts each connection refused ("max_connections") or closed before its
        request arrived ("request_timeout")."""
        self.request_s, self.limit, self.busy, self.what = request_s, limit, busy, what
        self.dropped = dropped
        self.open: set[Bounded] = set()
        self._refused = RateLimitedLog(logger, 60.0)
        self._expired = RateLimitedLog(logger, 60.0)

    def admit(self, t: asyncio.BaseTransport, others: int = 0) -> bool:
        """Room for one more connection (besides `others` the server tracks itself)? If not, `t`
        is answered `busy` and closed."""
        if len(self.open) + others < self.limit:
            return True
        self._refused.warning("%s: refused a connection: %d open (--max-connections)", self.what, self.limit)
        if self.dropped is not None:
            self.dropped("max_connections")
        w = cast(asyncio.Transport, t)  # uvloop's transports are no asyncio.Transport subclass
        w.write(self.busy)
        w.close()
        return False

    def overdue(self, since: float | None, now: float) -> bool:
        return since is not None and now - since >= self.request_s

    def expire(self, t: asyncio.BaseTransport | None) -> None:
        """Drop a connection whose request did not arrive within request_s (nothing is owed to it)."""
        if t is not None:
            self._expired.warning("%s: closed a connection whose request did not arrive within %gs "
                                  "(--request-timeout)", self.what, self.request_s)
            if self.dropped is not None:
                self.dropped("request_timeout")
            cast(asyncio.Transport, t).abort()

    def sweep(self, now: float) -> None:
        for c in list(self.open):
            if self.overdue(c.since, now):
                self.expire(c.transport)

    async def run(self) -> None:
        """Sweeps every quarter of request_s (at most 5 s)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(5.0, self.request_s / 4))
            self.sweep(loop.time())


class Bounded(asyncio.Protocol):
    """Another server's protocol (`inner`) for one connection, each request's arrival timed."""

    def __init__(self, inner: asyncio.Protocol, conns: Conns, since: float | None, admit: bool = True) -> None:
        """`since`: when the first request's first byte came (its head and body are due
        request_s later; the connection's start, for a new one); `admit`: check the cap when the
        connection is made (False: the caller did)."""
        self.inner, self.conns, self.since, self.admit = inner, conns, since, admit
        self.transport: asyncio.BaseTransport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.admit and not self.conns.admit(transport):
            return  # the inner protocol never sees it
        self.transport = transport
        self.conns.open.add(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        if self.parser is not None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self.parser, self.since = None, None  # another protocol from here on: not HTTP's to time
            except httptools.HttpParserError:
                self.parser = None  # the inner server answers it (400) and closes; if not, the sweep does
                if self.since is None:
                    self.since = self.loop.time()
        self.inner.data_received(data)

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self.since is None:
            self.since = self.loop.time()

    def on_message_complete(self) -> None:
        self.since = None

    def eof_received(self) -> bool | None:
        if self.transport is None:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return
        self.conns.open.discard(self)
        self.transport = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.inner.resume_writing()
