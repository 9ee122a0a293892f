"""Waiting for a child process's HTTP endpoint: bounded, and failing at once if the process dies."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 30, log: Path | None = None) -> None:
    """Until `url` answers (any status); RuntimeError naming why (the process's exit, with its
    stderr or the tail of `log`) or TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            why = log.read_text(errors="replace")[-2000:] if log is not None else \
                (proc.stderr.read() if proc.stderr else "")
            raise RuntimeError(f"{url}: process exited with {proc.returncode}: {why}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout:g} s")
