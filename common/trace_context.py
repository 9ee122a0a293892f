"""The request's identity as it crosses processes: W3C trace context (`traceparent`) and the
`X-Request-Id` header, checked (both come from clients or other processes).

Standard library only: the proxy reads an X-Request-Id on every request, traced or not, and the
connector checks a `traceparent` in `kv_transfer_params` without importing OpenTelemetry."""

from __future__ import annotations

import os
import re

# W3C Trace Context level 1, version 00: version-trace_id-parent_id-flags, lowercase hex.
TRACEPARENT_PATTERN = r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
TRACEPARENT_LEN = 55
_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16

# X-Request-Id: what a client may name its request (bounded; characters safe in a header, a log
# line and a vLLM request id). Anything else is replaced by a fresh id, never echoed.
REQUEST_ID_MAX = 128
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{REQUEST_ID_MAX}}}")


def valid_traceparent(value: object) -> bool:
    """A well-formed version-00 traceparent whose trace and parent ids are not all zeros."""
    return (isinstance(value, str) and _TRACEPARENT.match(value) is not None
            and value[3:35] != _ZERO_TRACE and value[36:52] != _ZERO_SPAN)


def sampled(traceparent: str) -> bool:
    """The traceparent's sampled flag (a caller checked it with valid_traceparent)."""
    return bool(int(traceparent[53:55], 16) & 1)


def new_request_id() -> str:
    """A fresh request id: 32 hex digits (as random as a uuid4)."""
    return os.urandom(16).hex()


def request_id(raw: str | None) -> str:
    """The client's X-Request-Id when it is 1-128 of [A-Za-z0-9._:/+=@-], else a fresh one."""
    if raw is not None and _REQUEST_ID.fullmatch(raw) is not None:
        return raw
    return new_request_id()
