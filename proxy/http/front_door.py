"""The proxy's HTTP/1.1 server: one asyncio Protocol per client connection, its requests parsed by
httptools (llhttp, the parser aiohttp's server and uvicorn use) and each answered whole by one
handler (the proxy's guard and routes, proxy/app.py), every route alike.

Why its own server rather than aiohttp's: per request aiohttp's builds request, payload, writer,
middleware and task objects, a large share of the proxy's CPU per request (docs/benchmarks.md);
here a request is a head, a body and one task.

What it holds for every request:
- a request is read whole before its handler runs: a body over --max-body-bytes is refused 413
  from its Content-Length, or as soon as its chunks pass the limit, never buffered whole; a head
  over MAX_HEAD bytes is refused 431;
- every request's head is judged before anything of it is answered (`_judge`), as RFC 9112 says
  where it speaks (http/head_rules.py): its Host (400); when a body is to come, its keys, route
  and method (`Bounds.refuse`); its Transfer-Encoding, every line of it (400, or 501 for a coding
  other than chunked); then its size. One refused is answered and its connection closed, its
  body never read; `Expect: 100-continue` gets "100 Continue" only when its head passes;
- requests on one connection are answered in order, one at a time; a pipelined request's head is
  judged when its turn comes, and reading pauses while MAX_PENDING bytes of requests wait;
- a client that disconnects (or half-closes) cancels its request's handler;
- a slow client pauses the writer; one that reads nothing of its answer for --stall-timeout is
  cut off, so its decoder and connection come back;
- an idle keep-alive connection closes after --keep-alive-timeout (IDLE_S unless given); a
  request whose head and body have not arrived --request-timeout after its first byte has its
  connection closed;
- past --max-connections open connections, a new one is answered 503 with Retry-After and closed;
- bytes llhttp does not read as HTTP/1.x are answered 400 and the connection closed; an HTTP/1.0
  request, and one asking to Upgrade, are answered and their connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast
from urllib.parse import parse_qsl, unquote

import httptools
from multidict import CIMultiDict

from kvferry.common import trace_context
from kvferry.common.errors import BadDataError
from kvferry.common.http.connections import Conns
from kvferry.common.log import get_logger
from kvferry.proxy.http import head_rules
from kvferry.proxy.http.exchange import Request, Response, error_body, json_response

if TYPE_CHECKING:
    from kvferry.proxy.http.sse import Answer

logger = get_logger(__name__)

MAX_HEAD = 65536  # bytes of a request's line and headers
IDLE_S = 75.0  # --keep-alive-timeout's default: an idle keep-alive connection's wait (aiohttp's keepalive_timeout)
REQUEST_S = 30.0  # --request-timeout's default
MAX_PENDING = 1 << 20  # bytes of requests waiting for their turn before reading pauses

Handler = Callable[[Request], Awaitable["Answer"]]
Refusal = Callable[[str, str, CIMultiDict[str]], "Response | None"]


class Bounds:
    """What one process's connections share: `conns` (--max-connections, --request-timeout), and
    `refuse(method, path, headers)`: the answer to a request whose body is still to come that its
    head alone refuses (None: read it)."""

    __slots__ = ("conns", "refuse")

    def __init__(self, conns: Conns, refuse: Refusal) -> None:
        self.conns, self.refuse = conns, refuse


def _no_refusal(method: str, path: str, headers: CIMultiDict[str]) -> Response | None:
    return None


UNBOUNDED = Bounds(Conns(REQUEST_S, 1 << 30, b"", "front door"), _no_refusal)


class _Stop(BadDataError):
    """Raised in a parser callback once the request is answered from what was read (a refusal):
    nothing more of this connection is parsed."""


class _Head:
    """A request whose head was read, while its body arrives and until its turn."""

    __slots__ = ("method", "path", "query", "headers", "to_come", "keep_alive", "http10", "framing", "judged",
                 "checked", "parts", "size", "request")

    def __init__(self, method: str, path: str, query: dict[str, str], headers: CIMultiDict[str], to_come: int,
                 keep_alive: bool, http10: bool, framing: tuple[int, str] | None) -> None:
        self.method, self.path, self.query, self.headers = method, path, query, headers
        self.to_come = to_come  # the Content-Length, -1 for a chunked body (or one whose framing is refused)
        self.keep_alive, self.http10 = keep_alive, http10
        self.framing = framing  # the status and message its Transfer-Encoding is refused with (head_rules)
        self.judged = False  # its head passed the checks made before its body is read
        self.checked = False  # ... Bounds.refuse among them
        self.parts: list[bytes] = []
        self.size = 0
        self.request: Request | None = None  # once whole


class FrontDoor(asyncio.Protocol):
    """One client connection."""

    def __init__(self, handle: Handler, max_body: int, conns: set[FrontDoor], bounds: Bounds = UNBOUNDED) -> None:
        self.handle, self.max_body, self.conns, self.bounds = handle, max_body, conns, bounds
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.url = b""
        self.fields: CIMultiDict[str] = CIMultiDict()
        self.head_bytes = 0  # received while no head was whole (llhttp buffers a header until its end)
        self.head: _Head | None = None  # the request being read, once its head is
        self.queue: deque[_Head] = deque()  # whole requests waiting for their turn
        self.queued = 0
        self.closing: Response | None = None  # answered when its turn comes, then the connection closes
        self.task: asyncio.Task[None] | None = None
        self.keep_alive = True  # of the request being answered
        self.chunked_ok = True  # its client reads a chunked answer (HTTP/1.1)
        self.sent = False  # its answer began
        self.reading = True
        self.drained: asyncio.Future[None] | None = None  # set while the client's socket is full
        # The client's socket is full and nothing of what waits was taken since (close_idle's to cut);
        # what waits then: a client that reads, however slowly, moves both on.
        self.full_since: float | None = None
        self.full_left = 0
        self.idle_since: float | None = None  # waiting for a request since (close_idle's to close)
        self.request_since: float | None = None  # a request's first byte came then; its head or body is awaited
        self.loop = asyncio.get_running_loop()

    # ---- asyncio callbacks ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.bounds.conns.admit(transport, len(self.conns)):
            self.parser = None
            return  # answered 503 and closed: nothing more is read
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it
        self.conns.add(self)
        self.idle_since = self.loop.time()

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None or self.transport is None:
            return  # closing: the rest is not read
        if self.head is None:
            self.head_bytes += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.parser = None  # answered as a plain request; the connection closes after it
            if self.queue:
                self.queue[-1].keep_alive = False
        except httptools.HttpParserError as e:
            self.parser = None
            cause = e.__context__
            if self.transport is not None and not isinstance(cause, _Stop):
                if cause is not None and not isinstance(cause, httptools.HttpParserError):
                    logger.error("front door: reading a request", exc_info=cause)  # a bug here, not the client's
                self._stop(json_response(error_body(400, f"malformed HTTP request: {e}", "bad_request"), 400))
        if self.parser is not None and self.head is None and self.head_bytes > MAX_HEAD:
            self.parser = None
            self._stop(json_response(error_body(431, f"request head over {MAX_HEAD} bytes", "head_too_large"), 431))
        self._go()
        if self.queued > MAX_PENDING and self.reading and self.transport is not None:
            self.reading = False
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        """A client that closes its side has left (a client giving up closes so): the transport
        closes and the handler is cancelled, its prefill stopped and its transfer aborted, as on
        vLLM's own server. A half-closed HTTP/1.1 client is not served on."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client left: its handler stops
        self._wake()
        self.transport = None
        self.parser = None

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = self.loop.create_future()
        if self.full_since is None:
            self.full_since, self.full_left = self.loop.time(), 1 << 62

    def resume_writing(self) -> None:
        self.full_since = None
        self._wake()

    # ---- httptools callbacks ----
    def on_message_begin(self) -> None:
        self.url, self.fields = b"", CIMultiDict()
        self.idle_since = None
        if self.request_since is None:
            self.request_since = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.head_bytes = 0
        u = httptools.parse_url(self.url)
        raw_path = u.path.decode("latin-1")
        path = unquote(raw_path) if "%" in raw_path else raw_path
        query = dict(parse_qsl(u.query.decode("latin-1"))) if u.query else {}
        headers = self.fields
        http10 = self.parser.get_http_version() != "1.1"
        codings = headers.getall("Transfer-Encoding", None)  # every line: llhttp frames by the last coding
        if codings is None:
            to_come, framing = int(headers.get("Content-Length") or 0), None  # llhttp checked it is a number
        else:
            to_come, framing = -1, head_rules.coding_refusal(codings, http10)
        h = self.head = _Head(self.parser.get_method().decode(), path, query, headers, to_come,
                              self.parser.should_keep_alive() and not http10, http10, framing)
        if self.task is None and not self.queue:
            self._judge(h)
        elif self.reading and self.transport is not None:  # its turn will come: its body waits meanwhile
            self.reading = False
            self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        h = self.head
        assert h is not None
        h.size += len(body)
        if h.size > self.max_body:
            self._stop(_named(self._too_large(), h))
            raise _Stop
        h.parts.append(body)

    def on_message_complete(self) -> None:
        h = self.head
        assert h is not None
        self.head, self.request_since = None, None
        h.request = Request(h.method, h.path, h.headers, h.parts[0] if len(h.parts) == 1 else b"".join(h.parts),
                            self, h.query)
        h.parts = []
        self.queue.append(h)
        self.queued += h.size

    # ---- requests ----
    def _judge(self, h: _Head) -> None:
        """The checks of a request's head before its body is read; raises _Stop once answered."""
        h.judged = True
        bad_host = head_rules.host_refusal(h.headers.getall("Host", ()), h.http10)
        if bad_host is not None:
            self._stop(_named(json_response(error_body(400, bad_host, "bad_host"), 400), h))
            raise _Stop
        if h.to_come:  # who asks first, then how: a stranger learns nothing of the codings and limits
            refused = self.bounds.refuse(h.method, h.path, h.headers)
            if refused is not None:
                self._stop(_named(refused, h))
                raise _Stop
            h.checked = True
        if h.framing is not None:
            status, why = h.framing
            self._stop(_named(json_response(error_body(status, why, "bad_transfer_encoding"), status), h))
            raise _Stop
        if h.to_come > self.max_body:
            self._stop(_named(self._too_large(), h))
            raise _Stop
        expect = h.headers.get("Expect")
        if expect is not None and not h.http10 and h.request is None:
            if expect.lower() != "100-continue":
                self._stop(_named(json_response(error_body(417, f"Expect: {expect} is not understood", "bad_request"),
                                                417), h))
                raise _Stop
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _too_large(self) -> Response:
        return json_response(error_body(413, f"request body larger than {self.max_body} bytes (--max-body-bytes)",
                                        "body_too_large"), 413)

    def _stop(self, answer: Response) -> None:
        """Nothing more is read: `answer` goes out when its turn comes, then the connection closes."""
        self.parser = None
        if self.closing is None:
            self.closing = answer
        if self.reading and self.transport is not None:
            self.reading = False
            self.transport.pause_reading()

    def _go(self) -> None:
        """The next request, if it is its turn: whole ones first, then an answer that closes the
        connection, then the head of one still arriving (judged now that its turn came)."""
        if self.task is not None or self.transport is None:
            return
        if self.queue:
            h = self.queue.popleft()
            self.queued -= h.size
            if not h.judged:
                try:
                    self._judge(h)
                except _Stop:
                    pass
                if self.closing is not None:  # refused from its head, its body read already: dropped
                    self.queue.clear()
                    self._go()
                    return
            assert h.request is not None
            h.request.checked = h.checked
            self.keep_alive, self.chunked_ok = h.keep_alive, not h.http10
            self.task = self.loop.create_task(self._serve(h.request))
            return
        if self.closing is not None:
            t = self.transport
            t.write(self.closing.encode(keep_alive=False))
            t.close()
            self.transport = None
            return
        partial = self.head
        if partial is not None and not partial.judged:
            try:
                self._judge(partial)
            except _Stop:
                self._go()
                return
        if not self.reading and self.queued <= MAX_PENDING and self.parser is not None:
            self.reading = True
            self.transport.resume_reading()

    async def _serve(self, request: Request) -> None:
        try:
            resp = await self.handle(request)
            if isinstance(resp, Response):
                if self.sent:  # a stream began, then failed past its own handling: it cannot be answered again
                    raise ConnectionResetError("answer already begun")
                await self.send(resp.encode(self.keep_alive, request.method != "HEAD"))
            else:  # a stream wrote itself; its end, if not yet sent
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
        now = self.loop.time()
        if self.request_since is not None:  # the next request began arriving meanwhile: timed from now
            self.request_since = now
        self._go()
        if self.task is None and self.request_since is None:
            self.idle_since = now

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

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def close_idle(doors: set[FrontDoor], stall_s: float, conns: Conns | None = None,
                     idle_s: float | None = None) -> None:
    """Closes the connections that waited `idle_s` (--keep-alive-timeout, default IDLE_S) for a
    request, drops those whose request did not arrive within `conns.request_s` (--request-timeout),
    and cuts those whose client read nothing of its answer for `stall_s` (--stall-timeout; its
    handler is cancelled as if the client had left): one sweep for all of them, checked every
    quarter of the shortest bound (at most 5 s), rather than a timer set and cancelled per request
    or per write."""
    loop = asyncio.get_running_loop()
    request_s = conns.request_s if conns is not None else REQUEST_S
    idle = IDLE_S if idle_s is None else idle_s
    while True:
        await asyncio.sleep(min(5.0, idle / 4, stall_s / 4, request_s / 4))
        now = loop.time()
        if conns is not None:
            conns.sweep(now)
        for d in list(doors):
            if d.task is None and d.idle_since is not None and now - d.idle_since >= idle:
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


def _named(answer: Response, h: _Head) -> Response:
    """A request refused from its head still answers with its X-Request-Id, as every answer does."""
    rid = trace_context.request_id(h.headers.get("X-Request-Id"))
    answer.headers = {**answer.headers, "X-Request-Id": rid} if answer.headers else {"X-Request-Id": rid}
    return answer
