"""Which backend a ``remote_url`` opens: Redis (plain, TLS, Sentinel), kvferry-server (``lm://``) or a
Mooncake store (``mooncakestore://``); LMCache's ``infinistore://`` is refused with the reason."""

from __future__ import annotations

from collections.abc import Sequence

from kvferry.common.config import REMOTE_SCHEMES as SCHEMES
from kvferry.common.redact import redact_url
from kvferry.common.secret import ClusterSecret
from kvferry.engine.remote.backend import Backend, Item, Mapped, RemoteError, hostports
from kvferry.engine.remote.lm.lm_client import LMClient, LMError
from kvferry.engine.remote.mooncake_settings import SCHEME as MOONCAKE
from kvferry.engine.remote.mooncake_settings import MooncakeSettings, from_config
from kvferry.engine.remote.redis_backend import RedisSettings, open_redis, parse_redis_url
from kvferry.engine.remote.serde import HEADER_BYTES


class LMBackend(Mapped):
    errors = (LMError,)

    def __init__(self, host: str, port: int, timeout: float, secret: ClusterSecret | None = None) -> None:
        # With the cluster secret, every connection proves it (and wants the server's proof).
        self.client, self.where = LMClient(host, port, timeout, secret), "kvferry-server"  # LMError names the URL

    def put_many(self, items: Sequence[Item]) -> None:
        self._do(self.client.put_many, [(key, (head, payload)) for key, head, payload in items])

    def get(self, key: bytes, max_bytes: int) -> tuple[memoryview, memoryview] | None:
        blob = self._do(self.client.get, key, max_bytes)  # a larger reply is refused unread (LMError)
        return None if blob is None else (blob[:HEADER_BYTES], blob[HEADER_BYTES:])

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._do(self.client.exists, keys)

    def close(self) -> None:
        self.client.close()


def parse_url(url: str) -> tuple[str, list[tuple[str, int]], str]:
    """(scheme, [(host, port)...], service) of a remote_url, or RemoteError naming the fix (and never
    showing a password)."""
    scheme, _, rest = url.partition("://")
    if scheme == "infinistore":
        raise RemoteError(f"remote_url {redact_url(url)!r}: InfiniStore speaks RDMA only and kvferry has no "
                          "InfiniStore client: use mooncakestore://host:port (TCP or RDMA), redis://host:port "
                          "or lm://host:port")
    if scheme not in SCHEMES:
        raise RemoteError(f"remote_url {redact_url(url)!r}: scheme {scheme!r} is not supported by kvferry: use "
                          "redis://host:port, rediss://host:port (TLS), redis-sentinel://host:port,host:port,... "
                          "lm://host:port (kvferry-server) or mooncakestore://host:port (mooncake_master)")
    if scheme in ("redis", "rediss", "redis-sentinel"):
        u = parse_redis_url(url)
        return scheme, u.nodes, u.service
    nodes = hostports(rest.partition("/")[0], redact_url(url))
    if len(nodes) != 1:
        raise RemoteError(f"remote_url {redact_url(url)!r}: {scheme}:// takes one host:port")
    return scheme, nodes, ""


def open_backend(url: str, timeout: float, secret: ClusterSecret | None = None,
                 redis: RedisSettings | None = None, mooncake: MooncakeSettings | None = None) -> Backend:
    """A connection to `url` (connecting lazily where the client allows); `secret` (the cluster
    secret, `zsock.trust_of(cfg).secret`) authenticates lm:// connections, `redis` (credentials and
    TLS files, redis_settings.from_config) Redis ones, `mooncake` (mooncake_settings.from_config;
    defaults from the URL alone) Mooncake ones."""
    scheme, nodes, _ = parse_url(url)
    if scheme == "lm":
        return LMBackend(*nodes[0], timeout, secret)
    if scheme == MOONCAKE:
        from kvferry.common.config import KVFerryConfig
        from kvferry.engine.remote.mooncake_backend import MooncakeBackend

        settings = mooncake or from_config(KVFerryConfig(remote_url=url))
        assert settings is not None  # a mooncakestore:// URL always has settings
        return MooncakeBackend(settings, timeout)
    return open_redis(url, timeout, redis)
