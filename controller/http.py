"""Serve an ASGI app with uvicorn inside the controller's own event loop (next to its ZMQ loops).

The listening sockets are bound here, not by uvicorn, so a port in use is a one-line error naming
the flag (uvicorn would log and sys.exit(1)); the process's signals stay with the controller,
which stops the server itself (uvicorn would re-raise a caught SIGTERM after shutting down).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from kvferry.controller.guard import ASGIApp

GRACE_S = 5  # open requests get this long to finish at shutdown, then they are cancelled
START_S = 30.0


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets on every address `host` resolves to (localhost: 127.0.0.1 and ::1)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SystemExit(f"kvferry-controller: cannot resolve --host {host!r} ({e})") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(1024)
            s.setblocking(False)
    except OSError as e:
        for s in socks:
            s.close()
        raise SystemExit(f"kvferry-controller: cannot serve HTTP on {host}:{port} ({e}): pick a free --port") from None
    return socks


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the controller owns SIGINT/SIGTERM and calls HttpServer.stop()


class HttpServer:
    def __init__(self, app: ASGIApp, host: str, port: int) -> None:
        self.host, self.port = host, port
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None, log_level="warning",
                                timeout_graceful_shutdown=GRACE_S)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        socks = listen(self.host, self.port)
        self._task = asyncio.create_task(self._server.serve(sockets=socks))
        deadline = asyncio.get_running_loop().time() + START_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise SystemExit(f"kvferry-controller: the HTTP server on {self.host}:{self.port} stopped at start")
            if asyncio.get_running_loop().time() > deadline:
                raise SystemExit(f"kvferry-controller: the HTTP server on {self.host}:{self.port} did not start "
                                 f"within {START_S:g}s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        # Bounded: uvicorn gives open requests GRACE_S, then cancels them.
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
