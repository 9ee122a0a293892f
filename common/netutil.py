"""Small network helpers shared by the controller, the engine, tests, benchmarks and the launcher
(stdlib only)."""

from __future__ import annotations

import random
import socket

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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
