"""What every HTTP request passes before the API sees it: the admin key, and the body's size and type.

With an admin key, everything but /health needs it (Bearer, or Basic with the key as the password,
which is what a browser sends for the page and /docs). Bodies are bounded, and every POST body is
read as JSON whatever its Content-Type says (`curl -d` sends a form type), as LMCache's users expect.
Because of that, a POST that a browser marks as coming from another site (its Origin is not this
server) is refused: otherwise any web page could make a browser on the controller's host clear or
move KV through a controller without an admin key.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.exceptions import HTTPException

from kvferry.common import secret as csecret

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

    def __init__(self, app: ASGIApp, admin_key: str | None, counters: dict[str, int]) -> None:
        self.app, self.admin_key, self.counters = app, admin_key, counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        # Decoded as aiohttp did, so a key with non-ASCII characters still matches.
        if self.admin_key is not None and scope["path"] not in OPEN_PATHS and not csecret.authorized(
                headers.get(b"authorization", b"").decode("utf-8", "surrogateescape"), self.admin_key):
            self.counters["unauthorized_http"] += 1
            await reply(send, 401, {"error": UNAUTHORIZED},
                        [(b"www-authenticate", f'Basic realm="{REALM}"'.encode())])
            return
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > MAX_BODY:
            await reply(send, 413, {"error": f"the body is over {MAX_BODY >> 20} MiB"})
            return
        if scope["method"] == "POST" and _cross_site(headers):
            self.counters["unauthorized_http"] += 1
            await reply(send, 403, {"error": "cross-site POST refused: call the controller's API from a client "
                                             "(curl, a script) or from its own page, not from another site"})
            return
        if scope["method"] == "POST":
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        await self.app(scope, _bounded(receive), send)


def _cross_site(headers: dict[bytes, bytes]) -> bool:
    """Is this a browser request sent by a page of another origin? (Clients without Origin pass.)"""
    origin = headers.get(b"origin")
    if origin is None:
        return headers.get(b"sec-fetch-site", b"") == b"cross-site"
    host = origin.split(b"://", 1)[-1]
    return origin == b"null" or host != headers.get(b"host", b"")


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
