"""The proxy's side of KV transfers: it tells a decoder's receiver to drop a transfer nobody
will read, and (with --proxy-port) reads the receivers' "KV arrived" notifications to time the
transfer wait.

The wait is how long the KV was still on its way after the prefiller answered: one sample per
transfer whichever comes first. With pages reserved early the decoder's arrival notice usually
beats the prefiller's answer: that transfer's wait is 0 (nothing was left to wait for).

One abort socket per decoder, made at its first abort and closed when the decoder leaves the
registry (a DEALER toward a host that is gone would reconnect to it forever)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections import OrderedDict

import zmq
import zmq.asyncio

from kvferry.common import netutil as net
from kvferry.common import zsock
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.supervise import LoopHealth
from kvferry.common.wire import messages as m
from kvferry.proxy.instance_flags import OptionError
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing.instances import Instance

logger = get_logger(__name__)

MAX_TRACKED_ARRIVALS = 10_000
NOTIFY_MAX_BYTES = 1 << 16
LAST_ABORT_LINGER_MS = 1000  # an abort to a decoder already removed: its one-off socket tries this long


def notify_host(opts: ProxyOptions) -> str:
    """Where the notification socket binds: --proxy-bind-host, else --proxy-host (the address
    receivers PUSH to, their pd_proxy_host), else loopback; never every interface unless asked."""
    return opts.proxy_bind_host or opts.proxy_host or "127.0.0.1"


class Transfers:
    def __init__(self, opts: ProxyOptions, trust: zsock.Trust, metrics: ProxyMetrics) -> None:
        self.opts, self.trust, self.metrics = opts, trust, metrics
        self._zmq = zmq.Context()
        self._abort_socks: dict[str, zmq.Socket] = {}
        self._note_ctx: zmq.asyncio.Context | None = None
        self._note_sock: zmq.asyncio.Socket | None = None
        # transfer_id -> when the prefiller answered (a float), or None while its prefill is still
        # running; kept only while notifications are read, and bounded: a notification that never
        # comes must not grow it forever.
        self._arrivals: OrderedDict[str, float | None] = OrderedDict()
        # transfers whose arrival notice came before the prefiller's answer (same bound)
        self._early: OrderedDict[str, None] = OrderedDict()
        self._bad_notes = RateLimitedLog(logger, 10.0)

    @property
    def notify_host(self) -> str:
        return notify_host(self.opts)

    def started(self, tid: str, decoder: Instance) -> None:
        """The prefill leg of `tid` is about to be sent: an arrival notice may come from now on, and
        an abort may follow: the decoder's abort socket connects now, so that an abort goes over a
        connection whose handshake is done (the first message of a new connection was seen lost)."""
        if decoder.spec.alloc_port is not None and not decoder.removed:
            self._sock(decoder)
        if self.opts.proxy_port:
            self._track(self._arrivals, tid, None)

    def prefilled(self, tid: str) -> None:
        """The prefiller answered for `tid`: a notice that came first is a wait of 0; else the
        notice is timed from now."""
        if not self.opts.proxy_port:
            return
        if self._early.pop(tid, 0) is None:
            self._arrivals.pop(tid, None)
            self.metrics.kv_wait.observe(0.0)
            return
        self._track(self._arrivals, tid, time.perf_counter())

    def arrived(self, tid: str) -> bool:
        """A receiver's notice for `tid`: True when the proxy sent that transfer (its wait is
        observed now, or at the prefiller's answer when that has not come yet)."""
        if tid not in self._arrivals:
            return False
        t = self._arrivals.pop(tid)
        if t is None:
            self._track(self._early, tid, None)
        else:
            self.metrics.kv_wait.observe(max(0.0, time.perf_counter() - t))
        return True

    @staticmethod
    def _track(d: OrderedDict, tid: str, value) -> None:
        d[tid] = value
        if len(d) > MAX_TRACKED_ARRIVALS:
            d.popitem(last=False)

    def abort(self, decoder: Instance, tid: str, why: str) -> None:
        """Tell the decoder's receiver to drop a transfer nobody will read (its pages come back now)."""
        if not tid or decoder.spec.alloc_port is None:  # served alone, or a decoder with no receiver: no transfer
            return
        if decoder.removed and decoder.id not in self._abort_socks:
            # A request that outlived its decoder's removal: its pages still come back.
            sock = self._connect(decoder)
            self._send(sock, tid, why)
            sock.close(linger=LAST_ABORT_LINGER_MS)
        else:
            self._send(self._sock(decoder), tid, why)
        self._forget(tid)

    def _sock(self, decoder: Instance) -> zmq.Socket:
        """The decoder's abort socket, connected on first use and kept until the decoder leaves."""
        sock = self._abort_socks.get(decoder.id)
        if sock is None:
            sock = self._abort_socks[decoder.id] = self._connect(decoder)
            decoder.when_removed(functools.partial(self._drop, decoder.id))
        return sock

    def _connect(self, decoder: Instance) -> zmq.Socket:
        """A socket to the decoder's alloc port (callers checked that it has one)."""
        port = decoder.spec.alloc_port
        if port is None:
            raise ValueError(f"decoder {decoder.id} has no alloc port")
        # The alloc port speaks CurveZMQ when the cluster has a secret: so does this socket.
        sock = zsock.socket(self._zmq, zmq.DEALER, self.trust, server=False)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(f"tcp://{net.hostport(decoder.spec.kv_host, port)}")
        return sock

    @staticmethod
    def _send(sock: zmq.Socket, tid: str, why: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            # Generation 0 (any), never final: the proxy cannot know whether a WRITE is in flight.
            sock.send(m.encode(m.AbortTransfer(transfer_id=tid, generation=0, reason=why, final=False)),
                      zmq.NOBLOCK)

    def _forget(self, tid: str) -> None:
        self._arrivals.pop(tid, None)
        self._early.pop(tid, None)

    def _drop(self, iid: str) -> None:
        """The decoder left: its abort socket closes now (what it had not sent is dropped)."""
        sock = self._abort_socks.pop(iid, None)
        if sock is not None:
            sock.close(linger=0)

    def bind(self) -> zmq.asyncio.Socket:
        """The notification socket on --proxy-port (bound at start-up, so a port in use is a
        start-up error, not a loop's)."""
        import zmq.asyncio
        if self._note_ctx is None:
            self._note_ctx = zmq.asyncio.Context()
        try:
            assert self.opts.proxy_port is not None  # bound only with --proxy-port
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
            if not self.arrived(note.transfer_id):
                self.metrics.notifications.labels("unknown").inc()
                continue
            self.metrics.notifications.labels("arrived").inc()

    def close(self) -> None:
        if self._note_sock is not None:
            self._note_sock.close(linger=0)
        if self._note_ctx is not None:
            self._note_ctx.term()
        self._zmq.destroy(linger=0)
