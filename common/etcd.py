"""A small etcd v3 client over etcd's JSON gRPC gateway (``/v3/...``), with httpx.

kvferry's discovery (common/discovery.py) needs five calls: put, range (a prefix), delete, leases
(grant, keepalive, revoke) and a streaming watch. etcd (3.4 and later) answers them all as JSON
over HTTP, so the proxy needs no gRPC or protobuf. Keys and values are base64 on the wire; 64-bit
integers (revisions, lease ids, TTLs) are JSON strings. Every call is bounded by a timeout; a
failure is an :class:`EtcdError` naming the endpoint and the fix.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from kvferry.common.errors import UnavailableError

CALL_TIMEOUT_S = 3.0  # one unary call
MAX_WATCH_LINE = 8 << 20  # one watch response (a batch of events) larger than this is refused


class EtcdError(UnavailableError, RuntimeError):
    """etcd did not answer, or answered an error; the message names the endpoint."""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s or "")


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with `prefix`"."""
    p = bytearray(prefix)
    for i in range(len(p) - 1, -1, -1):
        if p[i] < 0xFF:
            p[i] += 1
            return bytes(p[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Event:
    kind: str  # "put" | "delete"
    kv: KV


def _kv(d: dict) -> KV:
    return KV(_unb64(d.get("key")), _unb64(d.get("value")), int(d.get("mod_revision") or 0), int(d.get("lease") or 0))


class Etcd:
    """One etcd endpoint (``http://host:port``); async; close() when done."""

    def __init__(self, endpoint: str, timeout: float = CALL_TIMEOUT_S) -> None:
        parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise EtcdError(f"etcd endpoint {endpoint!r} is not http://host:port")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        self.endpoint = f"{parts.scheme}://{host}:{parts.port}"
        self.timeout = timeout
        self._client = httpx.AsyncClient(base_url=self.endpoint, timeout=timeout)

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, path: str, body: dict, timeout: float | None = None) -> dict:
        try:
            r = await self._client.post(path, json=body, timeout=timeout or self.timeout)
        except httpx.HTTPError as e:
            raise EtcdError(f"etcd {self.endpoint}{path}: {type(e).__name__}: {e or 'no answer'} (is etcd running "
                            "there? check --discovery)") from None
        try:
            data = r.json()
        except ValueError:
            raise EtcdError(f"etcd {self.endpoint}{path}: answered {r.status_code} with no JSON: is this etcd's "
                            "client port (3.4 or later)?") from None
        if r.status_code != 200 or not isinstance(data, dict) or "error" in data:
            msg = data.get("message") or data.get("error") if isinstance(data, dict) else data
            raise EtcdError(f"etcd {self.endpoint}{path}: {r.status_code}: {msg}")
        return data

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        body: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        d = await self._call("/v3/kv/put", body)
        return int(d.get("header", {}).get("revision") or 0)

    async def get_prefix(self, prefix: bytes) -> tuple[list[KV], int]:
        """Every key under `prefix`, and the store's revision (watch from revision + 1)."""
        d = await self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(x) for x in d.get("kvs") or []], int(d.get("header", {}).get("revision") or 0)

    async def get(self, key: bytes) -> KV | None:
        d = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = d.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    async def delete(self, key: bytes) -> int:
        d = await self._call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(d.get("deleted") or 0)

    async def grant(self, ttl: int) -> int:
        d = await self._call("/v3/lease/grant", {"TTL": str(int(ttl))})
        return int(d["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew a lease once; its remaining TTL (0: it expired, and its keys are gone)."""
        d = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int((d.get("result") or {}).get("TTL") or 0)

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if "lease not found" not in str(e):
                raise

    async def watch(self, prefix: bytes, start_revision: int, idle_timeout: float) -> AsyncIterator[list[Event]]:
        """Batches of events under `prefix` from `start_revision` on, until the stream ends or
        nothing (not even etcd's progress notice) arrives for `idle_timeout` seconds: then
        EtcdError. etcd sends a progress notice every `progress_notify` interval (10 min by default),
        so callers re-list and re-watch on a timeout rather than treat it as an outage."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision), "progress_notify": True}}
        timeout = httpx.Timeout(self.timeout, read=idle_timeout)
        try:
            async with self._client.stream("POST", "/v3/watch", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    raise EtcdError(f"etcd {self.endpoint}/v3/watch: answered {r.status_code}")
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    if len(line) > MAX_WATCH_LINE:
                        raise EtcdError(f"etcd {self.endpoint}/v3/watch: a response of {len(line)} bytes")
                    try:
                        d = json.loads(line)
                    except ValueError:
                        raise EtcdError(f"etcd {self.endpoint}/v3/watch: not JSON: {line[:80]!r}") from None
                    if "error" in d:
                        raise EtcdError(f"etcd {self.endpoint}/v3/watch: {d.get('error')}")
                    res = d.get("result") or {}
                    if res.get("canceled") or res.get("compact_revision"):
                        raise EtcdError(f"etcd {self.endpoint}/v3/watch: cancelled "
                                        f"({res.get('cancel_reason') or 'compacted'})")
                    yield [Event("delete" if e.get("type") == "DELETE" else "put", _kv(e.get("kv") or {}))
                           for e in res.get("events") or []]
        except httpx.HTTPError as e:
            raise EtcdError(f"etcd {self.endpoint}/v3/watch: {type(e).__name__}: {e or 'no answer'}") from None
