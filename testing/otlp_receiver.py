"""A small OTLP trace receiver for tests: real servers on loopback that decode the real OTLP
protobuf (opentelemetry-proto's generated classes) and keep every span they are sent.

- gRPC (``grpc_endpoint``, ``http://127.0.0.1:PORT``): what vLLM's ``--otlp-traces-endpoint``
  exports by default, and kvferry's proxy and connector too (common/otel.py);
- http/protobuf (``http_endpoint``, ``http://127.0.0.1:PORT/v1/traces``), gzip or not.

    with OTLPReceiver() as rx:
        ... run processes with --otlp-traces-endpoint rx.grpc_endpoint ...
        spans = rx.trace("4bf92f3577b34da6a3ce929d0e0e4736")

``python -m kvferry.testing.otlp_receiver --out spans.json`` runs one until SIGINT/SIGTERM and
writes every span it got as JSON (benchmarks/trace_picture.py draws them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import threading
from concurrent import futures
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

MAX_BODY = 32 << 20  # one export request at most (the SDK batches 512 spans)


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver got it; ids as lowercase hex ("" for no parent)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int  # OTLP's SpanKind: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    service: str  # its resource's service.name
    resource: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        service = str(resource.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, int(s.kind),
                                s.start_time_unix_nano, s.end_time_unix_nano,
                                {a.key: _value(a.value) for a in s.attributes}, service, resource,
                                int(s.status.code)))
    return out


class _Grpc(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, rx: OTLPReceiver) -> None:
        self.rx = rx

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the generated service's name
        self.rx.add(decode(request))
        return trace_service_pb2.ExportTraceServiceResponse()


def _http_handler(rx: OTLPReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            n = int(self.headers.get("Content-Length") or 0)
            if self.path != "/v1/traces" or not 0 <= n <= MAX_BODY:
                self.send_error(404 if self.path != "/v1/traces" else 413)
                return
            raw = self.rfile.read(n)
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            req = trace_service_pb2.ExportTraceServiceRequest()
            req.ParseFromString(raw)
            rx.add(decode(req))
            body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass
    return Handler


class OTLPReceiver:
    """Both servers, started on enter (or start()) and stopped on exit (or stop())."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._grpc: Any = None
        self._http: ThreadingHTTPServer | None = None
        self.grpc_port = self.http_port = 0

    def start(self) -> OTLPReceiver:
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Grpc(self), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"{self.host}:0")
        self._grpc.start()
        self._http = ThreadingHTTPServer((self.host, 0), _http_handler(self))
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()
        return self

    @property
    def grpc_endpoint(self) -> str:
        return f"http://{self.host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://{self.host}:{self.http_port}/v1/traces"

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans += spans

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans of one trace, in start order."""
        return sorted((s for s in self.spans() if s.trace_id == trace_id), key=lambda s: s.start_ns)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=1).wait(5)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def dump(spans: list[ReceivedSpan], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(s) for s in spans], f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description="an OTLP trace receiver for tests (gRPC and http/protobuf)")
    ap.add_argument("--out", required=True, help="write every span received here (JSON) when stopped")
    args = ap.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with OTLPReceiver() as rx:
        print(f"OTLP gRPC on {rx.grpc_endpoint}, http/protobuf on {rx.http_endpoint}", flush=True)
        stop.wait()
        dump(rx.spans(), args.out)


if __name__ == "__main__":
    main()
