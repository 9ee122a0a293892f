"""One logger format for every kvferry process, close to LMCache's log lines."""

from __future__ import annotations

import logging
import os
import sys
import time

_FORMAT = "[%(asctime)s] kvferry %(levelname)s: %(message)s (%(filename)s:%(lineno)d:%(name)s)"
_configured = False


def get_logger(name: str) -> logging.Logger:
    """A logger under the `kvferry` hierarchy; level from KVFERRY_LOG_LEVEL / LMCACHE_LOG_LEVEL."""
    global _configured
    if not _configured:
        root = logging.getLogger("kvferry")
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT))
            root.addHandler(handler)
            root.propagate = False
        level = os.environ.get("KVFERRY_LOG_LEVEL") or os.environ.get("LMCACHE_LOG_LEVEL") or "INFO"
        root.setLevel(level.upper() if level.upper() in logging._nameToLevel else "INFO")
        _configured = True
    if not name.startswith("kvferry"):
        name = f"kvferry.{name}"
    return logging.getLogger(name)


class RateLimitedLog:
    """Logs at most once per `interval` seconds; counts what it suppressed in between."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._interval:
            self._suppressed += 1
            return
        if self._suppressed:
            msg = f"{msg} ({self._suppressed} similar messages suppressed)"
        self._suppressed = 0
        self._last = now
        self._logger.warning(msg, *args)
