"""One process's OpenTelemetry tracer: an OTLP exporter, a sampler and a service name.

Only a process with tracing on imports this module's OpenTelemetry packages (the `tracing`
extra: `pip install 'kvferry[tracing]'`); without them, turning tracing on is a
ConfigurationError that names the extra. The proxy (proxy/tracing.py) and the connector's KV
spans (engine/pd/kv_spans.py) each make one `Tracing` per process.

The exporter speaks OTLP over gRPC (the default, as vLLM's `--otlp-traces-endpoint`, so one
collector port takes every process's spans) or http/protobuf (`protocol`, else the standard
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL). Spans are batched and sent every `BATCH_DELAY_MS` from a
thread of the SDK's; `shutdown()` sends what is left (an entry point calls it at exit).
"""

from __future__ import annotations

import os
from typing import Any

from kvferry.common.errors import ConfigurationError
from kvferry.common.trace_context import sampled, valid_traceparent

PROTOCOLS = ("grpc", "http/protobuf")
BATCH_DELAY_MS = 1000  # spans leave at least this often (the SDK's default is 5 s)
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


class TracingError(ConfigurationError, ValueError):
    """Tracing cannot be turned on as asked; the message names the fix."""


def protocol_of(protocol: str | None) -> str:
    """`protocol`, else OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else "grpc"; checked."""
    p = protocol or os.environ.get(PROTOCOL_ENV) or "grpc"
    if p not in PROTOCOLS:
        raise TracingError(f"OTLP protocol {p!r} is not one of {', '.join(PROTOCOLS)} (the protocol flag or key, "
                           f"or {PROTOCOL_ENV})")
    return p


def _id_generator() -> Any:
    """Trace and span ids from os.urandom. The SDK's default draws them from `random`, which vLLM
    seeds alike in every worker process (the model's seed): two workers, a prefiller's and a
    decoder's, would then make the same span ids in one trace."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class UrandomIds(IdGenerator):
        def generate_span_id(self) -> int:
            return _nonzero(8)

        def generate_trace_id(self) -> int:
            return _nonzero(16)
    return UrandomIds()


def _nonzero(nbytes: int) -> int:
    while True:
        v = int.from_bytes(os.urandom(nbytes), "big")
        if v:
            return v


def _exporter(endpoint: str, protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        # http:// (or no scheme): a plain connection, as vLLM's exporter makes; https:// uses TLS.
        return Grpc(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    return Http(endpoint=endpoint)


class Tracing:
    """A tracer with its own provider (never the global one: vLLM sets that in its processes)."""

    def __init__(self, endpoint: str, service: str, protocol: str | None = None, ratio: float = 1.0,
                 attributes: dict[str, str] | None = None) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise TracingError(f"trace sample ratio {ratio} is not between 0 and 1")
        proto = protocol_of(protocol)
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
            exporter = _exporter(endpoint, proto)
        except ImportError as e:
            raise TracingError(f"tracing needs OpenTelemetry ({e.name} is missing): pip install 'kvferry[tracing]', "
                               "or turn tracing off") from None
        resource = Resource.create({"service.name": service, **(attributes or {})})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(ratio)),
                                       id_generator=_id_generator())
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=BATCH_DELAY_MS))
        self.tracer = self.provider.get_tracer("kvferry")
        self.propagator = TraceContextTextMapPropagator()
        self.endpoint, self.protocol, self.service = endpoint, proto, service

    def remote_parent(self, traceparent: str | None) -> Any:
        """The context of a span in another process (its traceparent), or None: unusable or not sampled."""
        if traceparent is None or not valid_traceparent(traceparent) or not sampled(traceparent):
            return None
        return self.propagator.extract({"traceparent": traceparent})

    def shutdown(self) -> None:
        """Send the spans still batched, then stop the exporter (bounded by the SDK's timeouts)."""
        self.provider.shutdown()
