"""A client's request as the front door read it, and a whole (Content-Length) answer to it.

The request arrives whole: its body was read within --max-body-bytes before any handler runs, so
no handler reads from the connection. An answer is either a `Response` (below) or a stream that
writes itself (http/sse.py `SSEResponse`).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Protocol

from multidict import CIMultiDict

from kvferry.proxy.http import json_codec

# Headers the server writes itself: a handler's own are dropped.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "content-type"})


class Connection(Protocol):
    """The client connection a request came on, as a stream writes to it (http/front_door.py's
    FrontDoor)."""

    keep_alive: bool  # the connection stays open after this answer
    chunked_ok: bool  # its client reads a chunked answer (HTTP/1.1)

    async def send(self, data: bytes) -> None: ...

    def send_now(self, data: bytes) -> bool: ...


class Request:
    """`path` is percent-decoded; `query` holds the query string's fields (the last of a repeated
    name); `match_info` the path's {fields} (http/routes.py); `door` the connection it came on."""

    __slots__ = ("method", "path", "query", "headers", "body", "door", "match_info", "checked", "rid")

    def __init__(self, method: str, path: str, headers: CIMultiDict[str], body: bytes = b"",
                 door: Connection | None = None, query: dict[str, str] | None = None) -> None:
        self.method, self.path, self.headers, self.body, self.door = method, path, headers, body, door
        self.query = query or {}
        self.match_info: dict[str, str] = {}
        self.checked = False  # its head passed the guard's refusal before its body was read
        self.rid = ""  # its X-Request-Id (the client's, checked, or a fresh one: the guard sets it)


class Response:
    """A whole answer: status, body and content type (JSON unless said), other headers if any."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, body: bytes = b"", status: int = 200, content_type: str = "application/json",
                 headers: dict[str, str] | None = None) -> None:
        self.status, self.body, self.content_type, self.headers = status, body, content_type, headers

    def encode(self, keep_alive: bool, with_body: bool = True) -> bytes:
        """The answer's bytes on an HTTP/1.1 connection (`with_body` False: a HEAD request's)."""
        extra = ""
        if self.headers:
            extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items() if k.lower() not in _FRAMING)
        return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s%s\r\n%s" % (
            self.status, reason(self.status), self.content_type.encode(), len(self.body), extra.encode("latin-1"),
            b"" if keep_alive else b"Connection: close\r\n", self.body if with_body else b"")


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error shape (as vLLM writes it): {"error": {message, type, param, code}}; the front
    door's own refusals are in it too, since every client of the proxy reads OpenAI's."""
    etype = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": etype, "param": param, "code": kind}}


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json_codec.dumps(obj), status, headers=headers)
