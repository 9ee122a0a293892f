"""What every remote-store backend shares (error, item shape, key prefix, error mapping), in a module
of its own so tiers/remote.py and redis_backend.py can both import it without a cycle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvferry.common.errors import UnavailableError

PREFIX = b"kvferry:"


class RemoteError(UnavailableError, RuntimeError):
    """The remote store failed, timed out or is misconfigured."""


Item = tuple[bytes, bytes, "bytes | memoryview"]  # key, serde header, payload


class Backend(Protocol):
    def put_many(self, items: Sequence[Item]) -> None: ...
    # (header, payload) or None; each part read up to max_bytes + 1 bytes at most, so a value larger
    # than the caller expects is seen to be (and refused) without its size being allocated.
    def get(self, key: bytes, max_bytes: int) -> tuple[memoryview | bytes, memoryview | bytes] | None: ...
    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...
    def close(self) -> None: ...


def hostports(rest: str, url: str) -> list[tuple[str, int]]:
    """[(host, port)...] of a comma-separated list, or RemoteError naming the bad part."""
    out = []
    for part in rest.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RemoteError(f"remote_url {url!r}: {part!r} is not host:port")
        out.append((host, int(port)))
    return out


class Mapped:
    """Runs a client call, turning the client's own errors into RemoteError."""

    errors: tuple[type[Exception], ...] = ()
    where = ""

    def _do(self, fn, *args):  # noqa: ANN001, ANN202
        try:
            return fn(*args)
        except self.errors as e:
            raise RemoteError(f"{self.where}: {type(e).__name__}: {e}") from None
