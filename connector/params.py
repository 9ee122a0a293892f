"""The `kv_transfer_params` a request carries (DESIGN.md "One request, end to end").

Prefill leg: ``{"transfer_id": T, "ret_first_tok": true, "disagg_spec": {"receiver_host": H,
"receiver_init_port": [..], "receiver_alloc_port": [..]}}`` (LMCache's proxy puts the id in
``disagg_spec.req_id``; both are accepted). Decode leg: ``{"transfer_id": T}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.common.errors import BadDataError


class ParamsError(BadDataError, ValueError):
    """kv_transfer_params that cannot be acted on; the message names the field."""


@dataclass(frozen=True)
class PrefillSpec:
    transfer_id: str
    host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]
    ret_first_tok: bool


def _ports(spec: dict, key: str) -> tuple[int, ...]:
    v = spec.get(key)
    vals = v if isinstance(v, list) else [v]
    if not vals or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in vals):
        raise ParamsError(f"kv_transfer_params.disagg_spec.{key} must be a port or a list of ports, got {v!r}")
    return tuple(vals)


def _transfer_id(params: dict, spec: dict | None = None) -> str | None:
    tid = params.get("transfer_id")
    if tid is None and spec is not None:
        tid = spec.get("req_id")
    if tid is None:
        return None
    if not isinstance(tid, str) or not 0 < len(tid) <= 256:
        raise ParamsError(f"kv_transfer_params.transfer_id must be a non-empty string of at most 256 "
                          f"characters, got {tid!r}")
    return tid


def prefill_spec(params: Any) -> PrefillSpec | None:
    """The prefill leg's instructions, None when the request is not a disaggregated one."""
    if not isinstance(params, dict) or params.get("disagg_spec") is None:
        return None
    spec = params["disagg_spec"]
    if not isinstance(spec, dict):
        raise ParamsError(f"kv_transfer_params.disagg_spec must be an object, got {type(spec).__name__}")
    tid = _transfer_id(params, spec)
    if tid is None:
        raise ParamsError("kv_transfer_params has a disagg_spec but no transfer_id")
    host = spec.get("receiver_host")
    if not isinstance(host, str) or not host:
        raise ParamsError(f"kv_transfer_params.disagg_spec.receiver_host must be a host name, got {host!r}")
    init, alloc = _ports(spec, "receiver_init_port"), _ports(spec, "receiver_alloc_port")
    if len(init) != len(alloc):
        raise ParamsError("kv_transfer_params.disagg_spec: receiver_init_port and receiver_alloc_port need "
                          "one port each per decoder TP rank")
    return PrefillSpec(tid, host, init, alloc, bool(params.get("ret_first_tok", False)))


def decode_transfer_id(params: Any) -> str | None:
    """The transfer a decode-leg request loads its prompt's KV from, if any."""
    if not isinstance(params, dict) or params.get("disagg_spec") is not None:
        return None
    return _transfer_id(params)
