"""Samples for histograms: single observations (a transfer's seconds, its bytes) recorded on the
threads that see them and taken, all at once, with the next stats report.

Counters travel as running totals (connector/stats.py sends their deltas); a histogram needs each
observation, so these travel as lists, ``name -> [value, ...]``, and every report takes and clears
them. Bounded: a side whose reports stop (no engine step) keeps at most `limit` per name and
counts what it dropped.
"""

from __future__ import annotations

import threading

LIMIT = 65536  # observations kept per name between two reports


class Samples:
    """Thread-safe: `add` from any thread, `take` from the one that reports."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._lock = threading.Lock()
        self._by: dict[str, list[float]] = {}
        self.limit = limit
        self.dropped = 0  # observations not kept (`limit` reached between two reports)

    def add(self, name: str, value: float) -> None:
        with self._lock:
            got = self._by.setdefault(name, [])
            if len(got) < self.limit:
                got.append(float(value))
            else:
                self.dropped += 1

    def take(self) -> dict[str, list[float]]:
        """Every observation since the last call, by name (empty names left out)."""
        with self._lock:
            out, self._by = self._by, {}
        return {k: v for k, v in out.items() if v}
