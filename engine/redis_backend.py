"""Redis backends of the remote tier: one bounded connection to a Redis server or to the master
a Sentinel set names (kept apart from remote_store.py so Redis auth and TLS evolve on their own)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvferry.engine.remote_base import PREFIX, Item, Mapped, RemoteError


class RedisBackend(Mapped):
    def __init__(self, client: object, where: str) -> None:
        import redis

        self.r, self.where, self.errors = client, where, (redis.RedisError,)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float) -> RedisBackend:
        import redis

        return cls(redis.Redis(host=host, port=port, **_redis_kwargs(timeout)), f"redis://{host}:{port}")

    def put_many(self, items: Sequence[Item]) -> None:
        pipe = self.r.pipeline(transaction=False)  # one round trip for the batch
        for key, head, payload in items:
            k = PREFIX + key
            pipe.mset({k + b":h": head, k + b":d": payload})
        self._do(pipe.execute)

    def get(self, key: bytes) -> tuple[bytes, bytes] | None:
        k = PREFIX + key
        head, payload = self._do(self.r.mget, [k + b":h", k + b":d"])
        return None if head is None or payload is None else (head, payload)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        return [v is not None for v in self._do(self.r.mget, [PREFIX + k + b":h" for k in keys])]

    def close(self) -> None:
        self.r.close()


def _redis_kwargs(timeout: float) -> dict:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries inside redis-py: one bounded attempt, the tier's back-off decides when to try again.
    return {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": Retry(NoBackoff(), 0)}


def sentinel_backend(url: str, nodes: list[tuple[str, int]], service: str, timeout: float) -> RedisBackend:
    from redis.sentinel import Sentinel

    service = service or os.environ.get("REDIS_SERVICE_NAME", "")
    sentinel = Sentinel(nodes, sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": timeout},
                        **_redis_kwargs(timeout))
    if not service:
        masters: dict = {}
        for s in sentinel.sentinels:
            try:
                masters = s.sentinel_masters()
                break
            except Exception:  # noqa: BLE001, S112 - try the next Sentinel
                continue
        else:
            raise RemoteError(f"{url}: no Sentinel answered")
        if len(masters) != 1:
            raise RemoteError(f"{url}: the Sentinels monitor {len(masters)} masters ({', '.join(masters) or 'none'})"
                              f": name one as {url}/<service> or in $REDIS_SERVICE_NAME")
        service = next(iter(masters))
    return RedisBackend(sentinel.master_for(service, **_redis_kwargs(timeout)), f"{url} (service {service})")


