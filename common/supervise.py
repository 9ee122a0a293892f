"""Background loops that never die silently: each one that raises is logged with its traceback,
counted, and started again after a pause (doubling to 30 s); its state is there for /health
and the metrics: a background failure is always seen, never a thread that quietly stopped."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvferry.common.log import get_logger

logger = get_logger(__name__)

MAX_PAUSE_S = 30.0


@dataclass
class LoopHealth:
    """How one background loop is doing."""

    name: str
    restarts: int = 0
    last_error: str | None = None
    failing_since: float | None = None  # time.time() of the failure it has not recovered from yet

    @property
    def ok(self) -> bool:
        return self.failing_since is None

    def failed(self, e: BaseException) -> None:
        self.restarts += 1
        self.last_error = f"{type(e).__name__}: {e}"[:500]
        if self.failing_since is None:
            self.failing_since = time.time()

    def recovered(self) -> None:
        self.failing_since = None

    def describe(self) -> dict:
        return {"ok": self.ok, "restarts": self.restarts, "last_error": self.last_error}


async def supervise(health: LoopHealth, fn: Callable[[], Awaitable[None]], pause: float = 0.5) -> None:
    """Run `fn` until it returns or the task is cancelled; when it raises, log, count, wait and
    run it again. `fn` calls `health.recovered()` once it works again (e.g. after a bind)."""
    while True:
        try:
            await fn()
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the point of a supervisor
            health.failed(e)
            logger.exception("%s failed (%d so far); starting it again in %.1f s", health.name, health.restarts,
                             pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)


def supervise_thread(health: LoopHealth, body: Callable[[], None], stop: threading.Event,
                     pause: float = 0.5) -> None:
    """A thread's target: run `body` (a loop that returns once `stop` is set) the same way."""
    while not stop.is_set():
        try:
            body()
            return
        except Exception as e:  # noqa: BLE001 - the point of a supervisor
            health.failed(e)
            logger.exception("%s failed (%d so far); starting it again in %.1f s", health.name, health.restarts,
                             pause)
            stop.wait(pause)
            pause = min(pause * 2, MAX_PAUSE_S)
