"""The proxy's front-door limits: bounded body reads, and a cap on requests in flight.

A body is read in the chunks the transport delivers (each read awaits, so other requests keep
flowing while a large one trickles in) and counted against --max-body-bytes as it arrives: an
over-size body is refused from its Content-Length before any of it is read, or as soon as the
running count passes the limit, never after buffering all of it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvferry.common.errors import BadDataError

RETRY_AFTER_S = 1  # what a 503 for a full proxy asks clients to wait


class TooLarge(BadDataError):
    """The body passed --max-body-bytes (not a ValueError: the JSON parser's handler must not
    answer it as bad JSON)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes (--max-body-bytes)")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, refused with TooLarge once it passes `limit` bytes."""
    whole = getattr(request, "whole_body", None)  # the front door's hot path read it within the limit
    if whole is not None:
        return whole
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(limit)
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        total += len(chunk)
        if total > limit:
            raise TooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)



class Gate:
    """Counts client requests in flight; `enter` is False once `limit` are. With `board` (a
    worker of --workers N), the limit holds for the workers together: each counts its own on the
    board, and the sum is checked (two workers may both pass at the same instant: the limit is
    then passed by at most one request per worker)."""

    def __init__(self, limit: int, board: Any = None) -> None:
        self.limit, self.count, self.board = limit, 0, board

    def enter(self) -> bool:
        total = self.count if self.board is None else self.board.clients()
        if total >= self.limit:  # refusals are counted by the caller's metrics
            return False
        self.count += 1
        if self.board is not None:
            self.board.put_clients(self.count)
        return True

    def leave(self) -> None:
        self.count -= 1
        if self.board is not None:
            self.board.put_clients(self.count)
