"""The cap on client requests in flight (--max-in-flight), for one process or for the workers of
--workers N together. (A body's bound, --max-body-bytes, is held as it is read: http/front_door.py.)"""

from __future__ import annotations

from typing import Any

RETRY_AFTER_S = 1  # what a 503 for a full proxy asks clients to wait


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
