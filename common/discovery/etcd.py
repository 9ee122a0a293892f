"""A small etcd v3 client over etcd's JSON gRPC gateway (``/v3/...``), on the library's one HTTP
client (common/http/client.py).

kvferry's discovery (common/discovery/sources.py) needs put, range (a prefix, in pages), delete, a
compare-and-put transaction, leases (grant, keepalive, revoke) and a streaming watch. etcd (3.4
and later) answers them all as JSON over HTTP, so the proxy needs no gRPC or protobuf. Keys and
values are base64 on the wire; 64-bit integers (revisions, lease ids, TTLs) are JSON strings.

etcd's own security works through it: TLS with a client certificate (an ``ssl.SSLContext``) and
user/password auth (``/v3/auth/authenticate`` returns a token sent in the ``Authorization`` header
of every call; a token etcd no longer knows is fetched again once). Every call is bounded by a
timeout (to connect, and between two reads) and every answer by a size; a failure is an
:class:`EtcdError` naming the endpoint and the fix (:class:`EtcdAccessError` when it is
credentials, certificates or permissions; :class:`WatchIdle` when a watch was only quiet).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvferry.common.errors import UnavailableError
from kvferry.common.http.client import Broken, ClientResponse, ClosedEarly, Pool, Timeout, TooLarge, Unreachable

CALL_TIMEOUT_S = 3.0  # one unary call
MAX_ANSWER_BYTES = 1 << 20  # one unary answer (a range page has its own bound)
MAX_PAGE_BYTES = 16 << 20  # one range page; a larger one is asked again with fewer keys
PAGE_KEYS = 256  # keys per range page to start with
CONNECTIONS = 4  # unary calls to one endpoint at once (more wait, within the call timeout, for a free one)
MAX_WATCH_LINE = 8 << 20  # one watch response (a batch of events) larger than this is refused
AUTH_HINT = "add ?user=NAME&password_file=FILE to --discovery (a file, mode 600, holding the password)"
TLS_HINT = "with etcds://, set ?cacert= (the CA that signed etcd's certificate) and ?cert= and ?key= (a client " \
           "certificate etcd's --trusted-ca-file signed)"


class EtcdError(UnavailableError, RuntimeError):
    """etcd did not answer, or answered an error; the message names the endpoint."""


class EtcdAccessError(EtcdError):
    """etcd refused these credentials, this certificate or this user's permissions: a setting to
    fix, not an outage."""


class WatchIdle(EtcdError):
    """Nothing came on a watch, not even etcd's progress notice, for its `idle_timeout`: re-list
    and watch again; not an outage."""


class _TooLarge(EtcdError):
    """An answer larger than the caller's bound."""


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
    create_revision: int = 0  # the revision that created the key; a key deleted and put again has a new one


@dataclass(frozen=True)
class Event:
    kind: str  # "put" | "delete"
    kv: KV


def _kv(d: dict) -> KV:
    return KV(_unb64(d.get("key")), _unb64(d.get("value")), int(d.get("mod_revision") or 0), int(d.get("lease") or 0),
              int(d.get("create_revision") or 0))


def _error(data: object) -> str:
    if isinstance(data, dict):
        return str(data.get("message") or data.get("error") or data)
    return str(data)[:200]


class Etcd:
    """One etcd endpoint (``http://host:port`` or ``https://``); async; close() when done."""

    def __init__(self, endpoint: str, timeout: float = CALL_TIMEOUT_S, *, tls: ssl.SSLContext | None = None,
                 client_cert: bool = False, user: str = "", password: str = "") -> None:
        parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise EtcdError(f"etcd endpoint {endpoint!r} is not http://host:port")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        self.endpoint = f"{parts.scheme}://{host}:{parts.port}"
        self.timeout = timeout
        self.user, self._password = user, password
        self._token = ""
        self._auth_lock = asyncio.Lock()
        self._client_cert = client_cert
        self._tls = tls  # None: https:// is verified against the system's CAs
        # Made on the first call: a Pool belongs to the running loop, and an Etcd may be built
        # before one runs. All calls of one Etcd go on that loop.
        self._pool: Pool | None = None

    def _headers(self) -> dict[str, str]:
        # etcd 3.4's gateway reads JSON without a Content-Type; it is sent as any JSON client does.
        h = {"Content-Type": "application/json"}
        if self._token:
            h["Authorization"] = self._token
        return h

    def _calls(self) -> Pool:
        if self._pool is None:
            t = self.timeout
            self._pool = Pool(CONNECTIONS, t, t, t, self._headers(), tls=self._tls)
        return self._pool

    def _set_token(self, token: str) -> None:
        self._token = token
        if self._pool is not None:
            self._pool.set_headers(self._headers())

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    def _unreachable(self, path: str, e: Exception) -> EtcdError:
        text = f"{type(e).__name__}: {e or 'no answer'}"
        if self.endpoint.startswith("https") and ("SSL" in text or "certificate" in text.lower()):
            return EtcdAccessError(f"etcd {self.endpoint}{path}: TLS: {text} ({TLS_HINT})")
        if self.endpoint.startswith("https") and not self._client_cert and isinstance(e, ClosedEarly):
            # TLS 1.3: an etcd with --client-cert-auth closes the connection after the handshake
            return EtcdAccessError(f"etcd {self.endpoint}{path}: TLS: the connection was closed before an answer, as "
                                   "an etcd with --client-cert-auth does to a client without a certificate (or etcd "
                                   f"stopped): {TLS_HINT}")
        return EtcdError(f"etcd {self.endpoint}{path}: {text} (is etcd running there? check --discovery)")

    def _refused(self, path: str, status: int, data: object) -> EtcdError:
        msg = _error(data)
        who = f"user {self.user!r}" if self.user else "no user"
        if "user name is empty" in msg or ("invalid auth token" in msg and not self.user):
            return EtcdAccessError(f"etcd {self.endpoint}{path}: etcd has auth enabled and kvferry gave no user: "
                                   f"{AUTH_HINT}")
        if "authentication failed" in msg:
            return EtcdAccessError(f"etcd {self.endpoint}: {who}: {msg}: check the password ({AUTH_HINT})")
        if "authentication is not enabled" in msg:
            return EtcdAccessError(f"etcd {self.endpoint}: a user is given but etcd's auth is off: enable it "
                                   "(docs/deploy.md \"etcd's own security\") or drop the user")
        if "permission denied" in msg:
            return EtcdAccessError(f"etcd {self.endpoint}{path}: {who}: permission denied: grant its role readwrite "
                                   "on the discovery prefix (docs/deploy.md \"etcd's own security\")")
        return EtcdError(f"etcd {self.endpoint}{path}: {status}: {msg}")

    async def _once(self, path: str, body: dict, max_bytes: int) -> tuple[int, object]:
        try:
            r = await self._calls().request("POST", self.endpoint, path, json.dumps(body).encode())
            try:
                raw = await r.read(max_bytes)
            finally:
                r.release()
        except TooLarge:
            raise _TooLarge(f"etcd {self.endpoint}{path}: an answer of more than {max_bytes} bytes") from None
        except (Unreachable, Broken, Timeout) as e:
            raise self._unreachable(path, e) from None
        try:
            return r.status, json.loads(raw)
        except ValueError:
            raise EtcdError(f"etcd {self.endpoint}{path}: answered {r.status} with no JSON: is this etcd's "
                            "client port (3.4 or later)?") from None

    async def _authenticate(self, stale: str) -> None:
        """A token for `user` (once, however many calls found `stale` no longer valid)."""
        async with self._auth_lock:
            if self._token != stale:
                return
            self._set_token("")
            status, data = await self._once("/v3/auth/authenticate", {"name": self.user, "password": self._password},
                                            MAX_ANSWER_BYTES)
            if status != 200 or not isinstance(data, dict) or not data.get("token"):
                raise self._refused("/v3/auth/authenticate", status, data)
            self._set_token(str(data["token"]))

    async def _call(self, path: str, body: dict, max_bytes: int = MAX_ANSWER_BYTES) -> dict:
        for attempt in range(2):
            if self.user and not self._token:
                await self._authenticate("")
            token = self._token
            status, data = await self._once(path, body, max_bytes)
            if status == 401 and self.user and attempt == 0 and "invalid auth token" in _error(data):
                await self._authenticate(token)  # it expired (etcd's --auth-token-ttl): once more with a new one
                continue
            if status != 200 or not isinstance(data, dict) or "error" in data:
                raise self._refused(path, status, data)
            return data
        raise AssertionError("unreachable")

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        body: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        d = await self._call("/v3/kv/put", body)
        return int(d.get("header", {}).get("revision") or 0)

    async def put_if(self, key: bytes, value: bytes, lease: int, create_revision: int) -> tuple[bool, int]:
        """Put only while the key's create revision is this one (0: the key is absent); (succeeded,
        the store's revision after it: the put's revision when it succeeded)."""
        put: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        compare = {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(create_revision)}
        d = await self._call("/v3/kv/txn", {"compare": [compare], "success": [{"request_put": put}]})
        return bool(d.get("succeeded")), int(d.get("header", {}).get("revision") or 0)

    async def pages(self, prefix: bytes, max_keys: int) -> AsyncIterator[tuple[list[KV], int]]:
        """Every key under `prefix` (at most `max_keys`), a page at a time, all at one revision
        (yielded with each page: watch from revision + 1). A page is bounded in bytes: one too
        large is asked again with fewer keys."""
        start, end, revision, limit, seen = prefix, prefix_end(prefix), 0, PAGE_KEYS, 0
        while True:
            body = {"key": _b64(start), "range_end": _b64(end), "limit": str(min(limit, max_keys - seen))}
            if revision:
                body["revision"] = str(revision)
            try:
                d = await self._call("/v3/kv/range", body, max_bytes=MAX_PAGE_BYTES)
            except _TooLarge:
                if limit == 1:
                    raise EtcdError(f"etcd {self.endpoint}: one key under {prefix!r} is larger than "
                                    f"{MAX_PAGE_BYTES} bytes") from None
                limit = max(1, limit // 4)
                continue
            revision = revision or int(d.get("header", {}).get("revision") or 0)
            kvs = [_kv(x) for x in d.get("kvs") or []]
            seen += len(kvs)
            yield kvs, revision
            if not d.get("more") or not kvs or seen >= max_keys:
                return
            start = kvs[-1].key + b"\0"

    async def get_prefix(self, prefix: bytes, max_keys: int = 1 << 20) -> tuple[list[KV], int]:
        """Every key under `prefix` (at most `max_keys`), and the store's revision."""
        out: list[KV] = []
        revision = 0
        async for kvs, rev in self.pages(prefix, max_keys):
            out.extend(kvs)
            revision = rev
        return out, revision

    async def get(self, key: bytes) -> KV | None:
        d = await self._call("/v3/kv/range", {"key": _b64(key)}, max_bytes=MAX_PAGE_BYTES)
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

    async def _lines(self, r: ClientResponse, path: str) -> AsyncIterator[bytes]:
        """The stream's lines, each bounded by MAX_WATCH_LINE while it is read (a whole line that
        came in one read too)."""
        buf = bytearray()
        async for chunk in r.pieces():
            buf += chunk
            while (nl := buf.find(b"\n")) >= 0 and nl <= MAX_WATCH_LINE:
                line, buf = bytes(buf[:nl]), buf[nl + 1:]
                yield line
            if len(buf) > MAX_WATCH_LINE:
                raise EtcdError(f"etcd {self.endpoint}{path}: a response of more than {MAX_WATCH_LINE} bytes")
        if buf.strip():
            yield bytes(buf)

    async def watch(self, prefix: bytes, start_revision: int, idle_timeout: float) -> AsyncIterator[list[Event]]:
        """Batches of events under `prefix` from `start_revision` on, until the stream ends or
        nothing (not even etcd's progress notice) arrives for `idle_timeout` seconds: then
        WatchIdle (an EtcdError). etcd sends a progress notice every `progress_notify` interval
        (10 min by default), so callers re-list and re-watch on WatchIdle rather than treat it as
        an outage. The first batch is empty: etcd's notice that the watch was created, after which
        every change is seen."""
        path = "/v3/watch"
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision), "progress_notify": True}}
        if self.user and not self._token:
            await self._authenticate("")
        # A pool of its own: the watch holds its connection for as long as it lasts, and its
        # bound between two reads (the head's wait included) is `idle_timeout`, the stream bound
        # of a pool (stall_timeout); connecting is bounded by the call timeout.
        t = self.timeout
        pool = Pool(1, t, t, t, self._headers(), idle_timeout, tls=self._tls)
        try:
            r = await pool.request("POST", self.endpoint, path, json.dumps(body).encode(), stream=True)
            try:
                if r.status != 200:
                    if r.status == 401 and self.user:
                        await self._authenticate(self._token)  # the next watch has a fresh token
                    head = b""
                    async for chunk in r.pieces():
                        head += chunk
                        if len(head) >= 4096:
                            break
                    raise self._refused(path, r.status, head[:300].decode("utf-8", "replace"))
                async for line in self._lines(r, path):
                    if not line.strip():
                        continue
                    try:
                        d = json.loads(line)
                    except ValueError:
                        raise EtcdError(f"etcd {self.endpoint}{path}: not JSON: {line[:80]!r}") from None
                    if "error" in d:
                        raise EtcdError(f"etcd {self.endpoint}{path}: {_error(d.get('error'))}")
                    res = d.get("result") or {}
                    if res.get("canceled") or res.get("compact_revision"):
                        raise EtcdError(f"etcd {self.endpoint}{path}: cancelled "
                                        f"({res.get('cancel_reason') or 'compacted'})")
                    yield [Event("delete" if e.get("type") == "DELETE" else "put", _kv(e.get("kv") or {}))
                           for e in res.get("events") or []]
            finally:
                r.release()
        except Timeout as e:
            if e.what != "stall":
                raise self._unreachable(path, e) from None
            raise WatchIdle(f"etcd {self.endpoint}{path}: nothing received for {idle_timeout:g}s (not even etcd's "
                            "progress notice)") from None
        except (Unreachable, Broken) as e:
            raise self._unreachable(path, e) from None
        finally:
            await pool.close()
