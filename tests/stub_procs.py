"""Stub engines and a proxy in front of them as separate processes (real HTTP), for tests of the
proxy: start them, wait until they answer, read a stub's log, post and stream. tests/conftest.py's
autouse fixture stops what a test started (`stopped_at_the_end`)."""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import httpx

from kvferry.common.netutil import free_port
from kvferry.launcher.vllm_proc import stop_group
from kvferry.testing.processes import wait_http

_ALL: list[Proc] = []


@contextlib.contextmanager
def stopped_at_the_end() -> Iterator[None]:
    """Stops the processes started in its block, even when the block failed before its own cleanup."""
    n = len(_ALL)
    try:
        yield
    finally:
        for p in _ALL[n:]:
            p.stop()
        del _ALL[n:]


class Proc:
    def __init__(self, args: list[str], url: str, probe: str, wait: bool = True) -> None:
        self.url, self.probe = url, probe
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        _ALL.append(self)
        if wait:
            self.wait()

    def wait(self) -> Proc:
        wait_http(self.url + self.probe, self.proc)
        return self

    def stop(self) -> None:
        stop_group(self.proc, 10)


_SALTS = itertools.count(1)  # each stub samples differently from every other (salts differ by < 500)


def stub(delay: float = 0.0, wait: bool = True, *extra: str) -> Proc:
    port = free_port()
    return Proc(["-m", "kvferry.testing.stub_engine", "--port", str(port), "--token-delay", str(delay),
                 "--salt", str(next(_SALTS)), *extra], f"http://127.0.0.1:{port}", "/health", wait)


def stubs(*delays: float) -> list[Proc]:
    """Stubs started side by side (each costs an interpreter start)."""
    return [p.wait() for p in [stub(d, wait=False) for d in delays]]


def proxy(prefillers: list[Proc], decoders: list[Proc], *extra: str) -> Proc:
    port = free_port()
    args = ["-m", "kvferry.proxy", "--port", str(port), "--health-interval", "0.3"]
    for p in prefillers:
        args += ["--prefiller", p.url]
    for d in decoders:
        args += ["--decoder", f"{d.url},{free_port()},{free_port()}"]
    return Proc(args + list(extra), f"http://127.0.0.1:{port}", "/metrics")


def log(s: Proc) -> dict:
    return httpx.get(s.url + "/stub/log").json()


def post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30, **kw)


def events(url: str, path: str, body: dict, each: Callable[[list], None] | None = None) -> list:
    """A streamed answer's events, [DONE] as a string; `each(events so far)` as each one comes."""
    out: list = []
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if each is not None:
                    each(out)
    return out
