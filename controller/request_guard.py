"""What every HTTP request passes before the API sees it, all judged from its head before any of
its body is read: the admin key, the body's size and type, and the browser rules.

With an admin key, everything but /health needs it (Bearer, or Basic with the key as the password,
which is what a browser sends for the page and /docs). Bodies are bounded, and every POST body is
read as JSON whatever its Content-Type says (`curl -d` sends a form type), as LMCache's users expect.
Because of that, and for bodiless requests alike, common/http/guard.py's rules hold: a request
that changes state and that a browser marks as sent by another origin is refused, and without an
admin key so is one whose Host is not a name the controller answers to (DNS rebinding); otherwise
any web page could make a browser on the controller's host clear or move KV. /health is exempt
from the Host rule (probes call it by any address; it changes nothing and shows no key).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.exceptions import HTTPException

from kvferry.common import secret as csecret
from kvferry.common.http import guard as http_guard

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REALM = "kvferry-controller"
MAX_BODY = 64 << 20
OPEN_PATHS = frozenset({"/health"})
UNAUTHORIZED = ("this kvferry-controller needs its admin key: send 'Authorization: Bearer <key>' (or HTTP Basic "
                "auth with the key as the password); the key is its --admin-key / KVFERRY_ADMIN_KEY")


class Guard:
    """ASGI middleware around the API; `counters["unauthorized_http"]` counts refusals."""

    def __init__(self, app: ASGIApp, admin_key: str | None, counters: dict[str, int],
                 hosts: http_guard.Hosts) -> None:
        """`hosts`: the names the controller answers to without an admin key (--host, --allowed-host)."""
        self.app, self.admin_key, self.counters, self.hosts = app, admin_key, counters, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        # A refused request's body is never read: its connection closes with the answer.
        close = [(b"connection", b"close")] if length.strip(b"0") or b"transfer-encoding" in headers else []
        # Decoded as aiohttp did, so a key with non-ASCII characters still matches.
        if self.admin_key is not None and scope["path"] not in OPEN_PATHS and not csecret.authorized(
                headers.get(b"authorization", b"").decode("utf-8", "surrogateescape"), self.admin_key):
            self.counters["unauthorized_http"] += 1
            await reply(send, 401, {"error": UNAUTHORIZED},
                        [(b"www-authenticate", f'Basic realm="{REALM}"'.encode()), *close])
            return
        if length.isdigit() and int(length) > MAX_BODY:
            await reply(send, 413, {"error": f"the body is over {MAX_BODY >> 20} MiB"}, close)
            return
        why = None if scope["path"] in OPEN_PATHS else http_guard.refusal(
            scope["method"], _header(headers, b"host"), _header(headers, b"origin"),
            _header(headers, b"sec-fetch-site"), None if self.admin_key is not None else self.hosts)
        if why is not None:
            self.counters["unauthorized_http"] += 1
            await reply(send, 403, {"error": why}, close)
            return
        if scope["method"] == "POST":
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        await self.app(scope, _bounded(receive), send)


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    v = headers.get(name)
    return None if v is None else v.decode("latin-1")


def _bounded(receive: Receive) -> Receive:
    """`receive` that refuses a streamed (chunked) body past MAX_BODY."""
    seen = 0

    async def inner() -> Message:
        nonlocal seen
        msg = await receive()
        seen += len(msg.get("body", b""))
        if seen > MAX_BODY:
            # An HTTPException passes FastAPI's body reading as it is (any other error becomes a 400).
            raise HTTPException(413, f"the body is over {MAX_BODY >> 20} MiB")
        return msg

    return inner


async def reply(send: Send, status: int, body: dict[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})
