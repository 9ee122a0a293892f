"""The Mooncake store backend of the remote tier (``mooncakestore://host:port/``, docs/mooncake.md).

Mooncake's client (``mooncake.store.MooncakeDistributedStore``, from the
``mooncake-transfer-engine`` wheels) joins the pool that ``mooncake_master`` manages and lends it
``global_segment_size`` bytes of this process's memory; a value lives in some member's segment
and is read from there over TCP (or RDMA). A value is one object ``kvferry:<key hex>``: the serde
header, then the payload, as for lm://.

The C++ client blocks, for seconds and without letting other Python threads run, when its master
is gone (each call, and its destructor, retries the master), and it stays unusable after the
master restarts. So every call runs on a small thread pool (the caller waits at most its timeout);
a failed call marks the client broken; the next call first checks from Python that the master's
port answers (failing fast while it does not) and then joins with a fresh client. A broken client
is kept, never destroyed, as its destructor would block on the dead master."""

from __future__ import annotations

import atexit
import ctypes
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvferry.engine.remote.backend import PREFIX, Item, RemoteError
from kvferry.engine.remote.mooncake_settings import MAX_STAGING, MooncakeSettings
from kvferry.engine.remote.serde import HEADER_BYTES

NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
HEALTHY = 0  # health_check(): 1 not initialized (the master restarted), 2 master unreachable
_MIN_STAGING = 4 << 20


def _name(key: bytes) -> str:
    return (PREFIX + key.hex().encode()).decode()


class MooncakeClient:
    """This process's one client of a Mooncake master: its segment is the process's share of the
    pool, so the put thread, gets and lookups all use it."""

    _shared: dict[MooncakeSettings, MooncakeClient] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, s: MooncakeSettings) -> MooncakeClient:
        with cls._shared_lock:
            if s not in cls._shared:
                cls._shared[s] = cls(s)
            return cls._shared[s]

    def __init__(self, s: MooncakeSettings) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise RemoteError(f"{s.shown}: the Mooncake client cannot be imported ({e}): pip install "
                              "'kvferry[cpu]' (mooncake-transfer-engine-non-cuda) or 'kvferry[cuda]' "
                              "(mooncake-transfer-engine); it needs libibverbs1 (apt-get install "
                              "libibverbs1)") from None
        self.s, self._make = s, MooncakeDistributedStore
        self.replicate = ReplicateConfig()
        self.replicate.prefer_alloc_in_same_node = s.prefer_local_alloc
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvferry-mooncake")
        self._lock = threading.Lock()
        self._store: Any = None
        self._broken = False
        self._registered: set[tuple[int, int]] = set()

    def broken(self) -> None:
        """A call failed: probe the master and join afresh before the next one."""
        self._broken = True

    def _probe(self) -> None:
        host, _, port = self.s.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
        except OSError as e:
            raise RemoteError(f"{self.s.shown}: mooncake_master does not answer ({e})") from None

    def _ensure(self) -> Any:
        """The joined client; a fresh one when the old one failed (under self._lock)."""
        if self._store is not None and not self._broken and self._store.health_check() == HEALTHY:
            return self._store
        self._probe()
        if self._store is not None:
            _graveyard.append(self._store)
        self._store, self._registered, self._broken = None, set(), False
        store = self._make()
        s = self.s
        rc = store.setup(s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
                         s.protocol, s.device_name, s.master)
        if rc != 0:
            _graveyard.append(store)
            raise RemoteError(f"{s.shown}: joining the store failed (setup returned {rc}): is mooncake_master "
                              f"running at {s.master}, and the metadata server {s.metadata_server!r} reachable?")
        self._store = store
        return store

    def wait(self, what: str, timeout: float, future: Future) -> Any:
        """The call's result; RemoteError when it does not answer within `timeout` seconds (it
        finishes in the background)."""
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise RemoteError(f"{self.s.shown}: {what} did not answer within {timeout:.1f} s") from None

    def submit(self, fn: Callable[[Any], Any], buf: tuple[int, int] | None = None) -> Future:
        """fn(client) on the pool, with `buf` (address, size) registered with the client first."""
        return self._pool.submit(self._run, fn, buf)

    def _run(self, fn: Callable[[Any], Any], buf: tuple[int, int] | None) -> Any:
        with self._lock:
            store = self._ensure()
            if buf is not None and buf not in self._registered:
                if store.register_buffer(*buf) != 0:
                    raise RemoteError(f"{self.s.shown}: registering a {buf[1]} byte buffer failed")
                self._registered.add(buf)
        return fn(store)

    def forget(self, buf: tuple[int, int]) -> None:
        """Unregister `buf` before its memory is freed."""
        with self._lock:
            if buf in self._registered and self._store is not None:
                self._registered.discard(buf)
                self._store.unregister_buffer(buf[0])


class MooncakeBackend:
    """One user's (a thread's) view of the store: its own registered staging buffer, which values
    are copied through (Mooncake moves data only between registered memory)."""

    def __init__(self, s: MooncakeSettings, timeout: float) -> None:
        self.client, self.where = MooncakeClient.shared(s), s.shown
        self.timeout = min(timeout, s.transfer_timeout or timeout)
        self._buf: ctypes.Array | None = None
        self._reg: tuple[int, int] | None = None
        self._last: Future | None = None  # a call that timed out may still write into the buffer

    def _call(self, what: str, fn: Callable[[Any], Any], buf: tuple[int, int] | None = None) -> Any:
        self._last = self.client.submit(fn, buf)
        try:
            return self.client.wait(what, self.timeout, self._last)
        except RemoteError:
            self.client.broken()
            raise

    def _failed(self, message: str) -> RemoteError:
        self.client.broken()
        return RemoteError(f"{self.where}: {message}")

    def _staging(self, n: int) -> tuple[memoryview, tuple[int, int]]:
        if n > MAX_STAGING:
            raise RemoteError(f"{self.where}: a {n} byte value is over {MAX_STAGING} bytes: lower chunk_size")
        if self._buf is None or len(self._buf) < n:
            self.close()
            size = max(_MIN_STAGING, 1 << (n - 1).bit_length())
            self._buf = (ctypes.c_char * size)()
            self._reg = (ctypes.addressof(self._buf), size)
        assert self._reg is not None  # made with the buffer
        return memoryview(self._buf).cast("B"), self._reg

    def put_many(self, items: Sequence[Item]) -> None:
        view, reg = self._staging(sum(len(h) + len(p) for _, h, p in items))
        keys, ptrs, sizes, at = [], [], [], 0
        for key, head, payload in items:
            n = len(head) + len(payload)
            view[at:at + len(head)] = head
            view[at + len(head):at + n] = memoryview(payload).cast("B")
            keys.append(_name(key))
            ptrs.append(reg[0] + at)
            sizes.append(n)
            at += n
        codes = self._call("put",
                                 lambda st: st.batch_put_from(keys, ptrs, sizes, self.client.replicate), reg)
        failed = [c for c in codes if c < 0]
        if failed or len(codes) != len(keys):
            raise self._failed(f"{len(failed)} of {len(keys)} puts failed (codes {sorted(set(failed))})")

    def get(self, key: bytes, max_bytes: int) -> tuple[memoryview, memoryview] | None:
        view, reg = self._staging(max_bytes + 1)
        n = self._call("get", lambda st: st.get_into(_name(key), reg[0], max_bytes + 1), reg)
        if n == NOT_FOUND:
            return None
        if n < 0:
            raise self._failed(f"get failed (code {n}; a value over {max_bytes} bytes is one)")
        blob = memoryview(bytes(view[:n]))  # the staging buffer is reused by the next call
        return blob[:HEADER_BYTES], blob[HEADER_BYTES:]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        names = [_name(k) for k in keys]
        codes = self._call("lookup", lambda st: st.batch_is_exist(names))
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            raise self._failed(f"lookup failed (codes {sorted(set(codes))})")
        return [c == 1 for c in codes]

    def close(self) -> None:
        if self._buf is not None and self._reg is not None:
            if self._last is not None and not self._last.done():
                _orphans.append(self._buf)  # the client may still write into it: never freed
            else:
                self.client.forget(self._reg)
        self._buf = self._reg = None


_orphans: list[ctypes.Array] = []
_graveyard: list[Any] = []  # clients that failed: kept, as destroying one blocks on a dead master


def close_all() -> int:
    """Leave the store with every client of this process (while its master still answers: leaving
    a dead one blocks ~10 s per client); returns how many there were. For tests and tools that
    start and stop masters in one process; an engine's clients end with its process."""
    with MooncakeClient._shared_lock:
        clients = list(MooncakeClient._shared.values())
        MooncakeClient._shared.clear()
    stores = list(_graveyard)
    _graveyard.clear()
    for c in clients:
        with c._lock:
            if c._store is not None:
                stores.append(c._store)
            c._store, c._registered = None, set()
        c._pool.shutdown(wait=False)
    for store in stores:
        store.close()
    return len(stores)


def open_clients() -> int:
    """Clients of this process still joined to a store (a test that leaves one behind fails)."""
    with MooncakeClient._shared_lock:
        return sum(c._store is not None for c in MooncakeClient._shared.values()) + len(_graveyard)


def _never_destroy_at_exit() -> None:
    """At interpreter exit every client would be destroyed, and a client's destructor joins threads
    that wait on its master: with the master gone first (stopped, or crashed) the process would
    never exit. Each client keeps one reference more, so none is destroyed; the OS frees them."""
    with MooncakeClient._shared_lock:
        stores = [c._store for c in MooncakeClient._shared.values() if c._store is not None]
    for store in stores + _graveyard:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))


atexit.register(_never_destroy_at_exit)
