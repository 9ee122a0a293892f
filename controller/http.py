"""Serve an ASGI app with uvicorn inside the controller's own event loop (next to its ZMQ loops).

The listening sockets are bound here, not by uvicorn, so a port in use is a one-line error naming
the flag (uvicorn would log and sys.exit(1)); the process's signals stay with the controller,
which stops the server itself (uvicorn would re-raise a caught SIGTERM after shutting down).

uvicorn waits forever for a request head or body that stops halfway, and for a connection that
sends nothing, and accepts connections without limit (its limit_concurrency answers 503 only to a
whole request head). So each connection's protocol is uvicorn's own wrapped in
common/http/connections.Bounded, given to uvicorn as its `http` protocol class (called as uvicorn calls
any: config, server_state, app_state): a connection's first request is due --request-timeout
after it opened, every later one as long after its first byte, and past --max-connections a new
connection is answered a JSON 503 and closed before uvicorn sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvferry.common.http import connections as http_conns
from kvferry.controller.request_guard import ASGIApp

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


@dataclass(frozen=True)
class HttpLimits:
    request_timeout: float = 30.0  # a request's head and body are due this long after its first byte
    max_connections: int | None = None  # None: http_conns.default_max_connections() (from `ulimit -n`)


DEFAULT_LIMITS = HttpLimits()


def bounded_protocol(conns: http_conns.Conns) -> type[asyncio.Protocol]:
    """uvicorn's `http` protocol class, each connection bounded by `conns`."""

    class Door(http_conns.Bounded):
        def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                     _loop: asyncio.AbstractEventLoop | None = None) -> None:
            inner = AutoHTTPProtocol(config=config, server_state=server_state,  # type: ignore[call-arg]
                                     app_state=app_state, _loop=_loop)
            super().__init__(inner, conns, asyncio.get_running_loop().time())

    return Door


class HttpServer:
    def __init__(self, app: ASGIApp, host: str, port: int, limits: HttpLimits = DEFAULT_LIMITS,
                 dropped: Callable[[str], None] | None = None) -> None:
        """`dropped(reason)`: counts the connections refused or closed early (http_conns.Conns)."""
        self.host, self.port = host, port
        limit = limits.max_connections or http_conns.default_max_connections()
        busy = http_conns.busy_answer({"error": f"kvferry-controller has {limit} connections open "
                                                "(--max-connections); retry shortly"})
        self.conns = http_conns.Conns(limits.request_timeout, limit, busy, "kvferry-controller", dropped)
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None, log_level="warning",
                                timeout_graceful_shutdown=GRACE_S, http=bounded_protocol(self.conns))
        self._server = _Server(config)
        self._task: asyncio.Task | None = None
        self._sweep: asyncio.Task | None = None

    async def start(self) -> None:
        socks = listen(self.host, self.port)
        self._sweep = asyncio.create_task(self.conns.run())
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
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        if self._task is None:
            return
        self._server.should_exit = True
        # Bounded: uvicorn gives open requests GRACE_S, then cancels them.
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
