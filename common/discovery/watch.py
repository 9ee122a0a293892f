"""A proxy's view of discovery in etcd: list the prefix in pages, then watch it.

Whatever sits under the prefix costs bounded work: each key is verified once per revision (the
result is kept, not the value), keys longer than MAX_KEY_BYTES are not read at all, at most
MAX_ENTRIES keys are tracked, and a bad key is logged once (its first 80 characters) while it
exists, for at most MAX_LOGGED keys; every rejection is counted. The view handed on is rebuilt
from the verified entries only, and handed on only when it changed (a record's renewal changes
nothing a proxy uses); a record is dropped once its signed expiry passes (a timer, not the next
event).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.common.discovery.entries import MAX_KEY_BYTES, Entry, Rejected, Snapshot, shown, verify
from kvferry.common.discovery.etcd import KV, WatchIdle
from kvferry.common.discovery.target import Target, connect
from kvferry.common.log import get_logger
from kvferry.common.secret import ClusterSecret
from kvferry.common.wire import messages as m

logger = get_logger(__name__)

WATCH_IDLE_S = 60.0  # a quiet watch is re-listed and re-opened this often
MAX_ENTRIES = 10_000  # keys under the prefix one proxy tracks; more are ignored (and said so)
MAX_LOGGED = 256  # bad keys logged at once; more are counted only

OnChange = Callable[[Snapshot], None]
OnReject = Callable[[str], None]


@dataclass
class _Held:
    mod_revision: int
    entry: Entry | None  # None: rejected, or a writer's empty claim
    expired: bool = False  # counted and logged as expired


def _key_id(key: bytes) -> bytes:
    return key if len(key) <= MAX_KEY_BYTES else hashlib.blake2b(key, digest_size=16).digest()


class EtcdWatch:
    """Lists PREFIX, then watches it; calls `on_change` with the whole view whenever it changes.
    An outage keeps the last view (instances still serve; the proxy's health checks see the
    dead ones) and re-lists when etcd answers again."""

    def __init__(self, target: Target, secret: ClusterSecret | None, on_change: OnChange,
                 on_reject: OnReject, timeout: float = 3.0) -> None:
        self.target, self.secret = target, secret
        self.on_change, self.on_reject = on_change, on_reject
        self.etcd = connect(target, timeout)
        self._base = target.prefix.encode() + b"/"
        self._held: dict[bytes, _Held] = {}  # every key tracked
        self._valid: dict[bytes, Entry] = {}  # the keys whose entry counts (expiry aside)
        self._logged: dict[bytes, set[str]] = {}  # key (or a long key's digest) -> reasons logged while it exists
        self._quiet = self._full = False  # said that more bad keys go unlogged / that the prefix is full
        self._last: Snapshot | None = None
        self._next_expiry = math.inf
        self._wake: asyncio.Event | None = None
        self.revision = 0

    async def close(self) -> None:
        await self.etcd.close()

    def _note(self, key: bytes, reason: str, detail: str) -> None:
        """Count a rejection; log it once per key and reason while the key exists."""
        self.on_reject(reason)
        kid = _key_id(key)
        reasons = self._logged.get(kid)
        if reasons is None:
            if len(self._logged) >= MAX_LOGGED:
                if not self._quiet:
                    self._quiet = True
                    logger.warning("discovery: more than %d bad entries under %s in etcd %s: logging no more of "
                                   "them (kvferry_proxy_discovery_rejected_total counts them); remove them, and give "
                                   "writers etcd users (docs/deploy.md)", MAX_LOGGED, self.target.prefix,
                                   self.target.endpoint)
                return
            reasons = self._logged[kid] = set()
        if reason not in reasons:
            reasons.add(reason)
            logger.warning("discovery: ignoring %s in etcd %s: %s", shown(key), self.target.endpoint, detail)

    def _put(self, kv: KV) -> bool:
        """Track a key's new value; whether the view may change (not for junk, nor for a
        record's renewal: the same record with a later expiry)."""
        if len(kv.key) > MAX_KEY_BYTES:
            self._note(kv.key, "key", f"a key of {len(kv.key)} bytes (at most {MAX_KEY_BYTES}), not read")
            return False
        held = self._held.get(kv.key)
        if held is not None and held.mod_revision == kv.mod_revision:
            return False  # verified already
        if held is None and len(self._held) >= MAX_ENTRIES:
            self.on_reject("too_many")
            if not self._full:
                self._full = True
                logger.warning("discovery: more than %d keys under %s in etcd %s: ignoring the others until some "
                               "go; remove what kvferry did not write there (etcdctl del --prefix), and give writers "
                               "etcd users (docs/deploy.md)", MAX_ENTRIES, self.target.prefix, self.target.endpoint)
            return False
        entry = None
        if kv.value:  # empty: a writer's claim, its entry follows
            try:
                entry = verify(self.secret, kv, self.target.prefix)
            except Rejected as e:
                self._note(kv.key, e.reason, str(e))
        self._held[kv.key] = _Held(kv.mod_revision, entry)
        old = self._valid.pop(kv.key, None)
        if entry is not None:
            self._valid[kv.key] = entry
        if old is None or entry is None:
            return old is not entry
        return old.inner != entry.inner or bool(held and held.expired)

    def _delete(self, key: bytes) -> bool:
        self._held.pop(key, None)
        gone = self._valid.pop(key, None) is not None
        self._logged.pop(_key_id(key), None)
        if len(self._logged) < MAX_LOGGED // 2:
            self._quiet = False
        if len(self._held) < MAX_ENTRIES:
            self._full = False
        return gone

    def _view(self, now: float) -> Snapshot:
        snap = Snapshot()
        marks: list[m.DrainMark] = []
        skew, next_expiry = self.target.clock_skew, math.inf
        for key, e in self._valid.items():
            if isinstance(e.inner, m.DrainMark):
                marks.append(e.inner)
                continue
            late = now - e.expires
            if late > skew:
                held = self._held[key]
                if not held.expired:
                    held.expired = True
                    self._note(key, "expired", f"its signed expiry passed {late:.1f}s ago: its registrar stopped "
                                               "renewing it, or that machine's clock is behind this one's by more "
                                               f"than clock_skew={skew:g}s (sync the clocks, or raise ?clock_skew=)")
                continue
            snap.records[e.inner.instance_id] = e.inner
            next_expiry = min(next_expiry, e.expires + skew)
        for d in marks:  # a mark drains the registration it names, not a later one
            rec = snap.records.get(d.instance_id)
            if rec is not None and rec.lease == d.lease:
                snap.drained.add(d.instance_id)
        self._next_expiry = next_expiry
        return snap

    def _publish(self) -> None:
        snap = self._view(time.time())
        if snap != self._last:
            self._last = snap
            self.on_change(snap)
        if self._wake is not None:
            self._wake.set()

    async def _expire(self, wake: asyncio.Event) -> None:
        """Drop records when their signed expiry passes, though no event comes."""
        while True:
            wake.clear()
            delay = min(max(0.0, self._next_expiry - time.time()), WATCH_IDLE_S)
            try:
                await asyncio.wait_for(wake.wait(), delay + 0.01)
            except TimeoutError:
                self._publish()

    async def sync(self) -> None:
        """One full listing, a page at a time."""
        seen: set[bytes] = set()
        async for kvs, revision in self.etcd.pages(self._base, MAX_ENTRIES + 1):
            self.revision = revision
            for kv in kvs:
                seen.add(_key_id(kv.key))
                self._put(kv)
        for key in [k for k in self._held if k not in seen]:
            self._delete(key)
        self._logged = {k: r for k, r in self._logged.items() if k in seen}
        self._publish()

    async def run(self, healthy: Callable[[], None] | None = None) -> None:
        """Forever: list, watch, apply; raises EtcdError when etcd fails (the caller's supervisor
        pauses and calls again)."""
        self._wake = asyncio.Event()
        expiry = asyncio.ensure_future(self._expire(self._wake))
        try:
            while True:
                await self.sync()
                if healthy is not None:
                    healthy()
                try:
                    async for events in self.etcd.watch(self._base, self.revision + 1, WATCH_IDLE_S):
                        changed = False
                        for ev in events:
                            changed |= self._delete(ev.kv.key) if ev.kind == "delete" else self._put(ev.kv)
                            self.revision = max(self.revision, ev.kv.mod_revision)
                        if changed:
                            self._publish()
                except WatchIdle:
                    pass  # quiet for WATCH_IDLE_S: list again (cheap) and watch on
        finally:
            expiry.cancel()
            await asyncio.gather(expiry, return_exceptions=True)
            self._wake = None
