"""The PD path's spans, under the proxy's leg (the `traceparent` in the leg's kv_transfer_params),
recorded in the process that does the work (the worker of each TP rank) and sent from there.

Prefiller (PDProducer), each under the prefill leg:

- `kv.transfer`: the prompt's KV from the open (or the send, without an early grant) until the
  decoder was notified; `kvferry.kv.bytes` is the KV it sent, `kvferry.kv.tokens` its tokens;
- `kv.reserve` (its child): the alloc round trip for the decoder's pages;
- `kv.write` (its children): each NIXL WRITE, its bytes; the last one notifies.

Decoder (PDConsumer), each under the decode leg:

- `kv.arrival`: from the decoder's scheduler handing the request to the worker to the transfer's
  arrival (commit) at the receiver (`kvferry.kv.arrived_first`: it came before the request);
- `kv.load`: the copy from the pd_buffer into vLLM's paged cache, its bytes;
- `kv.recompute`: the KV could not be used; `kvferry.kv.reason` says why (timeout, ended,
  mismatch) and vLLM computes the prompt instead.

On when `otlp_traces_endpoint` (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, which vLLM's
`--otlp-traces-endpoint` sets) names a collector; then a transfer without a sampled traceparent
costs one check. OpenTelemetry is imported only then (common/otel.py).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import threading
import time
from typing import Any

from kvferry.common.config import KVFerryConfig
from kvferry.common.otel import ENDPOINT_ENV, Tracing

_made: dict[tuple[str, str], KVSpans] = {}
_lock = threading.Lock()


def wall_ns(mono: float) -> int:
    """A time.monotonic() instant as Unix time in ns (spans carry wall-clock times)."""
    return time.time_ns() - int((time.monotonic() - mono) * 1e9)


class KVSpans:
    """One process's KV spans (spans are made and ended from the engine's and the sender's threads)."""

    def __init__(self, tracing: Tracing) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        self.tracing, self._trace, self._kind = tracing, trace, SpanKind
        self._error = lambda msg: Status(StatusCode.ERROR, msg[:300])

    def _start(self, name: str, parent: Any, start_ns: int, attrs: dict[str, Any]) -> Any:
        return self.tracing.tracer.start_span(name, parent, self._kind.INTERNAL, attrs, start_time=start_ns)

    def _end(self, span: Any, end_ns: int | None = None, error: str | None = None) -> None:
        if error is not None:
            span.set_attribute("error.type", error.split(":", 1)[0][:64])
            span.set_status(self._error(error))
        span.end(end_time=end_ns)

    # ---- prefiller ----
    def transfer(self, traceparent: str | None, transfer_id: str, receiver: str, tokens: int, request_id: str
                 ) -> Any:
        """The transfer's span, started now (None: no sampled traceparent). `request_id`: vLLM's (it
        holds the proxy's X-Request-Id)."""
        parent = self.tracing.remote_parent(traceparent)
        if parent is None:
            return None
        return self._start("kv.transfer", parent, time.time_ns(), {
            "kvferry.transfer_id": transfer_id, "kvferry.kv.receiver": receiver, "kvferry.kv.tokens": tokens,
            "kvferry.vllm_request_id": request_id})

    def reserve(self, transfer: Any, grant: concurrent.futures.Future, pages: int) -> None:
        """`kv.reserve`, from now until `grant` is settled."""
        span = self._start("kv.reserve", self._trace.set_span_in_context(transfer), time.time_ns(),
                           {"kvferry.kv.pages": pages})
        grant.add_done_callback(lambda f: self._end(span, error=_failure(f)))

    def write(self, transfer: Any, fut: concurrent.futures.Future, chunks: int, nbytes: int, notify: bool) -> None:
        """`kv.write` of `chunks` chunks (`nbytes` of KV), from now until `fut` is settled."""
        span = self._start("kv.write", self._trace.set_span_in_context(transfer), time.time_ns(),
                           {"kvferry.kv.chunks": chunks, "kvferry.kv.bytes": nbytes, "kvferry.kv.notify": notify})
        fut.add_done_callback(lambda f: self._end(span, error=_failure(f)))

    def sent(self, transfer: Any, nbytes: int, early: bool, error: str | None = None) -> None:
        transfer.set_attribute("kvferry.kv.bytes", nbytes)
        transfer.set_attribute("kvferry.kv.reserved_early", early)
        self._end(transfer, error=error)

    # ---- decoder ----
    def loaded(self, traceparent: str | None, ids: dict[str, str], expected: int, arrived: int, started: int,
               nbytes: int, tokens: int) -> None:
        """`kv.arrival` (the request handed over -> the KV arrived) and `kv.load` (from `started` to now);
        `ids`: the transfer's and vLLM's request's."""
        parent = self.tracing.remote_parent(traceparent)
        if parent is None:
            return
        span = self._start("kv.arrival", parent, min(expected, arrived),
                           {**ids, "kvferry.kv.arrived_first": arrived <= expected})
        self._end(span, max(expected, arrived))
        span = self._start("kv.load", parent, started, {**ids, "kvferry.kv.bytes": nbytes, "kvferry.kv.tokens": tokens})
        self._end(span)

    def recompute(self, traceparent: str | None, ids: dict[str, str], expected: int, reason: str, why: str) -> None:
        """`kv.recompute`: the request waited from `expected` until now, then its KV was given up."""
        parent = self.tracing.remote_parent(traceparent)
        if parent is not None:
            span = self._start("kv.recompute", parent, expected, {**ids, "kvferry.kv.reason": reason})
            self._end(span, error=f"{reason}: {why}")


def _failure(f: concurrent.futures.Future) -> str | None:
    if f.cancelled():
        return "cancelled"
    e = f.exception()
    return None if e is None else f"{type(e).__name__}: {e}"


def kv_spans(cfg: KVFerryConfig, role: str, tp_rank: int) -> KVSpans | None:
    """This process's KV spans (one exporter per process, flushed at exit), or None when no
    collector is configured."""
    endpoint = cfg.otlp_traces_endpoint or os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    with _lock:
        key = (endpoint, role)
        if key not in _made:
            tracing = Tracing(endpoint, f"kvferry-{role}", cfg.otlp_traces_protocol,
                              attributes={"kvferry.tp_rank": str(tp_rank), "process.pid": str(os.getpid())})
            atexit.register(tracing.shutdown)
            _made[key] = KVSpans(tracing)
        return _made[key]
