"""Server-sent events: the stream response the flows write to (`SSEResponse`), one event's
framing (`sse`), and the split of an engine's events into their `data:` payloads
(`plain_events`).

On the front door (http/front_door.py) an `SSEResponse` writes the chunked stream to the client's
connection itself, its head going out with the first event (one write, not two). On aiohttp's
server it writes through an aiohttp `StreamResponse`, each write bounded by --stall-timeout
(aiohttp waits on a full socket for ever); the middleware answers aiohttp with `response`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from kvferry.proxy.http.front_door import FrontDoor, cut_off
from kvferry.proxy.openai import json_codec

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
CLIENT_STALL_S = web.AppKey("client_stall_s", float)  # --stall-timeout, for a stream on aiohttp's server
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n")


def sse(obj: Any) -> bytes:
    """One event: `data: ` and the object's compact JSON."""
    return b"data: " + json_codec.dumps(obj) + b"\n\n"


def plain_events(whole: bytes) -> list[bytes] | None:
    """The payloads of whole SSE events, each one `data:` line (vLLM's), split in one pass; None
    when any event is otherwise (more lines, a carriage return, an error event). A payload is
    JSON, whose strings escape newlines, so a newline only ends a line."""
    n = whole.count(b"\n\n") + 1
    if (whole.startswith(b"data: ") and whole.count(b"\n") == 2 * (n - 1) and whole.count(b"data: ") == n
            and b"\r" not in whole and b'{"error"' not in whole):
        return whole[6:].split(b"\n\ndata: ")
    return None


def events(whole: bytes, on_error: Any) -> list[bytes]:
    """The `data:` payloads of whole SSE events, any shape; `on_error(payload)` is called for an
    error event (it may raise)."""
    batch = plain_events(whole)
    if batch is not None:
        return batch
    batch = []
    for ev in whole.split(b"\n\n"):
        for line in ev.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:].rstrip(b"\r")
                if data.startswith(b'{"error"'):
                    on_error(data)
                batch.append(data)
    return batch


class SSEResponse:
    """A `text/event-stream` answer, streamed as chunked HTTP/1.1. `status` is 200 (what the
    middleware counts)."""

    __slots__ = ("status", "door", "response", "pending", "ended", "stall_s", "transport")

    def __init__(self) -> None:
        self.status = 200
        self.door: FrontDoor | None = None
        self.response: web.StreamResponse | None = None  # on aiohttp's server: what answers it
        self.pending = b""  # the front door's head, sent with the first event
        self.ended = False
        self.stall_s = 0.0  # aiohttp's server: --stall-timeout
        self.transport: asyncio.Transport | None = None

    async def prepare(self, request: Any) -> None:
        """Start the answer (on the front door: only noted, its head goes with the first event)."""
        door = getattr(request, "door", None)
        if door is not None:
            self.door = door
            self.pending = SSE_HEAD + (b"Connection: keep-alive\r\n\r\n" if door.keep_alive
                                       else b"Connection: close\r\n\r\n")
            return
        self.response = web.StreamResponse(headers=SSE_HEADERS)
        self.stall_s = request.app[CLIENT_STALL_S]
        self.transport = request.transport
        await self.response.prepare(request)

    async def write(self, data: bytes) -> None:
        if self.door is None:
            assert self.response is not None, "prepare() first"
            await self._bounded(self.response.write(data))
            return
        if data:
            out, self.pending = self.pending + b"%x\r\n%s\r\n" % (len(data), data), b""
            await self.door.send(out)

    def write_now(self, data: bytes) -> bool:
        """Write one chunk from a callback (a decode leg's direct relay): False, nothing written, on
        aiohttp's server, before the head went out, or while the client's socket is full."""
        door = self.door
        return (door is not None and not self.pending and not self.ended
                and door.send_now(b"%x\r\n%s\r\n" % (len(data), data)))

    async def write_eof(self, data: bytes = b"") -> None:
        if self.door is None:
            if self.response is not None:
                await self._bounded(self.response.write_eof(data))
            return
        if self.ended:
            return
        self.ended = True
        out = self.pending + (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n"
        self.pending = b""
        await self.door.send(out)

    async def _bounded(self, write: Any) -> None:
        """aiohttp's write, which waits for a full socket without a bound: cut after --stall-timeout."""
        try:
            async with asyncio.timeout(self.stall_s):
                await write
        except TimeoutError:
            if self.transport is not None:
                cut_off(self.transport, self.stall_s)
            raise asyncio.CancelledError from None  # as aiohttp's cancel on the connection's loss would


Answer = web.Response | SSEResponse  # what a handler answers: a whole body, or a stream
