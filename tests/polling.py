"""Waiting in tests: poll a condition up to a deadline (no unbounded wait, a message naming what)."""

from __future__ import annotations

import time


def until(pred, timeout: float = 10.0, what: str = "condition", every: float = 0.05):
    """`pred()`'s first truthy value, polled every `every` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return v


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
