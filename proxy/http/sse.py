"""Server-sent events: the stream response the flows write to (`SSEResponse`), one event's
framing (`sse`), and the split of an engine's events into their `data:` payloads
(`plain_events`).

An `SSEResponse` writes the chunked stream to the client's connection (http/front_door.py)
itself; a client that reads nothing of it for --stall-timeout is cut off there.
"""

from __future__ import annotations

from typing import Any

from kvferry.proxy.http import json_codec
from kvferry.proxy.http.exchange import Connection, Request, Response

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"


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
    """A `text/event-stream` answer, written to the client's connection (its `door`) as chunked
    HTTP/1.1; its head goes out with the first event (one write, not two). An HTTP/1.0 client gets
    the events unframed and the connection closed at their end. `status` is 200 (what the guard
    counts)."""

    __slots__ = ("status", "door", "pending", "ended", "chunked")

    def __init__(self) -> None:
        self.status = 200
        self.door: Connection | None = None
        self.pending = b""  # the head, sent with the first event
        self.ended = False
        self.chunked = True

    async def prepare(self, request: Request) -> None:
        """Start the answer: only noted, its head goes with the first event."""
        door = request.door
        assert door is not None, "a stream answers a client's connection"
        self.door = door
        self.chunked = door.chunked_ok
        rid = b"X-Request-Id: %s\r\n" % request.rid.encode() if request.rid else b""
        self.pending = SSE_HEAD + rid + (b"Transfer-Encoding: chunked\r\n" if self.chunked else b"") + (
            b"Connection: keep-alive\r\n\r\n" if door.keep_alive else b"Connection: close\r\n\r\n")

    def _frame(self, data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    async def write(self, data: bytes) -> None:
        assert self.door is not None, "prepare() first"
        if data:
            out, self.pending = self.pending + self._frame(data), b""
            await self.door.send(out)

    def write_now(self, data: bytes) -> bool:
        """Write one chunk from a callback (a decode leg's direct relay): False, nothing written,
        before the head went out or while the client's socket is full."""
        door = self.door
        return door is not None and not self.pending and not self.ended and door.send_now(self._frame(data))

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ended or self.door is None:
            return
        self.ended = True
        out = self.pending + (self._frame(data) if data else b"") + (b"0\r\n\r\n" if self.chunked else b"")
        self.pending = b""
        await self.door.send(out)


Answer = Response | SSEResponse  # what a handler answers: a whole body, or a stream
