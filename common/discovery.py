"""Discovery: instances register themselves, every proxy watches (docs/deploy.md "Discovery").

Two engines, one view:

- ``etcd://HOST:PORT/PREFIX``: each instance puts a signed :class:`InstanceRecord` at
  ``PREFIX/instances/<instance_id>`` under an etcd lease that its registrar (``kvferry join``)
  keeps alive; a killed instance's key goes when the lease ends (TTL seconds). Drain marks live at
  ``PREFIX/drain/<instance_id>`` (no lease: a drain outlives the proxy that wrote it). Proxies
  list the prefix once and then watch it.
- ``file://PATH``: a YAML or JSON file ``{instances: [record, ...], drain: [instance_id, ...]}``
  that proxies re-read when it changes. The file is configuration, trusted as the command line
  is (its permissions protect it); ``kvferry join`` edits it under a lock.

Trust: with a cluster secret, an etcd entry counts only when its HMAC over (key, body) checks
and, for a record, when etcd holds it under the very lease the record names (an old record
written again under another lease, or none, is refused). Everything else is ignored, counted by
reason and logged once per key.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec
import yaml

from kvferry.common import messages as m
from kvferry.common.errors import BadDataError, ConfigurationError
from kvferry.common.etcd import KV, Etcd, EtcdError
from kvferry.common.log import get_logger
from kvferry.common.secret import ClusterSecret

logger = get_logger(__name__)

PURPOSE = "discovery-entry"
DEFAULT_PREFIX = "/kvferry"
DEFAULT_TTL_S = 5
WATCH_IDLE_S = 60.0  # a quiet watch is re-listed and re-opened this often
MAX_FILE_BYTES = 4 << 20


class DiscoveryError(ConfigurationError, ValueError):
    """A bad --discovery value; the message names it and the fix."""


@dataclass(frozen=True)
class Target:
    """A parsed --discovery value."""

    scheme: str  # "etcd" | "file"
    endpoint: str = ""  # etcd: http://host:port
    prefix: str = DEFAULT_PREFIX  # etcd: the cluster's key prefix, no trailing slash
    path: str = ""  # file: the watched file

    @property
    def host(self) -> str:
        return (urlsplit(self.endpoint).hostname or "") if self.scheme == "etcd" else ""

    def __str__(self) -> str:
        return f"etcd://{self.endpoint.split('://', 1)[1]}{self.prefix}" if self.scheme == "etcd" \
            else f"file://{self.path}"


def parse_target(raw: str, flag: str = "--discovery") -> Target:
    """``etcd://HOST:PORT[/PREFIX]`` (``etcds://`` for TLS) or ``file://PATH``."""
    parts = urlsplit(raw)
    if parts.scheme == "file":
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        if not path:
            raise DiscoveryError(f"{flag}: {raw!r} names no file: file:///path/to/cluster.yaml")
        return Target("file", path=os.path.abspath(path))
    if parts.scheme in ("etcd", "etcds"):
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise DiscoveryError(f"{flag}: {raw!r} is not etcd://HOST:PORT/PREFIX (etcd's client port, "
                                 "usually 2379)")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        prefix = "/" + parts.path.strip("/") if parts.path.strip("/") else DEFAULT_PREFIX
        return Target("etcd", f"{'https' if parts.scheme == 'etcds' else 'http'}://{host}:{port}", prefix)
    raise DiscoveryError(f"{flag}: {raw!r}: expected etcd://HOST:PORT/PREFIX or file://PATH")


def record_key(prefix: str, instance_id: str) -> bytes:
    return f"{prefix}/instances/{instance_id}".encode()


def drain_key(prefix: str, instance_id: str) -> bytes:
    return f"{prefix}/drain/{instance_id}".encode()


def fingerprint(model: str, dtype: str = "auto", layout: m.LayoutFingerprint | None = None) -> str:
    """What must match between instances one proxy pairs: the KV layout fingerprint where it is
    known, else the model and dtype (tensor-parallel size may differ between a prefiller and a
    decoder). A short hex digest."""
    text = msgspec.json.encode(layout).decode() if layout is not None else f"{model}|{dtype}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def sign(secret: ClusterSecret | None, key: bytes, msg: m.Msg) -> bytes:
    body = m.encode(msg)
    sig = secret.mac(PURPOSE, key, body) if secret is not None else b""
    return m.encode(m.SignedEntry(body=body, sig=sig))


class Rejected(BadDataError, ValueError):
    """An entry that does not count; `reason` labels the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # malformed | unsigned | bad_signature | lease | key


def verify(secret: ClusterSecret | None, kv: KV) -> m.InstanceRecord | m.DrainMark:
    """The record or drain mark an etcd entry holds, or Rejected."""
    try:
        entry = m.decode(kv.value, m.SignedEntry, max_bytes=1 << 20)
        inner = m.decode(entry.body, (m.InstanceRecord, m.DrainMark), max_bytes=1 << 20)
    except m.MessageError as e:
        raise Rejected("malformed", str(e)) from None
    if secret is not None:
        if not entry.sig:
            raise Rejected("unsigned", "no signature (the writer has no cluster secret)")
        if not secret.verify(PURPOSE, entry.sig, kv.key, entry.body):
            raise Rejected("bad_signature", "its signature does not check with this cluster secret")
        if isinstance(inner, m.InstanceRecord) and (inner.lease == 0 or inner.lease != kv.lease):
            raise Rejected("lease", f"signed for lease {inner.lease:x}, held under lease {kv.lease:x}")
    return inner


@dataclass
class Snapshot:
    """What a discovery engine says now."""

    records: dict[str, m.InstanceRecord] = field(default_factory=dict)  # instance_id -> record
    drained: set[str] = field(default_factory=set)


OnChange = Callable[[Snapshot], None]
OnReject = Callable[[str], None]


class EtcdWatch:
    """Lists PREFIX, then watches it; calls `on_change` with the whole view after every change.
    An outage keeps the last view (instances still serve; the proxy's health checks see the
    dead ones) and re-lists when etcd answers again."""

    def __init__(self, target: Target, secret: ClusterSecret | None, on_change: OnChange,
                 on_reject: OnReject, timeout: float = 3.0) -> None:
        self.target, self.secret = target, secret
        self.on_change, self.on_reject = on_change, on_reject
        self.etcd = Etcd(target.endpoint, timeout)
        self._kvs: dict[bytes, KV] = {}
        self._logged: set[tuple[bytes, str]] = set()
        self.revision = 0

    async def close(self) -> None:
        await self.etcd.close()

    def _view(self) -> Snapshot:
        snap = Snapshot()
        base = self.target.prefix.encode()
        for key, kv in self._kvs.items():
            try:
                inner = verify(self.secret, kv)
                kind, _, iid = key[len(base) + 1:].decode("utf-8", "replace").partition("/")
                if iid != inner.instance_id or kind != ("instances" if isinstance(inner, m.InstanceRecord)
                                                        else "drain"):
                    raise Rejected("key", f"entry for {inner.instance_id!r} stored under "
                                          f"{key.decode('utf-8', 'replace')!r}")
            except Rejected as e:
                if (key, e.reason) not in self._logged:  # once per key and reason
                    self._logged.add((key, e.reason))
                    self.on_reject(e.reason)
                    logger.warning("discovery: ignoring %s in etcd %s: %s", key.decode("utf-8", "replace"),
                                   self.target.endpoint, e)
                continue
            if isinstance(inner, m.InstanceRecord):
                snap.records[inner.instance_id] = inner
            else:
                snap.drained.add(inner.instance_id)
        return snap

    async def sync(self) -> None:
        """One full listing."""
        kvs, self.revision = await self.etcd.get_prefix(self.target.prefix.encode() + b"/")
        self._kvs = {kv.key: kv for kv in kvs}
        self._logged &= {(k, r) for k, r in self._logged if k in self._kvs}
        self.on_change(self._view())

    async def run(self, healthy: Callable[[], None] | None = None) -> None:
        """Forever: list, watch, apply; raises EtcdError when etcd fails (the caller's supervisor
        pauses and calls again)."""
        while True:
            await self.sync()
            if healthy is not None:
                healthy()
            try:
                async for events in self.etcd.watch(self.target.prefix.encode() + b"/", self.revision + 1,
                                                    WATCH_IDLE_S):
                    for ev in events:
                        if ev.kind == "delete":
                            self._kvs.pop(ev.kv.key, None)
                        else:
                            self._kvs[ev.kv.key] = ev.kv
                        self.revision = max(self.revision, ev.kv.mod_revision)
                    if events:
                        self.on_change(self._view())
            except EtcdError as e:
                if "ReadTimeout" not in str(e):
                    raise
                # quiet for WATCH_IDLE_S: list again (cheap) and watch on


def _file_record(raw: object, where: str) -> m.InstanceRecord:
    if not isinstance(raw, dict):
        raise DiscoveryError(f"{where}: expected a mapping (instance_id, role, model, url, ...)")
    try:
        return msgspec.convert({**raw, "t": "instance"}, m.InstanceRecord)
    except msgspec.ValidationError as e:
        raise DiscoveryError(f"{where}: {e}") from None


def read_file(path: str) -> Snapshot:
    """A discovery file's view; DiscoveryError naming the entry when it is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return Snapshot()
    except OSError as e:
        raise DiscoveryError(f"discovery file {path}: {e.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise DiscoveryError(f"discovery file {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = yaml.safe_load(data) or {}
    except yaml.YAMLError as e:
        raise DiscoveryError(f"discovery file {path}: not YAML/JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) - {"instances", "drain"}:
        raise DiscoveryError(f"discovery file {path}: expected a mapping with `instances` (a list) and "
                             "optionally `drain` (a list of instance ids)")
    insts, drain = doc.get("instances") or [], doc.get("drain") or []
    if not isinstance(insts, list) or not isinstance(drain, list):
        raise DiscoveryError(f"discovery file {path}: `instances` and `drain` must be lists")
    snap = Snapshot(drained={str(d) for d in drain})
    for i, raw in enumerate(insts):
        rec = _file_record(raw, f"discovery file {path}: instances[{i}]")
        if rec.instance_id in snap.records:
            raise DiscoveryError(f"discovery file {path}: instance_id {rec.instance_id!r} appears twice")
        snap.records[rec.instance_id] = rec
    return snap


def _record_dict(rec: m.InstanceRecord) -> dict:
    d = msgspec.to_builtins(rec)
    for k in ("t", "v", "lease"):
        d.pop(k, None)
    return d


def edit_file(path: str, change: Callable[[dict], None]) -> None:
    """Change a discovery file under an exclusive lock (PATH.lock), written atomically (a
    watcher never reads half a file)."""
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            snap = read_file(path)
            doc = {"instances": [_record_dict(r) for r in snap.records.values()], "drain": sorted(snap.drained)}
            change(doc)
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=2)
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class FileWatch:
    """Re-reads a discovery file when it changes (mtime, size or inode), every `interval` seconds."""

    def __init__(self, target: Target, on_change: OnChange, interval: float = 0.25) -> None:
        self.target, self.on_change, self.interval = target, on_change, interval
        self._stamp: tuple | None = None

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.target.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self) -> bool:
        """Read the file if it changed; True if it did. A bad file raises DiscoveryError and keeps
        the last good view."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        snap = read_file(self.target.path)
        self._stamp = stamp
        self.on_change(snap)
        return True

    async def run(self, healthy: Callable[[], None] | None = None) -> None:
        while True:
            self.poll()
            if healthy is not None:
                healthy()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        pass


class Registration:
    """One instance's entry, kept alive: etcd (a lease renewed every TTL/3; a lost lease, e.g.
    after an etcd outage longer than the TTL, is granted again and the record written again) or
    a discovery file. `withdraw()` removes it."""

    def __init__(self, target: Target, record: m.InstanceRecord, secret: ClusterSecret | None,
                 ttl: int = DEFAULT_TTL_S, timeout: float = 3.0) -> None:
        if ttl < 2:
            raise DiscoveryError(f"lease TTL {ttl}s: at least 2 seconds")
        self.target, self.record, self.secret, self.ttl = target, record, secret, ttl
        self.etcd = Etcd(target.endpoint, min(timeout, ttl / 3)) if target.scheme == "etcd" else None
        self.lease = 0

    @property
    def key(self) -> bytes:
        return record_key(self.target.prefix, self.record.instance_id)

    async def register(self) -> None:
        if self.etcd is None:
            rec = self.record

            def add(doc: dict) -> None:
                doc["instances"] = [d for d in doc["instances"] if d.get("instance_id") != rec.instance_id]
                doc["instances"].append(_record_dict(rec))
            await asyncio.to_thread(edit_file, self.target.path, add)
            return
        self.lease = await self.etcd.grant(self.ttl)
        self.record = msgspec.structs.replace(self.record, lease=self.lease)
        await self.etcd.put(self.key, sign(self.secret, self.key, self.record), lease=self.lease)

    async def keep_alive(self, stop: asyncio.Event) -> None:
        """Until `stop` is set; an etcd error is logged and retried at the next beat (the lease
        outlives a few missed beats)."""
        if self.etcd is None:
            await stop.wait()
            return
        failing = False
        while True:
            try:
                await asyncio.wait_for(stop.wait(), self.ttl / 3)
                return
            except TimeoutError:
                pass
            try:
                if await self.etcd.keepalive(self.lease) <= 0:
                    logger.warning("discovery: lease of %s expired (etcd unreachable for longer than %ds?); "
                                   "registering again", self.record.instance_id, self.ttl)
                    await self.register()
                if failing:
                    logger.warning("discovery: etcd %s answers again", self.etcd.endpoint)
                failing = False
            except EtcdError as e:
                if not failing:
                    logger.warning("discovery: cannot renew the lease of %s: %s", self.record.instance_id, e)
                failing = True

    async def withdraw(self) -> None:
        if self.etcd is None:
            iid = self.record.instance_id

            def drop(doc: dict) -> None:
                doc["instances"] = [d for d in doc["instances"] if d.get("instance_id") != iid]
            await asyncio.to_thread(edit_file, self.target.path, drop)
            return
        try:
            await self.etcd.delete(self.key)
            await self.etcd.revoke(self.lease)
        except EtcdError as e:
            logger.warning("discovery: withdrawing %s: %s (its lease ends within %ds anyway)",
                           self.record.instance_id, e, self.ttl)

    async def close(self) -> None:
        if self.etcd is not None:
            await self.etcd.close()


async def set_drain(target: Target, secret: ClusterSecret | None, instance_id: str, draining: bool,
                    by: str = "", timeout: float = 3.0) -> None:
    """Drain (or undrain) an instance for every proxy watching `target`."""
    if target.scheme == "file":
        def change(doc: dict) -> None:
            d = set(doc["drain"]) - {instance_id}
            doc["drain"] = sorted(d | {instance_id} if draining else d)
        await asyncio.to_thread(edit_file, target.path, change)
        return
    etcd = Etcd(target.endpoint, timeout)
    try:
        key = drain_key(target.prefix, instance_id)
        if draining:
            await etcd.put(key, sign(secret, key, m.DrainMark(instance_id=instance_id)))
        else:
            await etcd.delete(key)
    finally:
        await etcd.close()
