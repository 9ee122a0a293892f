"""How many connections kvferry-server can hold: the connection cap fitted to `ulimit -n`, and a
spare descriptor to refuse peers with when accept() runs out."""

from __future__ import annotations

import os

from kvferry.common.fd_limits import fd_limit, raise_fd_limit
from kvferry.common.log import get_logger

logger = get_logger("kvferry.launcher.lm_server")  # its lines read as the server's

DEFAULT_MAX_CONNECTIONS = 1024
FD_RESERVE = 32  # descriptors kept for everything but client connections: listener, epoll, logs, the spare


def open_spare() -> int | None:
    """A descriptor held in reserve: closed when accept() runs out, so waiting peers can be told no."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def fit_connections(wanted: int | None) -> int:
    """The connection cap: `wanted`, or the default lowered to what `ulimit -n` allows (raising
    the soft limit toward the hard one first). An explicit cap above the limit is kept, with a
    warning: beyond the limit new connections are refused until descriptors free up."""
    cap = DEFAULT_MAX_CONNECTIONS if wanted is None else wanted
    room = max(1, raise_fd_limit(cap + FD_RESERVE) - FD_RESERVE)
    if cap <= room:
        return cap
    if wanted is not None:
        logger.warning("kvferry-server: --max-connections %d is more than `ulimit -n` %d allows (%d); past that, "
                       "new connections are refused until descriptors free up: raise `ulimit -n`", cap, fd_limit(),
                       room)
        return cap
    logger.warning("kvferry-server: --max-connections lowered to %d to fit `ulimit -n` %d; raise `ulimit -n` "
                   "for more", room, fd_limit())
    return room
