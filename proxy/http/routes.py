"""The proxy's routes: a method and a path to a handler. A path is exact, or has `{name}` segments
(one segment each: `/admin/instances/{iid}/drain`). GET routes answer HEAD too."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvferry.proxy.http.exchange import Request
    from kvferry.proxy.http.sse import Answer

Handler = Callable[["Request"], Awaitable["Answer"]]


class Routes:
    def __init__(self) -> None:
        self.exact: dict[str, dict[str, Handler]] = {}
        self.patterns: list[tuple[re.Pattern[str], dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        if "{" not in path:
            methods = self.exact.setdefault(path, {})
        else:
            rx = re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path)) + "$")
            methods = next((m for p, m in self.patterns if p.pattern == rx.pattern), {})
            if not methods:
                self.patterns.append((rx, methods))
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)

    def match(self, method: str, path: str) -> tuple[Handler | None, dict[str, str], list[str]]:
        """(handler, path fields, []) or, with no handler, (None, {}, the path's methods): none
        for an unknown path (404), some for a known path asked with another method (405)."""
        methods = self.exact.get(path)
        fields: dict[str, str] = {}
        if methods is None:
            for rx, ms in self.patterns:
                m = rx.match(path)
                if m is not None:
                    methods, fields = ms, m.groupdict()
                    break
            else:
                return None, {}, []
        handler = methods.get(method)
        if handler is None:
            return None, {}, sorted(methods)
        return handler, fields, []
