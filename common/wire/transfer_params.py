"""`kv_transfer_params`: the proxy-to-connector contract, as versioned msgspec Structs.

The proxy writes them (:func:`prefill_leg_params`, :func:`decode_leg_params`), the connector reads
them (:func:`prefill_params`, :func:`decode_params`), a prefiller answers with
:class:`PrefillAnswer`. vLLM hands the connector this JSON object as it came in the request
body, so every field is checked on the way in and a bad one is a :class:`ParamsError` naming it.

LMCache's proxy sends the same shape without a version (the transfer id in
``disagg_spec.req_id``): that is read as version 1. A kvferry proxy and connector of different
versions fail the request with an error naming both versions, never a silent recompute.

An optional field leaves the version as it is: a connector that does not know it ignores it
(msgspec drops unknown fields), and one that knows it checks it. ``traceparent`` is such a field:
the W3C trace context of the proxy's leg, so the connector's KV spans join the request's trace
(:func:`with_traceparent`; docs/observability.md "Traces").
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvferry.common.errors import BadDataError
from kvferry.common.trace_context import TRACEPARENT_LEN, TRACEPARENT_PATTERN, valid_traceparent
from kvferry.common.wire.messages import Id, NonNeg, Port

# 1: transfer_id, ret_first_tok, disagg_spec (LMCache's names); answer transfer_id, num_tokens, first_tok.
# Optional since: traceparent (both legs).
VERSION = 1

Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
Traceparent = Annotated[str, msgspec.Meta(min_length=TRACEPARENT_LEN, max_length=TRACEPARENT_LEN,
                                          pattern=TRACEPARENT_PATTERN)]
Ports = Annotated[list[Port], msgspec.Meta(min_length=1, max_length=64)]


class ParamsError(BadDataError, ValueError):
    """kv_transfer_params that cannot be acted on; the message names the field."""


class DisaggSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a prefiller writes the prompt's KV: the decoder's receiver, one port per TP rank."""

    receiver_host: Host
    receiver_init_port: Ports | Port
    receiver_alloc_port: Ports | Port
    req_id: Id | None = None  # LMCache's proxy puts the transfer id here

    @property
    def init_ports(self) -> tuple[int, ...]:
        return _ports(self.receiver_init_port)

    @property
    def alloc_ports(self) -> tuple[int, ...]:
        return _ports(self.receiver_alloc_port)


class PrefillParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The prefill leg's: compute the prompt, write its KV to `disagg_spec`, return the first token."""

    disagg_spec: DisaggSpec
    transfer_id: Id | None = None
    ret_first_tok: bool = False
    kvferry_version: int | None = None  # None: LMCache's proxy, read as version 1
    traceparent: Traceparent | None = None  # the prefill leg's span: the connector's KV spans go under it

    @property
    def tid(self) -> str:
        return self.transfer_id or self.disagg_spec.req_id or ""

    @property
    def host(self) -> str:
        return self.disagg_spec.receiver_host

    @property
    def init_ports(self) -> tuple[int, ...]:
        return self.disagg_spec.init_ports

    @property
    def alloc_ports(self) -> tuple[int, ...]:
        return self.disagg_spec.alloc_ports


class DecodeParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The decode leg's: load the prompt's KV of this transfer instead of computing it."""

    transfer_id: Id
    kvferry_version: int | None = None
    traceparent: Traceparent | None = None  # the decode leg's span


class PrefillAnswer(msgspec.Struct, frozen=True, omit_defaults=True):
    """A prefiller's `kv_transfer_params` in its answer: the transfer it wrote, or why it wrote none."""

    transfer_id: Id | None = None
    num_tokens: NonNeg = 0
    first_tok: NonNeg | None = None
    error: Annotated[str, msgspec.Meta(max_length=4096)] | None = None
    kvferry_version: int | None = None


def _ports(v: list[int] | int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, list) else (v,)


def _convert(params: dict, cls: type) -> Any:
    try:
        out: Any = msgspec.convert(params, cls, strict=True)
    except msgspec.ValidationError as e:
        raise ParamsError(f"kv_transfer_params: {str(e).replace('$', 'kv_transfer_params')}") from None
    check_version(out.kvferry_version, "kv_transfer_params")
    return out


def check_version(version: int | None, what: str) -> None:
    """A ParamsError unless `version` (None: LMCache's, version 1) is this kvferry's."""
    if (version or 1) != VERSION:
        raise ParamsError(f"{what} of version {version}; this kvferry speaks version {VERSION}: run the same "
                          "kvferry release on the proxy and the engines")


def prefill_params(params: Any) -> PrefillParams | None:
    """The prefill leg's instructions, None when the request is not a disaggregated one."""
    if not isinstance(params, dict) or params.get("disagg_spec") is None:
        return None
    p = _convert(params, PrefillParams)
    if not p.tid:
        raise ParamsError("kv_transfer_params has a disagg_spec but no transfer_id")
    if len(p.disagg_spec.init_ports) != len(p.disagg_spec.alloc_ports):
        raise ParamsError("kv_transfer_params.disagg_spec: receiver_init_port and receiver_alloc_port need "
                          "one port each per decoder TP rank")
    return p


def decode_params(params: Any) -> DecodeParams | None:
    """The transfer a decode-leg request loads its prompt's KV from; None for any other request."""
    if not isinstance(params, dict) or params.get("disagg_spec") is not None or "transfer_id" not in params:
        return None
    return _convert(params, DecodeParams)


def prefill_answer(params: Any) -> PrefillAnswer | None:
    """A prefiller's answer, None when it sent none (an engine without kvferry's connector)."""
    if not isinstance(params, dict):
        return None
    return _convert(params, PrefillAnswer)


def to_dict(p: msgspec.Struct) -> dict[str, Any]:
    """The JSON object to put in a request body."""
    return msgspec.to_builtins(p)


def prefill_leg_params(tid: str, spec: DisaggSpec) -> dict[str, Any]:
    return to_dict(PrefillParams(disagg_spec=spec, transfer_id=tid, ret_first_tok=True, kvferry_version=VERSION))


def decode_leg_params(tid: str) -> dict[str, Any]:
    return to_dict(DecodeParams(transfer_id=tid, kvferry_version=VERSION))


def with_traceparent(params: dict[str, Any], traceparent: str) -> dict[str, Any]:
    """A leg's `kv_transfer_params` carrying `traceparent` (a copy; ParamsError if it is not one)."""
    if not valid_traceparent(traceparent):
        raise ParamsError(f"traceparent {traceparent[:64]!r} is not a W3C version-00 traceparent")
    return dict(params, traceparent=traceparent)


def answer(tid: str, num_tokens: int, first_tok: int | None) -> dict[str, Any]:
    return to_dict(PrefillAnswer(transfer_id=tid, num_tokens=num_tokens, first_tok=first_tok,
                                 kvferry_version=VERSION))


def error_answer(message: str) -> dict[str, Any]:
    return to_dict(PrefillAnswer(error=message[:4096], kvferry_version=VERSION))
