"""Every kvferry ZMQ socket is made here: a bound on every frame, no linger, and the cluster secret.

With a secret, every socket speaks CurveZMQ (pyzmq's bundled libzmq and libsodium): both key
pairs are derived from the secret (common/secret.py) and the server's public key never leaves
the process, so a peer without the secret cannot complete the handshake. libzmq drops such a
peer before a single frame reaches kvferry; a peer that has it is authenticated both ways and
its traffic encrypted. Without a secret a socket speaks plain ZMQ, as LMCache's do: fine on
loopback; a port bound beyond loopback logs one warning naming ``cluster_secret``, or fails when
``require_cluster_secret`` is set: who may reach a port is decided by where it listens and
whether it has the secret, nothing else (docs/security.md).
"""

from __future__ import annotations

import errno
import functools
import threading
from dataclasses import dataclass
from typing import TypeVar

import zmq
from zmq.utils import z85

from kvferry.common import netutil as net
from kvferry.common.config import KVFerryConfig
from kvferry.common.errors import ConfigurationError, UnavailableError
from kvferry.common.log import get_logger
from kvferry.common.netutil import is_loopback
from kvferry.common.secret import ClusterSecret
from kvferry.common.secret import load as load_secret
from kvferry.common.wire import messages as m

# A zmq.asyncio context makes asyncio sockets, a plain one plain sockets.
SocketT = TypeVar("SocketT", bound=zmq.Socket)

logger = get_logger(__name__)

# A hard cap far above any valid frame; decode() rejects, with a reply, what lies between.
MAX_BYTES = 4 * m.MAX_FRAME_BYTES


class ExposureError(ConfigurationError, RuntimeError):
    """A port would listen beyond loopback without a cluster secret while one is required."""


@dataclass(frozen=True)
class Trust:
    """What a component needs to open its sockets: the secret (None: plain ZMQ), and whether a
    port beyond loopback without one is an error rather than a warning."""

    secret: ClusterSecret | None = None
    require: bool = False


PLAIN = Trust()

_warned: set[str] = set()
_warn_lock = threading.Lock()


@functools.lru_cache(maxsize=16)
def curve_keys(secret: ClusterSecret, role: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 CurveZMQ keys for `role` ("server" or "client"), derived from the secret."""
    sk = z85.encode(secret.key(f"curvezmq-{role}-v1"))
    return zmq.curve_public(sk), sk


def check_exposure(host: str, what: str, trust: Trust, fix: str = "Set cluster_secret_file") -> None:
    """A ZMQ port on `host`: see warn_exposed. `what` names the port's key or flag."""
    warn_exposed(host, what, trust.secret is not None, trust.require, "a cluster secret",
                 "any host that reaches it can use it (for a NIXL port: read and write its registered memory)", fix)


def warn_exposed(host: str, what: str, protected: bool, require: bool, protection: str, risk: str, fix: str) -> None:
    """The one rule for anything kvferry listens on (ZMQ ports, admin HTTP APIs): on loopback, or
    `protected`, nothing; else one warning per `what` per process, or ExposureError when `require`
    (require_cluster_secret / --require-cluster-secret). `fix` starts a sentence."""
    if protected or is_loopback(host):
        return
    msg = (f"{what} listens on {host or '*'}, beyond loopback, without {protection}: {risk}. {fix}, "
           "or listen on 127.0.0.1")
    if require:
        raise ExposureError(msg + " (require_cluster_secret / --require-cluster-secret is set)")
    with _warn_lock:
        if what in _warned:
            return
        _warned.add(what)
    logger.warning("SECURITY: %s", msg)


def socket(ctx: zmq.Context[SocketT], kind: int, trust: Trust, *, server: bool,
           max_bytes: int = MAX_BYTES) -> SocketT:
    """A socket with no linger, a frame bound, and CurveZMQ when `trust` has a secret."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IPV6, 1)  # both families: IPv6 endpoints work, IPv4 ones still do
    s.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if trust.secret is not None:
        spub, ssec = curve_keys(trust.secret, "server")
        if server:
            s.curve_secretkey, s.curve_publickey, s.curve_server = ssec, spub, True
        else:
            cpub, csec = curve_keys(trust.secret, "client")
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = spub, cpub, csec
    return s


def listen(ctx: zmq.Context[SocketT], kind: int, trust: Trust, host: str, port: int, what: str,
           max_bytes: int = MAX_BYTES) -> SocketT:
    """A server socket bound to tcp://host:port; OSError-like failures name `what` and the fix."""
    check_exposure(host, what, trust)
    s = socket(ctx, kind, trust, server=True, max_bytes=max_bytes)
    try:
        s.bind(tcp(host, port))
    except zmq.ZMQError as e:
        s.close()
        raise BindError(f"{what}: cannot listen on {net.hostport(host, port)}: "
                        f"{bind_cause(e.errno, host, port)}") from None
    return s


def bind_cause(err: int | None, host: str, port: int) -> str:
    """Why a bind failed, in words that name the fix (the errno decides; ZMQ's own text follows)."""
    reason = errno.errorcode.get(err or 0, "")
    text = zmq.strerror(err) if err else "unknown error"
    if err == errno.EADDRINUSE:
        return f"port {port} is in use ({text}): choose another port, or stop what holds it"
    if err == errno.EADDRNOTAVAIL:
        return (f"{host} is not an address of this machine ({text}): bind one of its own addresses "
                "(or 0.0.0.0 / :: for every interface) and advertise the address peers dial")
    if err in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
        return f"this machine does not support {host}'s address family ({text})"
    if err in (errno.EACCES, errno.EPERM):
        return f"not allowed to bind port {port} ({text}): use a port above 1023 or run with the right to"
    if err == errno.ENODEV or err == errno.EINVAL:
        return f"{host!r} is not an address or interface this machine has ({text})"
    return f"{text}{' (' + reason + ')' if reason else ''}"


def connect(ctx: zmq.Context[SocketT], kind: int, trust: Trust, url: str,
            max_bytes: int = MAX_BYTES) -> SocketT:
    """A client socket connected to `url` (tcp://host:port, or ipc://)."""
    s = socket(ctx, kind, trust, server=False, max_bytes=max_bytes)
    s.connect(url)
    return s


class BindError(UnavailableError, RuntimeError):
    """A port could not be bound; the message names its key."""


def zmq_host(host: str) -> str:
    """`host` as a ZMQ tcp endpoint takes it: "*" for every interface, a name resolved to its
    first address in either family (ZMQ binds to interface names or addresses, not host names
    like "localhost"; IPv4 preferred), an IPv6 address in brackets."""
    host = net.unbracket(host)
    if host in net.WILDCARDS:
        return "*"
    # IPv4 first when a name has both (as gethostbyname did: "localhost" keeps meaning 127.0.0.1
    # on both ends); a name with only IPv6 addresses gets its first.
    addrs = sorted(net.resolve(host), key=net.is_ipv6)
    return net.bracket(addrs[0] if addrs else host)


def tcp(host: str, port: int) -> str:
    """``tcp://host:port`` for ZMQ (``tcp://[::1]:5555`` for IPv6)."""
    return f"tcp://{zmq_host(host)}:{port}"


def trust_of(cfg: KVFerryConfig) -> Trust:
    """The Trust a component inside vLLM gets from its config (the secret is stretched once)."""
    return Trust(load_secret(cfg.cluster_secret, cfg.cluster_secret_file), cfg.require_cluster_secret)
