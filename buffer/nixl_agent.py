"""One way to create kvferry's NIXL agents: UCX, no progress thread.

NIXL's UCX progress thread busy-polls a whole core even when idle; on a
CPU host that core is the model's. kvferry drives progress itself, from the thread that already
waits on a transfer (the sender's completion polling, the receiver's notification polling), with
short sleeps, so an idle sender or receiver uses almost no CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvferry.common.errors import UnavailableError
from kvferry.common.log import get_logger

logger = get_logger(__name__)


class NixlUnavailable(UnavailableError, RuntimeError):
    """nixl is not installed or has no UCX plugin."""


def use_net_devices(devices: str | None) -> None:
    """UCX_NET_DEVICES for this process's NIXL agents (config key nixl_net_devices): which NIC(s)
    UCX moves KV over. The environment wins: a value already set there is kept (and a differing
    key is logged). UCX reads it when an agent is made, so this comes first."""
    if not devices:
        return
    have = os.environ.get("UCX_NET_DEVICES")
    if have is None:
        os.environ["UCX_NET_DEVICES"] = devices
        logger.info("UCX_NET_DEVICES=%s (config key nixl_net_devices)", devices)
    elif have != devices:
        logger.warning("nixl_net_devices is %r but UCX_NET_DEVICES=%r is set in the environment: UCX uses "
                       "the environment's", devices, have)


def make_agent(name: str, net_devices: str | None = None) -> Any:
    """A `nixl_agent` named `name` with the UCX backend and no progress thread; `net_devices`:
    see use_net_devices.

    The agent is not thread-safe (sync mode NONE): callers use it from one thread only.
    """
    use_net_devices(net_devices)
    try:
        from nixl import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise NixlUnavailable(f"nixl is not installed ({e}): pip install nixl") from None
    _nixl_logs_to_stderr()
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise NixlUnavailable("nixl has no UCX plugin here: reinstall nixl (pip install --force-reinstall nixl)")
    return agent


def _nixl_logs_to_stderr() -> None:
    """NIXL's Python logger writes to stdout; a log line there corrupts what a command prints (a
    benchmark's JSON, `--json` output), so it goes to stderr with every other log line."""
    for h in logging.getLogger("nixl").handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)


def tight_sleeps() -> None:
    """Let this thread's short poll sleeps end on time: Linux adds up to 50 us of timer slack to
    every sleep, which would double a 50 us poll (and the time to see a write done)."""
    try:
        import ctypes  # noqa: PLC0415 - Linux only

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000)  # PR_SET_TIMERSLACK: 1 us
    except (OSError, AttributeError) as e:  # not Linux: the default slack stays
        logger.debug("timer slack not set: %s", e)


def mem_type(device: str) -> str:
    """NIXL's memory type for a torch device string."""
    return "VRAM" if device.startswith("cuda") else "DRAM"


def device_id(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


@dataclass(frozen=True)
class XferDone:
    """How a transfer posted with `NixlThread.post` ended, and when (time.monotonic())."""

    state: str  # "DONE", "EXPIRED" or "ERR ..."
    posted: float
    done: float


class NixlThread:
    """The only thread that touches one NIXL agent (agents are not thread-safe).

    Runs calls handed to it and polls in-flight transfers every `poll_s` (a real sleep, not an
    asyncio timer, whose resolution is a millisecond); blocks on its queue, using no CPU, when
    nothing is in flight. While `progress` is on it also drives the agent's progress, which a
    peer's READ of this agent's memory needs (there is no progress thread). Results go back to
    the asyncio loop as futures.
    """

    def __init__(self, agent, loop: asyncio.AbstractEventLoop, poll_s: float, name: str = "kvf-nixl") -> None:
        self.agent = agent
        self.poll_s = poll_s
        self.progress = 0  # > 0: keep the agent progressing (leases on this agent's memory)
        self._loop = loop
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()  # ("call"|"xfer"|"wake"|"stop", ...)
        self._inflight: list[tuple[object, float, asyncio.Future | concurrent.futures.Future, float]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn, *args) -> asyncio.Future:
        fut = self._loop.create_future()
        self._q.put(("call", fn, args, fut))
        return fut

    def xfer(self, op: str, local: list, local_mem: str, remote: list, remote_mem: str, agent_name: str,
             notif: bytes, deadline: float) -> asyncio.Future:
        """Post one WRITE or READ; the future gets "DONE", "EXPIRED" (cancelled at `deadline`) or "ERR ..."."""
        fut = self._loop.create_future()
        self._q.put(("xfer", (op, local, local_mem, remote, remote_mem, agent_name, notif, deadline, None), fut))
        return fut

    def post(self, op: str, local: Any, local_mem: str, remote: Any, remote_mem: str, agent_name: str,
             notif: bytes, deadline: float, fut: concurrent.futures.Future[XferDone] | None = None,
             prepped: Any = None) -> concurrent.futures.Future[XferDone]:
        """`xfer` for a caller on any thread, with no event loop between it and NIXL. `fut`: the
        caller's own future, its callbacks attached before the post is queued. `prepped`: what may
        hold a transfer handle made ahead for exactly this post (sender/prepared.py), taken and
        posted instead of making one here when its ``take(op, agent_name, notif)`` returns it."""
        fut = concurrent.futures.Future() if fut is None else fut
        self._q.put(("xfer", (op, local, local_mem, remote, remote_mem, agent_name, notif, deadline, prepped), fut))
        return fut

    def run(self, fn, *args) -> None:
        """Run `fn(*args)` on this thread, in queue order, from any thread; nothing waits for it
        (its errors are logged)."""
        self._q.put(("call", fn, args, None))

    def wake(self) -> None:
        """Re-check `progress` now (the thread may be blocked on its queue)."""
        self._q.put(("wake",))

    def stop(self) -> None:
        self._q.put(("stop",))
        self._thread.join(timeout=5)

    def _resolve(self, fut: asyncio.Future | concurrent.futures.Future, value: object = None,
                  exc: BaseException | None = None, posted: float = 0.0) -> None:
        if isinstance(fut, concurrent.futures.Future):  # from post(): set here, no loop hop
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(XferDone(str(value), posted or time.monotonic(), time.monotonic()))
            return

        def set_() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)
        self._loop.call_soon_threadsafe(set_)

    def _run(self) -> None:
        tight_sleeps()
        while True:
            try:
                busy = self._inflight or self.progress > 0
                item = self._q.get(timeout=self.poll_s) if busy else self._q.get()
            except queue.Empty:
                item = None
            if item is not None:
                if item[0] == "stop":
                    for handle, _, fut, _ in self._inflight:
                        self._release(handle)
                        self._resolve(fut, "ERR (sender closed)")
                    self._refuse_queued()
                    return
                if item[0] == "wake":
                    pass
                elif item[0] == "call":
                    _, fn, args, fut = item
                    try:
                        got = fn(*args)
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        if fut is None:
                            logger.warning("a call on the NIXL thread failed: %s: %s", fn, e)
                        else:
                            self._resolve(fut, exc=e)
                    else:
                        if fut is not None:
                            self._resolve(fut, got)
                else:  # ("xfer", (op, local, ..., deadline), fut)
                    self._post(item[1], item[2])
            self._poll()
            if self.progress > 0 and not self._inflight:
                try:
                    self.agent.get_new_notifs()  # drives UCX progress for peers' READs
                except Exception as e:  # noqa: BLE001
                    logger.debug("get_new_notifs: %s", e)

    def _refuse_queued(self) -> None:
        """At stop: whatever is still queued ends now, so no caller waits on it."""
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item[0] == "xfer":
                self._resolve(item[2], "ERR (sender closed)")
            elif item[0] == "call" and item[3] is not None:
                self._resolve(item[3], exc=RuntimeError("the NIXL thread stopped"))

    def _post(self, xfer: tuple, fut: Any) -> None:
        op, local, local_mem, remote, remote_mem, agent_name, notif, deadline, prepped = xfer
        posted = time.monotonic()
        if posted >= deadline:
            self._resolve(fut, "EXPIRED")
            return
        a = self.agent
        try:
            handle = None if prepped is None else prepped.take(op, agent_name, notif)
            if handle is None:
                handle = a.initialize_xfer(op, a.get_xfer_descs(local, local_mem),
                                           a.get_xfer_descs(remote, remote_mem), agent_name, notif)
            state = a.transfer(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types
            self._resolve(fut, f"ERR ({e})", posted=posted)
            return
        if state == "PROC":
            self._inflight.append((handle, deadline, fut, posted))
            return
        self._release(handle)
        self._resolve(fut, state, posted=posted)

    def _poll(self) -> None:
        still = []
        now = time.monotonic()
        for handle, deadline, fut, posted in self._inflight:
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as e:  # noqa: BLE001
                state = f"ERR ({e})"
            if state == "PROC" and now >= deadline:
                state = "EXPIRED"  # release() below cancels it: no transfer after the lease
            if state == "PROC":
                still.append((handle, deadline, fut, posted))
                continue
            self._release(handle)
            self._resolve(fut, state, posted=posted)
        self._inflight = still

    def _release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not release a NIXL transfer handle: %s", e)
