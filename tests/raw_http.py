"""HTTP/1.1 on a bare socket, for tests of what a server does with partial and hostile requests:
read one answer within the socket's timeout, and wait (bounded) for the server to close."""

from __future__ import annotations

import socket
import time

from tests.polling import until


def connect(port: int, host: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection((host, port), timeout=5)


def answer(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer with a Content-Length body: status, headers (lower-cased names), body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, "closed mid-answer"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_within(s: socket.socket, seconds: float) -> None:
    """Until the server closed `s` (EOF or reset), reading and dropping what comes; fails past `seconds`."""
    s.settimeout(0.1)

    def closed() -> bool:
        try:
            return not s.recv(65536)
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    until(closed, seconds, f"the server to close the connection within {seconds}s", every=0)


def closed_by_the_timeout(port: int, partial: dict[str, bytes], request_s: float) -> None:
    """Send each partial request on a connection of its own: each is closed by the server's
    request timeout (`request_s`): within it plus 4 s of slack, and not much before it."""
    socks = {what: connect(port) for what in partial}
    try:
        t0 = time.monotonic()
        for what, data in partial.items():
            socks[what].sendall(data)
        for what, s in socks.items():
            closed_within(s, request_s + 4)
            took = time.monotonic() - t0
            assert took >= request_s * 0.8, (what, took)  # by the timeout, not at once
    finally:
        for s in socks.values():
            s.close()
