"""Skipping a failing service: a pause that doubles on each failure, warnings rate-limited."""

from __future__ import annotations

import logging
import threading
import time

from kvferry.common.log import RateLimitedLog


class Backoff:
    """After a failure `name` is skipped for 1 s, then 2, 4, ... up to 30 s; one success resets it.

    Thread-safe; a warning at most every 10 s, one info line when the service answers again."""

    def __init__(self, name: str, logger: logging.Logger, min_s: float = 1.0, max_s: float = 30.0) -> None:
        self.name, self.min_s, self.max_s = name, min_s, max_s
        self._logger = logger
        self._warn = RateLimitedLog(logger)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._pause = min_s

    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, what: str, e: object, consequence: str) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self._pause
            wait, self._pause = self._pause, min(self._pause * 2, self.max_s)
        self._warn.warning("%s: %s failed (%s); %s for %.0f s", self.name, what, e, consequence, wait)

    def ok(self) -> None:
        if self._pause != self.min_s:
            with self._lock:
                if self._pause == self.min_s:
                    return
                self._pause = self.min_s
            self._logger.info("%s answers again", self.name)
