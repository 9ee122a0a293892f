"""ByteBudget: caps the bytes that in-flight receives hold across all of a server's connections."""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    """An async byte semaphore, first come first served (a large request is not starved by small
    ones); a server reserves a frame's bytes here before it allocates them, so many trickling
    peers wait for room instead of each holding its own buffer."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, n: int) -> None:
        """Reserve `n` bytes, waiting for room (callers bound the wait with a timeout)."""
        if n > self.limit:
            raise ValueError(f"{n} bytes can never fit a budget of {self.limit}")
        if not self._waiters and self.used + n <= self.limit:
            self._take(n)
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except BaseException:
            if entry[1].done() and not entry[1].cancelled():
                self.release(n)  # granted and cancelled at once: give it back
            else:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
                self._wake()  # the head may have been us: the next one may fit now
            raise

    def release(self, n: int) -> None:
        """Give back `n` reserved bytes; wake whoever fits now, in arrival order."""
        self.used -= n
        self._wake()

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def _wake(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.limit:
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)
