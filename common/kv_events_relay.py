"""vLLM's KV cache events, relayed onto a port that authenticates like every other kvferry port.

vLLM publishes its KV events (the prefixes each instance holds: they carry prompts' token ids) on
a plain ZMQ PUB socket and answers replays on a plain ROUTER: anyone who reaches them reads every
prompt's tokens. So vLLM's publisher stays on this machine (an ``ipc://`` path, or loopback), and
this relay, next to it, republishes on a PUB port and answers replays on a ROUTER port, both made
by common/zsock.py: with a cluster secret they speak CurveZMQ, and a subscriber without the secret
never completes the handshake, so it receives nothing. The proxy connects to the relay (its
``--kv-events URL=tcp://host:port,tcp://host:replay_port``) with the same secret.

Frames pass through unchanged (vLLM's (topic, seq, payload) triples and its replay answers, up to
the end marker); the relay checks only their shape and size, the proxy decodes them. One replay
is served at a time, each bounded by REPLAY_TIMEOUT_S. The relay runs on one daemon thread: the
connector starts it inside vLLM (config keys ``kv_events_relay_*``), or ``kvferry kv-events-relay``
runs it on its own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import zmq

from kvferry.common import zsock
from kvferry.common.log import RateLimitedLog, get_logger

logger = get_logger(__name__)

MAX_FRAME_BYTES = 16 << 20  # as the proxy's bound on one event batch (proxy/routing/kv_event_subscription.py)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY_FRAMES = 20_000
POLL_MS = 100


@dataclass(frozen=True)
class RelaySpec:
    """Where vLLM publishes (upstream, local) and where the relay listens (host, ports)."""

    upstream: str  # vLLM's --kv-events-config endpoint as a client dials it (ipc:// or tcp://127.0.0.1:port)
    upstream_replay: str | None  # its replay_endpoint, or None
    host: str  # kv_events_relay_host
    port: int  # kv_events_relay_port
    replay_port: int | None = None  # kv_events_relay_replay_port


def dialable(endpoint: str) -> str:
    """vLLM's bind endpoint as a client dials it: ``tcp://*:5557`` -> ``tcp://127.0.0.1:5557``."""
    for wild in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wild):
            return "tcp://127.0.0.1:" + endpoint[len(wild):]
    if endpoint.startswith("tcp://[::]:"):
        return "tcp://[::1]:" + endpoint[len("tcp://[::]:"):]
    return endpoint


class KVEventsRelay:
    """Relays one vLLM publisher (see the module docstring); start() binds, close() stops."""

    def __init__(self, spec: RelaySpec, trust: zsock.Trust) -> None:
        self.spec, self.trust = spec, trust
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bad = RateLimitedLog(logger, 60.0)
        self.relayed = 0  # frames published
        self.replays = 0  # replay requests answered

    def start(self) -> KVEventsRelay:
        """Binds both ports and starts relaying; a port that cannot be bound closes everything."""
        try:
            return self._start()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    def _start(self) -> KVEventsRelay:
        s = self.spec
        if s.replay_port is not None and s.upstream_replay is None:
            raise zsock.BindError("kv_events_relay_replay_port is set but vLLM has no replay_endpoint: set one "
                                  "in --kv-events-config (or drop kv_events_relay_replay_port)")
        self._pub = zsock.listen(self._ctx, zmq.PUB, self.trust, s.host, s.port, "config key kv_events_relay_port")
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._router = None
        if s.replay_port is not None:
            self._router = zsock.listen(self._ctx, zmq.ROUTER, self.trust, s.host, s.replay_port,
                                        "config key kv_events_relay_replay_port", max_bytes=1024)
        self._sub = self._plain(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(s.upstream)
        self._thread = threading.Thread(target=self._run, name="kvf-kv-events-relay", daemon=True)
        self._thread.start()
        logger.info("relaying vLLM's KV events from %s on %s%s, %s", s.upstream, zsock.tcp(s.host, s.port),
                    f" (replay {zsock.tcp(s.host, s.replay_port)})" if s.replay_port else "",
                    "with the cluster secret (CurveZMQ)" if self.trust.secret else "without a cluster secret")
        return self

    def _plain(self, kind: int) -> zmq.Socket:
        """A socket toward vLLM's own (plain, local) publisher."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if self._sub in ready:
                    self._forward()
                if self._router is not None and self._router in ready:
                    self._replay()
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.error("KV events relay stopped: %s", e)

    def _forward(self) -> None:
        for _ in range(1000):  # drain what is there, then look at replays again
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self._bad.warning("KV events relay: dropped a frame that is not (topic, seq, payload) from %s",
                                  self.spec.upstream)
                continue
            self._pub.send_multipart(frames, copy=False)
            self.relayed += 1

    def _replay(self) -> None:
        """One request [client, b"", start_seq]: vLLM's answer frames relayed back, to its end marker."""
        assert self._router is not None and self.spec.upstream_replay is not None
        msg = self._router.recv_multipart()
        if len(msg) != 3 or msg[1] != b"" or len(msg[2]) != 8:
            self._bad.warning("KV events relay: dropped a malformed replay request")
            return
        client = msg[0]
        dealer = self._plain(zmq.DEALER)
        try:
            dealer.connect(self.spec.upstream_replay)
            dealer.send_multipart([b"", msg[2]])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            for _ in range(MAX_REPLAY_FRAMES + 1):
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000) + 1):
                    return  # vLLM did not answer: neither does the relay (the proxy's probe times out)
                frames = dealer.recv_multipart()
                self._router.send_multipart([client, *frames], copy=False)
                if len(frames) == 4 and frames[2] == END_SEQ:  # b"", topic, seq, payload
                    self.replays += 1
                    return
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * POLL_MS / 1000 + REPLAY_TIMEOUT_S)
        self._ctx.destroy(linger=0)
