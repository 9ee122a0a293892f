"""The proxy's spans (OpenTelemetry, W3C trace context), made only with --otlp-traces-endpoint:
imported then, and the proxy holds None otherwise (each hook is one `is None` check).

One trace per client request, continuing the client's `traceparent` (else a new trace).
Whether it is recorded is the proxy's choice, at --trace-sample-ratio, whatever the client's
sampled flag says: a client's trace id and tracestate still go on to the engines, with the
proxy's decision as their flag (an unsampled context: vLLM and the connector record nothing).
Otherwise any client could make the proxy and both engines record and export the spans of every
request it sends, a cost the operator's ratio is there to bound. With
--trust-client-trace-sampling (the callers are the operator's own, sampling upstream) the
client's flag decides, as W3C trace context's parent-based sampling does.

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

import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from kvferry.common.otel import Tracing
from kvferry.common.wire import transfer_params
from kvferry.proxy.http.exchange import Request, Response
from kvferry.proxy.http.sse import Answer
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing.instances import Instance

Span = trace.Span
_CARRIED = ("traceparent", "tracestate")


class ProxyTracer:
    def __init__(self, opts: ProxyOptions) -> None:
        assert opts.otlp_traces_endpoint is not None, "made only with --otlp-traces-endpoint"
        self.tracing = Tracing(opts.otlp_traces_endpoint, opts.service_name, opts.otlp_traces_protocol,
                               opts.trace_sample_ratio)
        self.tracer = self.tracing.tracer
        self.propagator = self.tracing.propagator
        self.ratio, self.trust_sampling = opts.trace_sample_ratio, opts.trust_client_trace_sampling

    def parent(self, request: Request) -> otel_context.Context | None:
        """The client's trace context (None: none or unusable), its sampled flag replaced by the
        proxy's own draw at --trace-sample-ratio unless --trust-client-trace-sampling."""
        carrier = {k: v for k in _CARRIED if (v := request.headers.get(k)) is not None}
        if not carrier:
            return None
        parent = self.propagator.extract(carrier)
        remote = trace.get_current_span(parent).get_span_context()
        if self.trust_sampling or not remote.is_valid:
            return parent
        flags = TraceFlags(TraceFlags.SAMPLED if random.random() < self.ratio else TraceFlags.DEFAULT)
        return trace.set_span_in_context(NonRecordingSpan(SpanContext(
            remote.trace_id, remote.span_id, is_remote=True, trace_flags=flags, trace_state=remote.trace_state)))

    async def request(self, request: Request, rid: str, handle: Callable[[Request], Awaitable[Answer]]) -> Answer:
        """`handle(request)` inside the request's span, the current span of its task meanwhile."""
        parent = self.parent(request)
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
