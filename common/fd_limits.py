"""The process's descriptor limit (`ulimit -n`): read it, and raise its soft value toward the
hard one, for the servers that size their connection caps from it (the proxy's and the
controller's front doors, kvferry-server)."""

from __future__ import annotations

import resource

UNLIMITED = 1 << 30  # what an unlimited soft limit counts as


def fd_limit() -> int:
    """The soft RLIMIT_NOFILE; UNLIMITED when there is none."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return UNLIMITED if soft == resource.RLIM_INFINITY else soft


def raise_fd_limit(want: int) -> int:
    """Raise the soft limit to `want` where it is lower (never past the hard limit; a refusal is
    not an error: the limit stays); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            except (OSError, ValueError):
                pass
    return fd_limit()
