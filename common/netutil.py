"""Small network helpers shared by the controller, the engine, the proxy, tests, benchmarks and
the launcher (stdlib only): free ports, and host names and addresses as kvferry writes and reads
them, IPv4 and IPv6 alike.

One place formats ``host:port`` (an IPv6 address goes in brackets: ``[::1]:8000``), resolves a
name in both families, and picks the address a port is *advertised* on when it is bound to every
interface: every port has a bind address and an advertised one, the address peers on other
machines dial (docs/deploy.md, "Addresses: bind and advertise").
"""

from __future__ import annotations

import ipaddress
import random
import socket
import threading

from kvferry.common.log import get_logger

logger = get_logger(__name__)

_handed_out: set[int] = set()
_rng = random.SystemRandom()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now, below the OS's ephemeral range.

    A port the OS picks for bind(0) comes from the ephemeral range, which every outgoing
    connection draws from too: between this call and the server's own bind, a client socket
    may take it ("Address already in use"). Ports below that range are only ever taken by a
    bind. Never the same port twice in one process."""
    lo, _ = _ephemeral_range()
    if lo > 12000:
        for _ in range(200):
            port = _rng.randrange(10000, lo)
            if port not in _handed_out and port_is_free(port, host):
                _handed_out.add(port)
                return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((unbracket(host), 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    host = unbracket(host)
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def tcp_listener(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket on `host`'s first address in either family: an IPv6
    address binds AF_INET6, "::" every interface; OSError (gaierror included) when it cannot."""
    infos = socket.getaddrinfo(unbracket(host) or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
    except OSError:
        s.close()
        raise
    return s


def _family(host: str) -> int:
    return socket.AF_INET6 if is_ipv6(host) else socket.AF_INET

WILDCARDS = ("", "*", "0.0.0.0", "::")

_logged: set[tuple[str, str]] = set()
_log_lock = threading.Lock()


def is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False


def unbracket(host: str) -> str:
    """``[::1]`` -> ``::1``; anything else as it is."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def bracket(host: str) -> str:
    """`host` as it goes before ``:port`` in an endpoint or URL: an IPv6 address in brackets."""
    host = unbracket(host)
    return f"[{host}]" if is_ipv6(host) else host


def hostport(host: str, port: int) -> str:
    return f"{bracket(host)}:{port}"


def local_host(host: str) -> str:
    """Where this machine reaches a port bound on `host`: a wildcard on loopback (``::`` on ``::1``)."""
    host = unbracket(host)
    if host in WILDCARDS:
        return "::1" if host == "::" else "127.0.0.1"
    return host


def http_url(host: str, port: int, scheme: str = "http") -> str:
    """``http://host:port``; a wildcard bind address is reached on loopback."""
    return f"{scheme}://{hostport(local_host(host), port)}"


def resolve(host: str) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6, in the resolver's order, no repeats);
    an address stays itself; [] when it does not resolve."""
    host = unbracket(host)
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return [host]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in out:
            out.append(addr)
    return out


def is_loopback(host: str) -> bool:
    """Is `host` this machine's loopback, and only that? kvferry's one answer (what may listen
    without a secret or key, what a peer elsewhere cannot dial):

    - True: any 127.0.0.0/8 address, ``::1`` (bracketed, with a ``%zone``, or IPv4-mapped
      ``::ffff:127.x.y.z`` alike), and the name ``localhost`` (any case, trailing dot or not).
    - False: a wildcard (``""``, ``"*"``, ``0.0.0.0``, ``::``): a bind there listens on every
      interface; every other address; every other name.

    No DNS lookup: a name is judged by its text, so the answer cannot change with /etc/hosts or
    a resolver, and a name that happens to resolve to loopback counts as beyond it (the safe side:
    a warning, or a refusal under require_cluster_secret; advertised() separately warns about a
    name that resolves to loopback only)."""
    host = unbracket(host.strip())
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def _routed_address(family: int) -> str | None:
    """The source address this machine would use toward the outside (no packet is sent: a UDP
    socket's connect only asks the routing table); None without such a route."""
    target = ("192.0.2.1", 9) if family == socket.AF_INET else ("2001:db8::1", 9)  # documentation ranges
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if is_loopback(addr) else str(addr)


def machine_address(prefer_ipv6: bool = False) -> str | None:
    """This machine's address for peers on other hosts: the host name's first address that is not
    loopback, else the address of the default route; None where there is none (then loopback is
    all there is)."""
    for addr in resolve(socket.gethostname()):
        if not is_loopback(addr) and is_ipv6(addr) == prefer_ipv6:
            return addr
    families = (socket.AF_INET6, socket.AF_INET) if prefer_ipv6 else (socket.AF_INET, socket.AF_INET6)
    for fam in families:
        routed = _routed_address(fam)
        if routed is not None:
            return routed
    return None


def advertised(bind: str | None, advertise: str | None, what: str, default: str = "127.0.0.1") -> str:
    """The address peers dial for a port bound on `bind`: `advertise` when given; `bind` when it
    is one address; for a wildcard bind (0.0.0.0, ::), this machine's address (logged once, with
    the key that overrides it); `default` when neither is given. A name that resolves only to
    loopback while this machine has other addresses is logged as a warning: peers elsewhere
    cannot dial it."""
    if advertise:
        host = unbracket(advertise)
        _warn_loopback_name(host, what)
        return host
    if not bind:
        return default
    host = unbracket(bind)
    if host in WILDCARDS:
        found = machine_address(prefer_ipv6=host == "::")
        chosen = found or ("::1" if host == "::" else "127.0.0.1")
        _log_once(what, chosen, f"{what} binds every interface ({bind}) and has no advertised address: peers "
                  f"are told {chosen} (this machine's {'address' if found else 'loopback: it has no other'}); "
                  "set the advertise key to choose")
        return chosen
    _warn_loopback_name(host, what)
    return host


def _warn_loopback_name(host: str, what: str) -> None:
    """A host *name* (not an address) that resolves to loopback only, on a machine that has other
    addresses: Debian's /etc/hosts maps the host name to 127.0.1.1, a classic way to bind loopback
    without meaning to."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return
    except ValueError:
        pass
    if is_loopback(host):  # localhost: meant
        return
    addrs = resolve(host)
    if addrs and all(is_loopback(a) for a in addrs):
        other = machine_address()
        if other is not None:
            _log_once(what, host, f"{what}: {host!r} resolves to loopback only ({', '.join(addrs)}) while this "
                      f"machine has other addresses ({other}): peers on other hosts cannot reach it; give an "
                      "address (or fix /etc/hosts)", warn=True)


def _log_once(what: str, key: str, msg: str, warn: bool = False) -> None:
    with _log_lock:
        if (what, key) in _logged:
            return
        _logged.add((what, key))
    (logger.warning if warn else logger.info)(msg)
