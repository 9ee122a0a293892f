"""The proxy's side of KV transfers: it tells a decoder's receiver to drop a transfer nobody
will read, and (with --proxy-port) reads the receivers' "KV arrived" notifications to time the
transfer wait."""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

import zmq

from kvferry.common import messages as m
from kvferry.common import zsock
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.supervise import LoopHealth
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.options import OptionError, ProxyOptions
from kvferry.proxy.registry import Instance

logger = get_logger(__name__)

MAX_TRACKED_ARRIVALS = 10_000
NOTIFY_MAX_BYTES = 1 << 16


def notify_host(opts: ProxyOptions) -> str:
    """Where the notification socket binds: --proxy-host (the address receivers PUSH to), else
    loopback; never every interface unless asked."""
    return opts.proxy_host or "127.0.0.1"


class Transfers:
    def __init__(self, opts: ProxyOptions, trust: zsock.Trust, metrics: ProxyMetrics) -> None:
        self.opts, self.trust, self.metrics = opts, trust, metrics
        self._zmq = zmq.Context()
        self._abort_socks: dict[str, zmq.Socket] = {}
        self._note_ctx: zmq.Context | None = None
        self._note_sock: zmq.Socket | None = None
        # transfer_id -> when the prefiller answered; kept only while notifications are read, and
        # bounded: a notification that never comes must not grow it forever.
        self._arrivals: OrderedDict[str, float] = OrderedDict()
        self._bad_notes = RateLimitedLog(logger, 10.0)

    @property
    def notify_host(self) -> str:
        return notify_host(self.opts)

    def prefilled(self, tid: str) -> None:
        """The prefiller answered for `tid`: its arrival notification is timed from now."""
        if self.opts.proxy_port:
            self._arrivals[tid] = time.perf_counter()
            if len(self._arrivals) > MAX_TRACKED_ARRIVALS:
                self._arrivals.popitem(last=False)

    def abort(self, decoder: Instance, tid: str, why: str) -> None:
        """Tell the decoder's receiver to drop a transfer nobody will read (its pages come back now)."""
        if not tid:  # a prompt the decoder served alone: no transfer
            return
        sock = self._abort_socks.get(decoder.id)
        if sock is None:
            # The alloc port speaks CurveZMQ when the cluster has a secret: so does this socket.
            sock = zsock.socket(self._zmq, zmq.DEALER, self.trust, server=False)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(f"tcp://{decoder.spec.host}:{decoder.spec.alloc_port}")
            self._abort_socks[decoder.id] = sock
        with contextlib.suppress(zmq.ZMQError):
            # Generation 0 (any), never final: the proxy cannot know whether a WRITE is in flight.
            sock.send(m.encode(m.AbortTransfer(transfer_id=tid, generation=0, reason=why, final=False)),
                      zmq.NOBLOCK)
        self._arrivals.pop(tid, None)

    def bind(self) -> zmq.Socket:
        """The notification socket on --proxy-port (bound at start-up, so a port in use is a
        start-up error, not a loop's)."""
        import zmq.asyncio
        if self._note_ctx is None:
            self._note_ctx = zmq.asyncio.Context()
        try:
            self._note_sock = zsock.listen(self._note_ctx, zmq.PULL, self.trust, self.notify_host,
                                           self.opts.proxy_port, "--proxy-port", max_bytes=NOTIFY_MAX_BYTES)
        except (zsock.BindError, zsock.ExposureError) as e:
            raise OptionError(str(e)) from None
        return self._note_sock

    async def notifications(self, health: LoopHealth) -> None:
        """Receivers PUSH one message per arrived transfer (pd_proxy_host/pd_proxy_port); with a
        cluster secret only peers that have it get through CurveZMQ's handshake."""
        sock = self._note_sock
        if sock is None or sock.closed:
            sock = self.bind()
        health.recovered()
        while True:
            raw = await sock.recv()
            try:
                note = m.decode(raw, expect=m.ProxyNotification, max_bytes=NOTIFY_MAX_BYTES)
            except m.MessageError as e:
                self.metrics.notifications.labels("bad").inc()
                self._bad_notes.warning("dropped a bad frame on --proxy-port (%s)", e)
                continue
            t = self._arrivals.pop(note.transfer_id, None)
            if t is None:
                self.metrics.notifications.labels("unknown").inc()
                continue
            self.metrics.notifications.labels("arrived").inc()
            self.metrics.kv_wait.observe(max(0.0, time.perf_counter() - t))

    def close(self) -> None:
        if self._note_sock is not None:
            self._note_sock.close(linger=0)
        if self._note_ctx is not None:
            self._note_ctx.term()
        self._zmq.destroy(linger=0)
