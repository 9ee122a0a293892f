"""kvferry's loggers, and the one place their output is configured.

Importing kvferry configures no logging: ``get_logger`` hands out a logger under ``kvferry``
with no handler and no level of its own, so its records propagate to the root logger like any
library's (and pytest's caplog sees them). What prints them, and how, is decided by whoever owns
the process:

- kvferry's own programs call ``configure_logging()`` first thing in their entry point
  (``kvferry-controller``, ``kvferry-server``, ``kvferry-proxy``, the ``kvferry`` commands that
  run services, the standalone engine): one stderr handler on the
  ``kvferry`` logger in kvferry's format (close to LMCache's lines), level from
  ``KVFERRY_LOG_LEVEL`` / ``LMCACHE_LOG_LEVEL`` (default INFO), not propagated to the root logger.
- Inside vLLM the process is vLLM's: the connector calls ``configure_in_vllm(...)`` where vLLM
  constructs it (not at import), and follows vLLM's logging settings. vLLM configures its own
  ``vllm`` logger (a handler, its level, no propagation) unless its logging is off
  (``VLLM_CONFIGURE_LOGGING=0`` / ``--logging-config.configure_logging false``). With it on,
  kvferry's lines get the handler above, at ``KVFERRY_LOG_LEVEL`` / ``LMCACHE_LOG_LEVEL`` or else
  vLLM's level (``--log-level`` / ``VLLM_LOGGING_LEVEL``), into the server's stderr as before;
  with it off, nothing is set and they propagate to the root logger the user configures. A
  ``kvferry`` logger that already has a handler (a ``--log-config-file`` naming it) is left as it is.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextvars import ContextVar
from typing import Any

# A line logged while a request is handled ends with its X-Request-Id (RequestIdFilter).
_FORMAT = "[%(asctime)s] kvferry %(levelname)s: %(message)s (%(filename)s:%(lineno)d:%(name)s)%(request_tag)s"
ROOT = "kvferry"

# The X-Request-Id of the request this task handles (the proxy sets it per request: each request
# has its own asyncio task, so its own copy); None outside a request.
REQUEST_ID: ContextVar[str | None] = ContextVar("kvferry_request_id", default=None)


class RequestIdFilter(logging.Filter):
    """Adds `request_tag` to every record: " [request ID]" while a request is handled, else ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        record.request_tag = f" [request {rid}]" if rid else ""
        return True


def get_logger(name: str) -> logging.Logger:
    """A logger under the `kvferry` hierarchy (configures nothing: see configure_logging)."""
    if name != ROOT and not name.startswith(ROOT + "."):
        name = f"{ROOT}.{name}"
    return logging.getLogger(name)


def _level(name: str | None) -> str | None:
    """`name` as a logging level name, or None when it is not one."""
    if not name:
        return None
    name = name.strip().upper()
    return name if isinstance(logging.getLevelName(name), int) else None


def env_level() -> str | None:
    """The level KVFERRY_LOG_LEVEL (else LMCACHE_LOG_LEVEL) names, None when neither names one."""
    return _level(os.environ.get("KVFERRY_LOG_LEVEL")) or _level(os.environ.get("LMCACHE_LOG_LEVEL"))


def configure_logging(default_level: str = "INFO") -> None:
    """For an entry point: kvferry's lines to stderr in kvferry's format, at env_level() or
    `default_level`. Once per process (later calls do nothing); a `kvferry` logger that already
    has a handler is left as it is."""
    root = logging.getLogger(ROOT)
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(RequestIdFilter())
    root.addHandler(handler)
    root.setLevel(env_level() or _level(default_level) or "INFO")
    root.propagate = False  # kvferry's handler prints them; a root handler would print them twice


def configure_in_vllm(logging_config: Any = None) -> None:
    """For the connector, where vLLM constructs it: follow vLLM's logging settings (the module
    docstring). `logging_config`: vLLM's LoggingConfig (``vllm_config.logging_config``); None reads
    the same settings from vLLM's environment variables."""
    if logging_config is not None:
        enabled = bool(getattr(logging_config, "configure_logging", True))
        vllm_level = getattr(logging_config, "log_level", None)
    else:
        enabled = os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0"
        vllm_level = os.environ.get("VLLM_LOGGING_LEVEL")
    if enabled:
        configure_logging(_level(vllm_level) or "INFO")


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
