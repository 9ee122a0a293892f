"""Scheduler side of P2P: "which instance holds the longest prefix of these chunks?", asked of
kvferry-controller, bounded, and skipped with a back-off while the controller does not answer."""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from kvferry.common import netutil, zsock
from kvferry.common.backoff import Backoff
from kvferry.common.config import KVFerryConfig
from kvferry.common.log import get_logger
from kvferry.common.wire import messages as m

logger = get_logger(__name__)


def zmq_url(hostport: str) -> str:
    """``host:port`` (``[v6]:port``) as a ZMQ endpoint; a URL as it is."""
    if "://" in hostport:
        return hostport
    host, _, port = hostport.rpartition(":")
    return f"tcp://{netutil.hostport(host, int(port))}" if host and port.isdigit() else f"tcp://{hostport}"


class ControllerLookup:
    """The scheduler's bounded lookups on the controller's reply port."""

    def __init__(self, cfg: KVFerryConfig, timeout: float) -> None:
        assert cfg.controller_reply_url is not None  # config.py requires it with the controller
        self.url = zmq_url(cfg.controller_reply_url)
        self.instance_id, self.timeout = cfg.lmcache_instance_id, timeout
        self.trust = zsock.trust_of(cfg)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._backoff = Backoff(f"controller {cfg.controller_reply_url}", logger)
        self.errors = 0

    def lookup(self, keys: Sequence[bytes]) -> m.LookupResponse | None:
        """The instance holding the longest prefix of `keys`; None when the controller is away."""
        if not keys or not self._backoff.up():
            return None
        if self._sock is None:
            self._sock = zsock.connect(self._ctx, zmq.DEALER, self.trust, self.url)
        try:
            # NOBLOCK: with the controller away (or refusing our secret) a send would wait for good.
            self._sock.send(m.encode(m.LookupRequest(instance_id=self.instance_id, keys=list(keys[:1 << 16]))),
                            zmq.NOBLOCK)
            if not self._sock.poll(int(self.timeout * 1000), zmq.POLLIN):
                raise TimeoutError(f"no answer within {self.timeout:g}s")
            reply = m.decode(self._sock.recv(), expect=m.LookupResponse)
        except (TimeoutError, zmq.ZMQError, m.MessageError) as e:
            self.errors += 1
            self._sock.close(linger=0)  # a late answer must not be read as the next one's
            self._sock = None
            self._backoff.failed("lookup", e, "P2P lookups skipped")
            return None
        self._backoff.ok()
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
