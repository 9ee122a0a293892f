"""A receiver's ports thread, ``kvf-recv-ports``: one asyncio loop serving the init and alloc ports
(ZMQ ROUTER, made by common/zsock.py: with a cluster secret only its holders get a frame through,
and the NIXL metadata of the pd_buffer goes to nobody else). Each request is its own task
(buffer/peering.py), so a slow or stuck request never holds up another; the alloc port's closed
connections are watched (receiver/conns.py).

This module owns the sockets and the loop, their start and their stop; what a request gets is
the receiver's business (receiver/kv_receiver.py), handed in as callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvferry.buffer import peering
from kvferry.common import zsock
from kvferry.common.log import get_logger
from kvferry.common.netutil import advertised
from kvferry.receiver.conns import ConnWatch

logger = get_logger(__name__)


class Ports:
    """Serves one receiver's init and alloc ports on a thread of their own, from `start()` to
    `stop()`. `on_bad(why, port_name)` hears of junk frames; `on_writer_gone(identity)` of an
    alloc connection that closed, `grace` seconds after (receiver/conns.py)."""

    def __init__(self, host: str, init_port: int, alloc_port: int, trust: zsock.Trust, advertise_host: str | None,
                 on_init: peering.Handler, on_alloc: peering.Handler, on_bad: Callable[[str, str], None],
                 on_writer_gone: Callable[[bytes], object], grace: float) -> None:
        self.host, self.init_port, self.alloc_port = host, init_port, alloc_port
        self.trust, self.advertise_host = trust, advertise_host
        self._on_init, self._on_alloc, self._on_bad = on_init, on_alloc, on_bad
        self._on_writer_gone, self._grace = on_writer_gone, grace
        self.error: BaseException | None = None  # why the ports did not start
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._stop_async: Callable[[], object] = lambda: None
        self._serving: tuple[asyncio.AbstractEventLoop, zmq.asyncio.Socket] | None = None  # the loop, the alloc port

    def start(self) -> threading.Thread:
        """Start the ports thread (the caller joins it after `stop()`); `started` says when both listen."""
        t = threading.Thread(target=self._main, name="kvf-recv-ports", daemon=True)
        t.start()
        return t

    def started(self, timeout: float) -> bool:
        """Whether both ports listen within `timeout`; if not, `error` says why (None: no word in time)."""
        return self._ready.wait(timeout) and self.error is None

    def stop(self) -> None:
        """From any thread: the ports close and their thread ends."""
        self._stopping.set()
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._stop_async()

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """`fn(the alloc port's socket, *args)` on the ports loop; from any thread, without blocking.
        Nothing while the ports are not serving."""
        serving = self._serving
        if serving is None:
            return
        loop, alloc = serving
        with contextlib.suppress(RuntimeError):  # the loop closed: the receiver is closing
            loop.call_soon_threadsafe(fn, alloc, *args)

    def _bad_frame(self, port_name: str, why: str) -> None:
        self._on_bad(why, port_name)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to started()
            self.error = e
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        ctx = zmq.asyncio.Context()
        socks = []
        try:
            for port, key in ((self.init_port, "pd_peer_init_port"), (self.alloc_port, "pd_peer_alloc_port")):
                socks.append(zsock.listen(ctx, zmq.ROUTER, self.trust, self.host, port, key))
            init, alloc = socks
            logger.info("receiver listening on %s (init %d, alloc %d); prefillers dial %s",
                        self.host, self.init_port, self.alloc_port,
                        advertised(self.host, self.advertise_host, "the receiver (pd_peer_host)"))
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._stop_async = lambda: loop.call_soon_threadsafe(stop.set)
            self._serving = (loop, alloc)
            self._ready.set()
            # One reader per port, awaiting recv directly: zmq.asyncio's Poller adds ~0.6 ms a message.
            conns = ConnWatch(alloc, self._on_writer_gone, self._grace)
            readers = [asyncio.ensure_future(peering.serve(sock, handler, name,
                                                           functools.partial(self._bad_frame, name), on_seen=seen))
                       for sock, name, handler, seen in ((init, "init", self._on_init, None),
                                                         (alloc, "alloc", self._on_alloc, conns.seen))]
            readers.append(asyncio.ensure_future(conns.run()))
            if self._stopping.is_set():
                stop.set()
            await stop.wait()
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        finally:
            self._serving = None
            for s in socks:
                s.close(linger=0)
            ctx.term()
