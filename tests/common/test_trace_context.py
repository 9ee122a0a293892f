"""What crosses a process boundary for traces, checked: a traceparent (W3C version 00) in
kv_transfer_params, an X-Request-Id from a client; and the request id on kvferry's log lines."""

from __future__ import annotations

import contextvars
import logging

import pytest

from kvferry.common import log as kvlog
from kvferry.common.trace_context import new_request_id, request_id, sampled, valid_traceparent
from kvferry.common.wire.transfer_params import (
    ParamsError,
    decode_leg_params,
    decode_params,
    prefill_params,
    with_traceparent,
)

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("value,ok", [
    (TP, True),
    (TP[:-2] + "00", True),
    (TP.upper(), False),  # lowercase hex only
    ("01" + TP[2:], False),  # another version
    (TP + "-extra", False),
    ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", False),  # all-zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", False),
    ("", False), (None, False), (55, False),
])
def test_traceparent_is_checked(value: object, ok: bool) -> None:
    assert valid_traceparent(value) is ok


def test_sampled_flag() -> None:
    assert sampled(TP) and not sampled(TP[:-2] + "00") and not sampled(TP[:-2] + "02")


def test_traceparent_in_kv_transfer_params_is_optional_and_checked() -> None:
    plain = decode_leg_params("kvf-1")
    assert "traceparent" not in plain and decode_params(plain).traceparent is None
    traced = with_traceparent(plain, TP)
    assert decode_params(traced).traceparent == TP and "traceparent" not in plain
    with pytest.raises(ParamsError, match="traceparent"):
        with_traceparent(plain, "00-nope")
    for bad in ("00-nope", TP.upper(), TP + "0", 7):
        with pytest.raises(ParamsError, match="kv_transfer_params.traceparent"):
            decode_params(dict(plain, traceparent=bad))
    spec = {"disagg_spec": {"receiver_host": "d", "receiver_init_port": 1, "receiver_alloc_port": 2},
            "transfer_id": "kvf-2", "kvferry_version": 1}
    assert prefill_params(dict(spec, traceparent=TP)).traceparent == TP
    with pytest.raises(ParamsError, match="kv_transfer_params.traceparent"):
        prefill_params(dict(spec, traceparent="x" * 55))


@pytest.mark.parametrize("raw,kept", [
    ("abc-123", True), ("job-7:step/2", True), ("a+b=c@d.e_f", True), ("x" * 128, True),
    ("x" * 129, False), ("", False), ("with space", False), ("new\r\nline", False), ("é", False), (None, False),
])
def test_request_id_is_kept_only_when_bounded_and_plain(raw: str | None, kept: bool) -> None:
    got = request_id(raw)
    assert (got == raw) is kept
    if not kept:
        assert len(got) == 32 and int(got, 16) >= 0
    assert new_request_id() != new_request_id()


def test_log_lines_end_with_the_request_id_of_their_request() -> None:
    handler = logging.Handler()
    records: list[str] = []
    handler.emit = lambda r: records.append(logging.Formatter(kvlog._FORMAT).format(r))  # type: ignore[method-assign]
    handler.addFilter(kvlog.RequestIdFilter())
    logger = kvlog.get_logger("kvferry.test_trace_context")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("outside")

        def inside() -> None:
            kvlog.REQUEST_ID.set("req-9")
            logger.info("inside")
        contextvars.copy_context().run(inside)
        logger.info("after")
    finally:
        logger.removeHandler(handler)
    assert [r.rsplit(")", 1)[1] for r in records] == ["", " [request req-9]", ""]


def test_otel_span_ids_do_not_follow_a_seeded_random() -> None:
    """vLLM gives `random` the same seed in every worker: the span ids of two workers' spans must still differ."""
    import random

    from kvferry.common.otel import Tracing

    ids = []
    for _ in range(2):
        random.seed(0)
        t = Tracing("http://127.0.0.1:9", "kvferry-test")  # nothing is exported: no span ends
        ctx = t.tracer.start_span("a").get_span_context()
        ids.append((ctx.trace_id, ctx.span_id))
        t.shutdown()
    assert ids[0][0] != ids[1][0] and ids[0][1] != ids[1][1]
