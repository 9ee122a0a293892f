"""Waiting in tests: poll a condition up to a deadline (no unbounded wait, a message naming what).

`until` for plain tests, `until_async` inside an event loop (its condition may be a coroutine
function). A test waits for what it needs rather than sleeping and hoping it has happened."""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import time

import httpx


class TimedOut(AssertionError):
    """`until`'s condition still false at its deadline (an AssertionError: a test fails on it)."""


def until(pred, timeout: float = 30.0, what="condition", every: float = 0.05):
    """`pred()`'s first truthy value, polled every `every` s; TimedOut after `timeout` s.
    `what` names the condition: a string, or a function called at the timeout (to say what it saw).
    An exception from `pred` (an AssertionError that a process died, say) ends the wait at once."""
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        if time.monotonic() >= deadline:
            raise TimedOut(_timed_out(what))
        time.sleep(every)
    return v


async def until_async(pred, timeout: float = 30.0, what="condition", every: float = 0.05):
    """`until` inside an event loop: `pred()` (awaited when it returns an awaitable) polled every
    `every` s without blocking the loop; TimedOut after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if inspect.isawaitable(v):
            v = await v
        if v:
            return v
        if time.monotonic() >= deadline:
            raise TimedOut(_timed_out(what))
        await asyncio.sleep(every)


def _timed_out(what) -> str:
    return f"timed out waiting for {what() if callable(what) else what}"


def answers(url: str, proc: subprocess.Popen | None = None, log=None):
    """A condition for `until`: `url` answers 200. If `proc` has exited, AssertionError at once,
    with `log()` (the process's log, say) in its message."""
    def check() -> bool:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{url}: its process exited with {proc.returncode}: {log() if log else ''}")
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
    return check


def listening(host: str, port: int) -> bool:
    """Something accepts TCP connections at host:port."""
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
