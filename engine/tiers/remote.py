"""The remote tier: a store shared by many instances (``remote_url``), behind bounded calls.

Backends (one connection each, blocking, every call bounded by a timeout):

- ``redis://host:port``: a value is two Redis keys, ``kvferry:<key>:h`` (the serde header) and
  ``kvferry:<key>:d`` (the payload), written with one MSET and read with one MGET, so the chunk's
  memory goes to the socket as it is.
- ``redis-sentinel://h1:p1,h2:p2,...[/service]``: the Sentinels name the current master (asked
  again after every connection failure, so a failover is followed). The service is the URL's
  path, else ``$REDIS_SERVICE_NAME``, else the one master the Sentinels monitor.
- ``lm://host:port``: kvferry-server (launcher/lm_server.py); the value is header + payload.
- ``mooncakestore://host:port``: a Mooncake store (engine/remote/mooncake_backend.py); the value is
  header + payload, one object.

:class:`RemoteTier` turns every failure into a miss: a call that fails or times out is counted,
warned about at most every 10 s, and the store is skipped for a back-off (1 s, doubling to 30 s)
so a dead store costs requests nothing. Puts run on a background thread with a bounded queue;
when the store cannot keep up, puts are dropped (counted), never waited for.
"""


from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvferry.common.backoff import Backoff
from kvferry.common.counters import Counters
from kvferry.common.errors import BadDataError
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.redact import redact_url
from kvferry.common.secret import ClusterSecret
from kvferry.common.wire.chunk_mac import for_secret
from kvferry.engine.remote.backend import PREFIX, Backend, RemoteError  # noqa: F401 - PREFIX re-exported
from kvferry.engine.remote.backends import open_backend
from kvferry.engine.remote.mooncake_settings import MooncakeSettings
from kvferry.engine.remote.redis_backend import RedisSettings
from kvferry.engine.remote.serde import HEADER_BYTES, ForgedError, Serde, SerdeError, max_stored
from kvferry.engine.tiers.interface import LoadRequest

logger = get_logger(__name__)


@dataclass
class RemoteCounters(Counters):
    """Exported as ``remote_<name>``, the stores as ``stored_<name>|remote`` (kvferry:cache_*)."""

    errors: int = 0
    corrupt: int = 0
    forged: int = 0
    put_dropped: int = 0
    get_bytes: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"remote_errors": self.errors, "remote_corrupt": self.corrupt, "remote_forged": self.forged,
                "remote_put_dropped": self.put_dropped, "stored_chunks|remote": self.stored_chunks,
                "stored_bytes|remote": self.stored_bytes, "remote_get_bytes": self.get_bytes}


class RemoteTier:
    """One process's use of the remote store: lookups, gets, and queued puts, all failure-proof.

    Whatever the store answers, the caller sees a hit or a miss: a failed call, or a lookup
    answered for another number of keys, is ``remote_errors`` (and a back-off); a value that is not
    this reader's chunk (damaged, oversize, foreign format or layout) is ``remote_corrupt``; with
    the cluster secret, one whose MAC is missing or wrong (forged, or another key's or rank's) is
    ``remote_forged``. Each rejection is a rate-limited warning, and a get never reads more than
    the expected chunk's size from the store."""

    # Small chunks share a round trip; large ones go alone (Redis copies a large value that is not
    # first in its input buffer, so pipelining them costs more than the round trips it saves).
    BATCH_BYTES = 4 << 20

    def __init__(self, url: str, timeout: float, serde: Serde | None = None, rank: int = 0,
                 max_queued_bytes: int = 512 << 20, secret: ClusterSecret | None = None,
                 redis: RedisSettings | None = None, mooncake: MooncakeSettings | None = None) -> None:
        # self.url is for messages (its password redacted); the real one only connects.
        self._url, self.url, self.timeout, self.serde = url, redact_url(url), timeout, serde
        self.redis = redis  # Redis credentials and TLS files (redis_settings.from_config)
        self.mooncake = mooncake  # the Mooncake client's settings (mooncake_settings.from_config)
        self.secret = secret  # the cluster secret (zsock.trust_of(cfg).secret): lm:// connections prove it
        self.suffix = b"" if rank == 0 else b"@%d" % rank  # each TP rank stores its own shard
        self.max_queued_bytes = max_queued_bytes
        # With the secret, chunks are tagged and checked with a keyed MAC (engine/remote/serde.py).
        self.mac = for_secret(secret)
        self.counters = RemoteCounters()
        self._backoff = Backoff(f"remote store {self.url}", logger)
        self._warn = RateLimitedLog(logger)
        self._backend: Backend | None = None
        self._lock = threading.Lock()  # counters and back-off are shared with the put thread
        self._queue: queue.Queue = queue.Queue()  # its writer thread starts with the first put
        self._queued = 0
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()

    # ---- failure handling ----
    def _failed(self, what: str, e: Exception, backend: Backend | None) -> Backend | None:
        """Count and back off after `e`; returns the connection that failed (`backend`, the
        caller's own: the put thread has one, gets and lookups another) to keep using, or None
        (closed) when `e` is not the client's own error, as the connection may be mid-reply."""
        with self._lock:
            self.counters.errors += 1
        if not isinstance(e, RemoteError) and backend is not None:
            try:
                backend.close()
            except Exception:  # noqa: BLE001, S110 - it is dropped either way
                pass
            backend = None
        self._backoff.failed(what, e if isinstance(e, RemoteError) else f"{type(e).__name__}: {e}",
                             "treating it as empty")
        return backend

    def _rejected(self, key: bytes, e: Exception) -> None:
        forged = isinstance(e, ForgedError)
        with self._lock:
            if forged:
                self.counters.forged += 1
            else:
                self.counters.corrupt += 1
        why = e if isinstance(e, SerdeError) else f"{type(e).__name__}: {e}"
        self._warn.warning("remote store %s: chunk %s rejected (a miss, recomputed): %s", self.url,
                           key.hex()[:12], why)

    def _conn(self) -> Backend:
        if self._backend is None:
            self._backend = open_backend(self._url, self.timeout, self.secret, self.redis, self.mooncake)
        return self._backend

    # ---- calls ----
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of `keys` the store holds: one answer per key, all False when the store is down,
        slow, or answers for another number of keys."""
        if not keys or not self._backoff.up():
            return [False] * len(keys)
        try:
            got = self._conn().exists([k + self.suffix for k in keys])
            if len(got) != len(keys):
                raise RemoteError(f"answered {len(got)} lookups for {len(keys)} keys")
            got = [v is True for v in got]
        except Exception as e:  # noqa: BLE001 - any failure of the store is a miss, never the scheduler's
            self._backend = self._failed("lookup", e, self._backend)
            return [False] * len(keys)
        self._backoff.ok()
        return got

    def get(self, key: bytes, tokens: int, nbytes: int) -> torch.Tensor | None:
        """The chunk, or None (missing, damaged, forged, store down or slow); reads no more than
        an `nbytes` chunk can take."""
        assert self.serde is not None
        if not self._backoff.up():
            return None
        stored_key = key + self.suffix
        try:
            got = self._conn().get(stored_key, HEADER_BYTES + max_stored(nbytes))
        except Exception as e:  # noqa: BLE001 - any failure of the store is a miss, never the worker's
            self._backend = self._failed("get", e, self._backend)
            return None
        self._backoff.ok()
        if got is None:
            return None
        try:
            data = self.serde.decode(got[0], got[1], tokens, nbytes, self.mac, stored_key)
        except (BadDataError, ValueError) as e:  # SerdeError/ForgedError, or bytes torch cannot view: a miss
            self._rejected(key, e)
            return None
        with self._lock:
            self.counters.get_bytes += len(got[1])
        return data

    def put(self, key: bytes, data: torch.Tensor, tokens: int) -> bool:
        """Queue the chunk for the store; False (dropped) when the queue is full or the store down."""
        nbytes = data.numel()
        with self._lock:
            if not self._backoff.up():
                self.counters.put_dropped += 1
                return False
            full = self._queued + nbytes > self.max_queued_bytes
            if full:
                self.counters.put_dropped += 1
            else:
                self._queued += nbytes
                self._idle.clear()
        if full:
            self._warn.warning("remote store %s: put queue full (%d MiB): chunk not stored remotely", self.url,
                               self.max_queued_bytes >> 20)
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvferry-remote-put", daemon=True)
            self._thread.start()
        self._queue.put((key, data, tokens))
        return True

    def _run(self) -> None:
        backend: Backend | None = None  # the put thread's own connection
        stop = False
        while not stop:
            batch, nbytes = [], 0
            item = self._queue.get()
            # Whatever else is queued goes in the same round trip.
            while item is not None:
                batch.append(item)
                nbytes += item[1].numel()
                if nbytes >= self.BATCH_BYTES:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            stop = item is None
            if not batch:
                continue
            try:
                if not self._backoff.up():
                    with self._lock:
                        self.counters.put_dropped += len(batch)
                    continue
                assert self.serde is not None  # set when the tier opened
                items = [(key + self.suffix, *self.serde.encode(data, tokens, self.mac, key + self.suffix))
                         for key, data, tokens in batch]
                if backend is None:
                    backend = open_backend(self._url, self.timeout, self.secret, self.redis, self.mooncake)
                backend.put_many(items)
                self._backoff.ok()
                with self._lock:
                    self.counters.stored_chunks += len(items)
                    self.counters.stored_bytes += sum(len(h) + len(p) for _, h, p in items)
            except Exception as e:  # noqa: BLE001 - the put thread must outlive any one batch
                backend = self._failed("put", e, backend)
            finally:
                with self._lock:
                    self._queued -= nbytes
                    if self._queued == 0:
                        self._idle.set()
        if backend is not None:
            backend.close()

    def flush(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until every queued put is done; True if they are."""
        return self._idle.wait(timeout)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return self.counters.as_dict()

    # ---- the Tier interface (engine/tiers/interface.py) ----
    name = "remote"

    def prefetch(self, req: LoadRequest) -> None:
        pass

    def fetch(self, key: bytes, tokens: int, nbytes: int) -> torch.Tensor | None:
        return self.get(key, tokens, nbytes)

    def store(self, key: bytes, data: torch.Tensor, tokens: int) -> None:
        self.put(key, data, tokens)

    def remove(self, key: bytes) -> None:
        """The store is shared: what one instance evicts locally another may still want."""

    def take_lost(self) -> set[bytes]:
        return set()

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            if not self.flush(timeout):
                logger.warning("remote store %s: %d MiB of puts still queued after %.0f s; dropped", self.url,
                               self._queued >> 20, timeout)
            self._queue.put(None)
            self._thread.join(timeout=self.timeout + 1)
        if self._backend is not None:
            self._backend.close()
