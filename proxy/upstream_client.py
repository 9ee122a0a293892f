"""The proxy's connections to the engines: the legs' pool and the health checks' (both on the one
HTTP client, common/http/client.py), opened with the app and closed with it, and the headers every
upstream request carries."""

from __future__ import annotations

from typing import Any, Protocol

from kvferry.common.http.client import Pool
from kvferry.proxy.options import ProxyOptions


class LegTracer(Protocol):
    """What the legs and the router record into (proxy/tracing.py's ProxyTracer, with tracing on;
    a span is opaque here)."""

    def leg(self, inst: Any, leg: str) -> Any: ...

    def headers(self, span: Any) -> bytes: ...

    def into_params(self, span: Any, body: dict) -> dict: ...

    @staticmethod
    def failed(span: Any, kind: str, message: str) -> None: ...

    @staticmethod
    def end(span: Any) -> None: ...

    def record(self, name: str, start_ns: int, attributes: dict[str, Any]) -> None: ...


class UpstreamClient:
    """The legs' pool and the health checks' (open between the app's start and cleanup), and the
    headers every upstream request carries."""

    CHECK_CONNECTIONS = 2  # per instance: a periodic check and a failed leg's probe at once

    def __init__(self, opts: ProxyOptions) -> None:
        self.opts = opts
        self._pool: Pool | None = None
        self._checks: Pool | None = None
        self._closed = False
        self.tracer: LegTracer | None = None  # --otlp-traces-endpoint: each leg's span (proxy/tracing.py)
        self.headers = {"Content-Type": "application/json"}
        if opts.upstream_api_key:
            self.headers["Authorization"] = f"Bearer {opts.upstream_api_key}"

    @property
    def pool(self) -> Pool:
        """The legs' connections, between start() and close()."""
        assert self._pool is not None, "the upstream client is not started"
        return self._pool

    @property
    def checks(self) -> Pool:
        """The health checks' and load scrapes' connections, between start() and close()."""
        assert self._checks is not None, "the upstream client is not started"
        return self._checks

    @property
    def is_open(self) -> bool:
        return self._pool is not None and not self._closed

    def start(self) -> None:
        o = self.opts
        # Waiting for a free connection is bounded by the read timeout (at least the connect
        # timeout), so a busy pool queues requests rather than failing them.
        wait = max(o.read_timeout, o.connect_timeout)
        # --workers N: the connections are the proxy's, split between its workers (at least one each).
        per_worker = max(1, -(-o.upstream_connections // max(1, o.workers)))
        self._pool = Pool(per_worker, o.connect_timeout, wait, o.read_timeout, self.headers, o.stall_timeout)
        self._checks = Pool(self.CHECK_CONNECTIONS, o.connect_timeout, wait, o.read_timeout, self.headers,
                            o.stall_timeout)

    async def close(self) -> None:
        self._closed = True
        for p in (self._pool, self._checks):
            if p is not None:
                await p.close()
