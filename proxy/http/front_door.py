"""The clients' hot path on an asyncio Protocol: `POST /v1/completions` and `/v1/chat/completions`
with a Content-Length body over HTTP/1.1 are parsed and answered here; every other request goes
to aiohttp's server, which serves it as before.

Why: aiohttp's server builds request, payload, writer, middleware and task objects per request,
a large share of the proxy's CPU per request (docs/benchmarks.md). Its application still holds every route, the hot ones
included, so each request has one handler whichever way it came in.

How a request leaves the hot path: a request on another path or method, a chunked or `Expect`
body, a version other than HTTP/1.1, a head longer than aiohttp takes, or a body over
--max-body-bytes. Its connection is handed to aiohttp's protocol with every byte received since
the request began. aiohttp then serves that connection for the rest of its life, refusing
whatever it refuses.

Kept as aiohttp keeps it:
- a client that disconnects cancels its request's handler;
- a slow client pauses the writer; one that reads nothing of its answer for --stall-timeout is
  cut off (aiohttp waits for it forever), so its decoder and connection come back;
- an idle keep-alive connection closes after 75 s;
- a request's bytes are parsed only after the previous answer went out.

Bounded here for both servers (`Bounds`; aiohttp holds none of these):
- a request whose head and body have not arrived --request-timeout after its first byte has its
  connection closed; a connection handed to aiohttp stays timed (common/http_conns.Bounded);
- past --max-connections open connections (this process's, both servers'), a new one is
  answered 503 with Retry-After and closed;
- a request whose body is still on its way is judged from its head first: one the guard
  refuses (no or a wrong API key) goes to aiohttp, whose guard answers 401 and drops the body
  unread (closing the connection), rather than its body being buffered here.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web
from multidict import CIMultiDict

from kvferry.common.http_conns import Bounded, Conns
from kvferry.common.log import get_logger

logger = get_logger(__name__)

HOT = frozenset({b"/v1/completions", b"/v1/chat/completions"})
MAX_HEAD = 8190  # aiohttp's max_line_size and max_field_size: a longer head is aiohttp's to refuse
IDLE_S = 75.0  # aiohttp's keepalive_timeout
REQUEST_S = 30.0  # --request-timeout's default
MAX_PENDING = 1 << 20  # bytes read ahead of the request being answered before reading pauses

Handler = Callable[["FastRequest"], Awaitable[web.StreamResponse]]
HeadCheck = Callable[[str, CIMultiDict[str]], bool]


class Bounds:
    """What one process's connections share: `conns` (--max-connections, --request-timeout, and
    the connections handed to aiohttp), and `head_ok(path, headers)`: may a request whose body
    is still on its way be read (False: the guard refuses it from its head alone)?"""

    __slots__ = ("conns", "head_ok")

    def __init__(self, conns: Conns, head_ok: HeadCheck) -> None:
        self.conns, self.head_ok = conns, head_ok


def _any_head(path: str, headers: CIMultiDict[str]) -> bool:
    return True


UNBOUNDED = Bounds(Conns(REQUEST_S, 1 << 30, b"", "front door"), _any_head)


class FastRequest:
    """The part of aiohttp's Request the proxy's handlers use: path, headers, the whole body."""

    __slots__ = ("path", "headers", "content_length", "whole_body", "door")
    method = "POST"  # the hot path's only one

    def __init__(self, path: str, headers: CIMultiDict[str], body: bytes, door: FrontDoor) -> None:
        self.path, self.headers, self.whole_body, self.door = path, headers, body, door
        self.content_length = len(body)


class FrontDoor(asyncio.Protocol):
    """One client connection until it leaves the hot path (then it is aiohttp's)."""

    def __init__(self, handle: Handler, fallback: Callable[[], asyncio.Protocol], max_body: int,
                 conns: set[FrontDoor], bounds: Bounds = UNBOUNDED) -> None:
        self.handle, self.fallback, self.max_body, self.conns = handle, fallback, max_body, conns
        self.bounds = bounds
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.keep_alive = True
        self.sent = False  # the current request's answer began
        self.reading = True
        self.drained: asyncio.Future[None] | None = None  # set while the client's socket is full
        # The client's socket is full and nothing of what waits was taken since (close_idle's to cut);
        # what waits then: a client that reads, however slowly, moves both on.
        self.full_since: float | None = None
        self.full_left = 0
        self.idle_since: float | None = None  # waiting for a request since (close_idle's to close)
        self.request_since: float | None = None  # a request's first byte came then; its head or body is awaited
        # A head read whose body is still arriving: (path, headers, body start, body length).
        self.pending: tuple[str, CIMultiDict[str], int, int] | None = None
        self.loop = asyncio.get_running_loop()

    # ---- asyncio callbacks ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.bounds.conns.admit(transport, len(self.conns)):
            return  # answered 503 and closed: nothing more is read
        self.transport = cast(asyncio.Transport, transport)
        self.conns.add(self)
        self.idle_since = self.loop.time()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.task is None:
            self.idle_since = None  # a request is arriving
            if self.request_since is None:
                self.request_since = self.loop.time()
            p = self.pending
            if p is None or len(self.buf) >= p[2] + p[3]:
                self._next()
        elif len(self.buf) > MAX_PENDING and self.reading:
            self.reading = False
            assert self.transport is not None
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        """A client that closes its side has left (a client giving up closes so): the transport
        closes and the handler is cancelled, its prefill stopped and its transfer aborted, as on
        aiohttp's path and vLLM's own server. A half-closed HTTP/1.1 client is not served on."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client left: its handler stops (aiohttp's handler_cancellation)
        self._wake()
        self.transport = None

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = self.loop.create_future()
        if self.full_since is None:
            self.full_since, self.full_left = self.loop.time(), 1 << 62

    def resume_writing(self) -> None:
        self.full_since = None
        self._wake()

    # ---- requests ----
    def _next(self) -> None:
        """Start the next request if its head and body are here; hand over what is not hot."""
        buf = self.buf
        if self.pending is not None:  # the head was read before: its body is here now
            self._start(*self.pending)
            self.pending = None
            return
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD or (buf and not buf.startswith(b"POST "[:len(buf)])):
                self._hand_over()
            return
        if end > MAX_HEAD:
            self._hand_over()
            return
        lines = bytes(buf[:end]).split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[0] != b"POST" or parts[1] not in HOT or parts[2] != b"HTTP/1.1":
            self._hand_over()
            return
        headers: CIMultiDict[str] = CIMultiDict()
        length = -1
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or b" " in name or b"\t" in name:
                self._hand_over()  # aiohttp answers a malformed head
                return
            key, val = name.decode("latin-1"), value.strip().decode("latin-1")
            low = key.lower()
            if low == "content-length":
                if length >= 0 or not val.isdigit() or not val.isascii():
                    self._hand_over()
                    return
                length = int(val)
            elif low in ("transfer-encoding", "expect", "upgrade"):
                self._hand_over()
                return
            elif low == "connection" and val.lower() == "close":
                self.keep_alive = False
            headers.add(key, val)
        if length < 0 or length > self.max_body:
            self._hand_over()  # aiohttp refuses an over-size body from its Content-Length, unread
            return
        if len(buf) < end + 4 + length:  # the body is still on its way: other connections go on meanwhile
            path = parts[1].decode()
            if not self.bounds.head_ok(path, headers):
                self._hand_over()  # aiohttp's guard answers it from its head; its body is never buffered
                return
            self.pending = (path, headers, end + 4, length)
            return
        self._start(parts[1].decode(), headers, end + 4, length)

    def _start(self, path: str, headers: CIMultiDict[str], start: int, length: int) -> None:
        body = bytes(self.buf[start:start + length])
        del self.buf[:start + length]
        self.request_since = None
        self.task = self.loop.create_task(self._serve(FastRequest(path, headers, body, self)))

    async def _serve(self, request: FastRequest) -> None:
        try:
            resp = await self.handle(request)
            if isinstance(resp, web.Response):
                if not isinstance(resp.body, (bytes, bytearray)):
                    raise TypeError(f"a {type(resp.body).__name__} body")  # the hot handlers answer bytes
                if self.sent:  # a stream began, then failed past its own handling: it cannot be answered again
                    raise ConnectionResetError("answer already begun")
                await self.send(head(resp.status, resp.reason, resp.headers, resp.body, self.keep_alive))
            else:  # an event stream (streaming.KVEventSubscription) writes itself; its end, if not yet sent
                await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.keep_alive = False
        except Exception:  # noqa: BLE001 - past the handler's own guard: nothing more to tell the client
            logger.exception("front door: answering %s", request.path)
            self.keep_alive = False
        finally:
            self.task = None
            self.sent = False
        t = self.transport
        if t is None or t.is_closing():
            return
        if not self.keep_alive:
            t.close()
            return
        if not self.reading:
            self.reading = True
            t.resume_reading()
        if self.buf:  # the next request began arriving while this one was answered: it is timed from now
            self.request_since = self.loop.time()
            self._next()
        else:
            self.idle_since = self.loop.time()

    async def send(self, data: bytes) -> None:
        """Write to the client, waiting while its socket is full; ConnectionResetError once it left."""
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        t.write(data)
        self.sent = True
        if self.drained is not None:
            await self.drained
            if self.transport is None:
                raise ConnectionResetError("the client closed its connection")

    def send_now(self, data: bytes) -> bool:
        """Write from a callback, where nothing can wait: False (nothing written) while the client's
        socket is full or gone; send() then does it."""
        t = self.transport
        if self.drained is not None or t is None or t.is_closing():
            return False
        t.write(data)
        self.sent = True
        return True

    def _wake(self) -> None:
        d, self.drained = self.drained, None
        if d is not None and not d.done():
            d.set_result(None)

    def _hand_over(self) -> None:
        """The rest of this connection is aiohttp's, starting with the bytes of this request (its
        arrival still timed from its first byte, and the connection still counted)."""
        t = self.transport
        assert t is not None and self.task is None
        self.conns.discard(self)
        self.transport = None
        proto = Bounded(self.fallback(), self.bounds.conns, self.request_since, admit=False)
        t.set_protocol(proto)
        proto.connection_made(t)
        if not self.reading:
            t.resume_reading()
        data, self.buf = bytes(self.buf), bytearray()
        if data:
            proto.data_received(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def close_idle(doors: set[FrontDoor], stall_s: float, conns: Conns | None = None) -> None:
    """Closes the connections that waited IDLE_S for a request, drops those whose request did not
    arrive within `conns.request_s` (--request-timeout; those handed to aiohttp too), and cuts
    those whose client read nothing of its answer for `stall_s` (--stall-timeout; its handler is
    cancelled as if the client had left): one sweep for all of them, checked every quarter of the
    shortest bound (at most 5 s), rather than a timer set and cancelled per request or per write."""
    loop = asyncio.get_running_loop()
    request_s = conns.request_s if conns is not None else REQUEST_S
    while True:
        await asyncio.sleep(min(5.0, IDLE_S / 4, stall_s / 4, request_s / 4))
        now = loop.time()
        if conns is not None:
            conns.sweep(now)
        for d in list(doors):
            if d.task is None and d.idle_since is not None and now - d.idle_since >= IDLE_S:
                d.close()
            elif d.task is None and conns is not None and conns.overdue(d.request_since, now):
                conns.expire(d.transport)
            elif d.full_since is None or d.transport is None:
                continue
            elif (left := unsent(d.transport)) < d.full_left:
                d.full_since, d.full_left = now, left  # the client read some: not stalled
            elif now - d.full_since >= stall_s:
                cut_off(d.transport, stall_s)


def cut_off(t: asyncio.Transport, stall_s: float) -> None:
    """Drop a client that read nothing of its answer for `stall_s` (--stall-timeout): the
    connection's loss cancels its handler, as when a client leaves."""
    logger.info("cut a client connection that read nothing of its answer for %gs (--stall-timeout)", stall_s)
    t.abort()  # close() would wait for the client to read what is buffered


def unsent(t: asyncio.Transport) -> int:
    """Bytes written to the client and not yet taken by it: the transport's buffer and the kernel's
    send queue (the transport's alone does not move while a large kernel buffer drains slowly)."""
    n = t.get_write_buffer_size()
    sock = t.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return n


def head(status: int, reason: str | None, headers: CIMultiDict[str] | dict, body: bytes | bytearray | None,
         keep_alive: bool) -> bytes:
    """A whole answer with a Content-Length body."""
    body = body or b""
    lines = [f"HTTP/1.1 {status} {reason or ''}"]
    for k, v in headers.items():
        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
            lines.append(f"{k}: {v}")
    lines.append(f"Content-Length: {len(body)}")
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
