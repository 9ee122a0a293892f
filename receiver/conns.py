"""Which senders' alloc connections closed, so their unwritten pages can come back early.

ZMQ tells a ROUTER only that *a* connection (a file descriptor) closed, not whose. Each request
on the alloc port records its identity's descriptor; when a descriptor closes, the identities
last seen on it are probed after the grace: with ROUTER_MANDATORY a send to a gone identity
fails with EHOSTUNREACH and delivers nothing. A descriptor number the kernel reuses for a new
connection makes that connection's identity a candidate too; its probe is delivered (a reply
for no transfer, which senders ignore), so it is never taken for gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections import OrderedDict
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvferry.common.log import get_logger
from kvferry.common.wire import messages as m

logger = get_logger(__name__)

MAX_IDENTS = 65536
PROBE = m.encode(m.ErrorReply(code="probe", message="is this connection still open?"))


class ConnWatch:
    """Calls `on_gone(identity)` `grace` seconds after a connection closed (thread: the socket's loop)."""

    def __init__(self, sock: zmq.asyncio.Socket, on_gone: Callable[[bytes], object], grace: float) -> None:
        self.sock, self.on_gone, self.grace = sock, on_gone, grace
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._fds: OrderedDict[bytes, int] = OrderedDict()  # identity -> descriptor it last came on
        self.gone = 0
        self._tasks: set[asyncio.Task] = set()

    def seen(self, ident: bytes, fd: int) -> None:
        self._fds[ident] = fd
        self._fds.move_to_end(ident)
        while len(self._fds) > MAX_IDENTS:
            self._fds.popitem(last=False)

    async def run(self) -> None:
        """Until cancelled: read the socket's disconnect events."""
        mon = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        loop = asyncio.get_running_loop()
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())
                loop.call_later(self.grace, self._start_probe, event["value"])
        finally:
            for t in self._tasks:
                t.cancel()
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            mon.close(linger=0)

    def _start_probe(self, fd: int) -> None:
        t = asyncio.ensure_future(self._probe(fd))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _probe(self, fd: int) -> None:
        for ident in [i for i, f in self._fds.items() if f == fd]:
            try:
                await self.sock.send_multipart([ident, PROBE], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    continue  # there, but busy: not gone
                del self._fds[ident]
                self.gone += 1
                self.on_gone(ident)
