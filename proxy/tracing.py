"""The proxy's spans (OpenTelemetry, W3C trace context), made only with --otlp-traces-endpoint:
imported then, and the proxy holds None otherwise (each hook is one `is None` check).

One trace per client request, continuing the client's `traceparent` (else a new trace, sampled
at --trace-sample-ratio):

- the request (SERVER): the route, the X-Request-Id, the answer's status;
- `route`: the decoder and prefiller picked, and why (cache, load, local, no_prefiller, ...);
- one CLIENT span per leg to an engine (`prefill`, `decode`, `single`, `detokenize`, `models`):
  the instance, the transfer id, the failure kind if it failed; the leg's `traceparent` and
  `tracestate` go out in its headers (vLLM's `llm_request` span joins under it) and in its
  `kv_transfer_params` (the connector's KV spans join under it);
- `retry`: a prefill leg that failed and goes to another prefiller;
- `migration`: a decode leg that failed and moves to another decoder.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvferry.common import transfer_params
from kvferry.common.otel import Tracing
from kvferry.proxy.http.messages import Request, Response
from kvferry.proxy.http.sse import Answer
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing.registry import Instance

Span = trace.Span
_CARRIED = ("traceparent", "tracestate")


class ProxyTracer:
    def __init__(self, opts: ProxyOptions) -> None:
        assert opts.otlp_traces_endpoint is not None, "made only with --otlp-traces-endpoint"
        self.tracing = Tracing(opts.otlp_traces_endpoint, opts.service_name, opts.otlp_traces_protocol,
                               opts.trace_sample_ratio)
        self.tracer = self.tracing.tracer
        self.propagator = self.tracing.propagator

    async def request(self, request: Request, rid: str, handle: Callable[[Request], Awaitable[Answer]]) -> Answer:
        """`handle(request)` inside the request's span, the current span of its task meanwhile."""
        carrier = {k: v for k in _CARRIED if (v := request.headers.get(k)) is not None}
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(f"{request.method} {request.path}", parent, SpanKind.SERVER, attributes={
            "http.request.method": request.method, "url.path": request.path, "kvferry.request_id": rid})
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            resp = await handle(request)
        except BaseException as e:
            span.set_status(Status(StatusCode.ERROR, type(e).__name__))
            raise
        else:
            span.set_attribute("http.response.status_code", resp.status)
            if resp.status >= 500:
                span.set_status(Status(StatusCode.ERROR, _error_message(resp)))
            return resp
        finally:
            otel_context.detach(token)
            span.end()

    def leg(self, inst: Instance, leg: str) -> Span:
        """A leg's span, a child of the request's (not made current: the leg's context goes out in
        its headers and body)."""
        return self.tracer.start_span(leg, kind=SpanKind.CLIENT, attributes={
            "kvferry.leg": leg, "kvferry.instance": inst.id, "kvferry.role": inst.role, "server.address": inst.url})

    def headers(self, span: Span) -> bytes:
        """The leg's `traceparent` (and `tracestate`) header lines."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, trace.set_span_in_context(span))
        return "".join(f"{k}: {v}\r\n" for k, v in carrier.items()).encode("latin-1")

    def into_params(self, span: Span, body: dict) -> dict:
        """The leg's body with its traceparent in `kv_transfer_params`, when it has them."""
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return body
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, trace.set_span_in_context(span))
        tp = carrier.get("traceparent")
        if tp is None:
            return body
        span.set_attribute("kvferry.transfer_id", str(params.get("transfer_id") or ""))
        return dict(body, kv_transfer_params=transfer_params.with_traceparent(params, tp))

    @staticmethod
    def failed(span: Span, kind: str, message: str) -> None:
        span.set_attribute("error.type", kind)
        span.set_status(Status(StatusCode.ERROR, message[:300]))

    @staticmethod
    def end(span: Span) -> None:
        span.end()

    def record(self, name: str, start_ns: int, attributes: dict[str, Any]) -> None:
        """A finished span under the current one, from `start_ns` (time.time_ns()) to now."""
        self.tracer.start_span(name, start_time=start_ns, attributes=attributes).end()

    def shutdown(self) -> None:
        self.tracing.shutdown()


def now_ns() -> int:
    return time.time_ns()


def _error_message(resp: Answer) -> str:
    return resp.body[:300].decode(errors="replace") if isinstance(resp, Response) else "stream"
