"""Which senders' alloc connections closed, so their unwritten pages can come back early.

ZMQ tells a ROUTER only that *a* connection (a file descriptor) closed, not whose. Each request
on the alloc port records its identity's descriptor; when a descriptor closes, the identities
last seen on it are probed after the grace: with ROUTER_MANDATORY a send to a gone identity
fails with EHOSTUNREACH and delivers nothing. A descriptor number the kernel reuses for a new
connection makes that connection's identity a candidate too; its probe is delivered (a reply
for no transfer, which senders ignore), so it is never taken for gone.

ZMQ reports the close before its I/O thread ends the identity's pipe, and on a busy machine that
can take longer than the grace: a probe then is still delivered. So the identities on a closed
descriptor are probed `PROBES` times, each wait `BACKOFF` times the one before; a live one costs
that many ignored replies per close on its number.
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
PROBES = 3
BACKOFF = 4
PROBE = m.encode(m.ErrorReply(code="probe", message="is this connection still open?"))


class ConnWatch:
    """Calls `on_gone(identity)` once a probe, `grace` seconds or more after its connection closed,
    finds it gone (thread: the socket's loop)."""

    def __init__(self, sock: zmq.asyncio.Socket, on_gone: Callable[[bytes], object], grace: float,
                 probes: int = PROBES) -> None:
        self.sock, self.on_gone, self.grace, self.probes = sock, on_gone, grace, probes
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
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())
                self.closed(event["value"])
        finally:
            self.stop()
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            mon.close(linger=0)

    def stop(self) -> None:
        """Cancel the probes still to come."""
        for t in list(self._tasks):
            t.cancel()

    def closed(self, fd: int) -> None:
        """Descriptor `fd` closed: probe the identities last seen on it (thread: the socket's loop)."""
        t = asyncio.ensure_future(self._probes(fd))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _probes(self, fd: int) -> None:
        wait = self.grace
        for _ in range(self.probes):
            await asyncio.sleep(wait)
            if not await self._probe(fd):
                return
            wait *= BACKOFF

    async def _probe(self, fd: int) -> bool:
        """Probe once; whether any identity on `fd` is still there (to be probed again)."""
        left = False
        for ident in [i for i, f in self._fds.items() if f == fd]:
            try:
                await self.sock.send_multipart([ident, PROBE], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    left = True  # there, but busy: not gone
                    continue
                del self._fds[ident]
                self.gone += 1
                self.on_gone(ident)
            else:
                left = True
        return left
