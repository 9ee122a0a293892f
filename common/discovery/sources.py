"""Discovery: instances register themselves, every proxy watches (docs/deploy.md "Discovery").

Two engines, one view:

- ``etcd://HOST:PORT/PREFIX``: each instance puts a signed :class:`InstanceRecord` at
  ``PREFIX/instances/<instance_id>`` under an etcd lease that its registrar (``kvferry join``)
  keeps alive, and re-writes it, freshly signed, every third of the TTL; a killed instance's key
  goes when the lease ends (TTL seconds), and its record stops counting when its signed expiry
  passes even if someone keeps the lease alive. Drain marks live at ``PREFIX/drain/<instance_id>``
  under the drained registration's lease. Proxies list the prefix once and then watch it
  (common/discovery/watch.py); what makes an entry count is in common/discovery/entries.py.
- ``file://PATH``: a YAML or JSON file ``{instances: [record, ...], drain: [instance_id, ...]}``
  that proxies re-read when it changes. The file is configuration, trusted as the command line
  is (its permissions protect it); ``kvferry join`` edits it under a lock.

- ``k8s://NAMESPACE?selector=LABELS``: the pods the selector picks are the instances (their
  labels and annotations say what each is: common/discovery/pods.py); proxies list and watch them
  through the Kubernetes API (common/discovery/kube.py), whose RBAC decides who may add one. Pods
  are registered by Kubernetes itself: ``kvferry join`` does not take it.

The --discovery value (and etcd's TLS and users) is parsed in common/discovery/target.py.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable

import msgspec
import yaml

from kvferry.common.discovery.entries import (
    Rejected,
    Snapshot,
    drain_key,
    record_key,
    rewrite_entry,
    sign,
    verify,
    write_entry,
)
from kvferry.common.discovery.etcd import EtcdError
from kvferry.common.discovery.kube import KubeWatch
from kvferry.common.discovery.target import (
    DEFAULT_PREFIX,
    DiscoveryError,
    ReadOnlyDiscovery,
    Target,
    connect,
    parse_target,
)
from kvferry.common.discovery.watch import EtcdWatch, OnChange
from kvferry.common.log import get_logger
from kvferry.common.secret import ClusterSecret
from kvferry.common.wire import messages as m

__all__ = ["DEFAULT_PREFIX", "DEFAULT_TTL_S", "DiscoveryError", "EtcdWatch", "FileWatch", "KubeWatch",
           "ReadOnlyDiscovery", "Registration", "Rejected", "Snapshot", "Target", "check_access",
           "check_registrable", "drain_key", "edit_file", "fingerprint", "parse_target", "read_file", "record_key",
           "set_drain", "sign", "verify", "write_entry"]

logger = get_logger(__name__)

DEFAULT_TTL_S = 5
MAX_FILE_BYTES = 4 << 20
K8S_REGISTERS = ("in Kubernetes the pods are the registrations: give each the labels and annotations docs/deploy.md "
                 "\"Discovery through Kubernetes\" lists")


def check_registrable(target: Target, what: str) -> None:
    if target.scheme == "k8s":
        raise ReadOnlyDiscovery(f"{what} with --discovery {target}: {K8S_REGISTERS}")


def fingerprint(model: str, dtype: str = "auto", layout: m.LayoutFingerprint | None = None) -> str:
    """What must match between instances one proxy pairs: the KV layout fingerprint where it is
    known, else the model and dtype (tensor-parallel size may differ between a prefiller and a
    decoder). A short hex digest."""
    text = msgspec.json.encode(layout).decode() if layout is not None else f"{model}|{dtype}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


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
    """One instance's entry, kept alive: etcd (every TTL/3 the lease is renewed and the record
    re-written, freshly signed; a key someone deleted or replaced is claimed and written again,
    a lost lease, e.g. after an etcd outage longer than the TTL, is granted again) or a
    discovery file. `withdraw()` removes it."""

    def __init__(self, target: Target, record: m.InstanceRecord, secret: ClusterSecret | None,
                 ttl: int = DEFAULT_TTL_S, timeout: float = 3.0) -> None:
        check_registrable(target, "kvferry join")
        if ttl < 2:
            raise DiscoveryError(f"lease TTL {ttl}s: at least 2 seconds")
        self.target, self.record, self.secret, self.ttl = target, record, secret, ttl
        self.etcd = connect(target, min(timeout, ttl / 3)) if target.scheme == "etcd" else None
        self.lease = 0
        self.revision = 0  # the create revision of the key its record is bound to

    @property
    def key(self) -> bytes:
        return record_key(self.target.prefix, self.record.instance_id)

    def _expires(self) -> float:
        return time.time() + self.ttl

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
        self.revision, _ = await write_entry(self.etcd, self.secret, self.key, self.record, self._expires())

    async def renew(self) -> None:
        """One beat: renew the lease and re-write the record with a later expiry, at the key it
        is bound to; a key that is gone or was created again (someone deleted it) is claimed and
        written anew, a lost lease registers again."""
        assert self.etcd is not None
        if await self.etcd.keepalive(self.lease) <= 0:
            logger.warning("discovery: lease of %s expired (etcd unreachable for longer than %ds?); registering again",
                           self.record.instance_id, self.ttl)
            await self.register()
            return
        ok, _ = await rewrite_entry(self.etcd, self.secret, self.key, self.record, self.revision, self._expires())
        if not ok:
            logger.warning("discovery: the key of %s was deleted or created again by someone else; writing it again",
                           self.record.instance_id)
            self.revision, _ = await write_entry(self.etcd, self.secret, self.key, self.record, self._expires())

    async def keep_alive(self, stop: asyncio.Event) -> None:
        """Until `stop` is set, a beat every TTL/3; an etcd error is logged and retried at the
        next beat (the lease and the signed expiry outlive a missed beat)."""
        if self.etcd is None:
            await stop.wait()
            return
        failing = False
        loop = asyncio.get_running_loop()
        beat = loop.time()
        while True:
            beat = max(beat + self.ttl / 3, loop.time())
            try:
                await asyncio.wait_for(stop.wait(), beat - loop.time())
                return
            except TimeoutError:
                pass
            try:
                await self.renew()
                if failing:
                    logger.warning("discovery: etcd %s answers again", self.etcd.endpoint)
                failing = False
            except EtcdError as e:
                if not failing:
                    logger.warning("discovery: cannot renew the registration of %s: %s", self.record.instance_id, e)
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


async def check_access(target: Target, timeout: float = 3.0) -> None:
    """One read under the prefix: EtcdAccessError when etcd refuses this user, password or
    certificate (EtcdError when it does not answer)."""
    etcd = connect(target, timeout)
    try:
        await etcd.get(target.prefix.encode() + b"/")
    finally:
        await etcd.close()


async def set_drain(target: Target, secret: ClusterSecret | None, instance_id: str, draining: bool,
                    by: str = "", timeout: float = 3.0) -> None:
    """Drain (or undrain) an instance for every proxy watching `target`. In etcd the mark drains
    the registration that counts now (bound to its lease, and held under it: it goes with it);
    undrain deletes it."""
    if target.scheme == "k8s":
        raise ReadOnlyDiscovery(f"cannot {'drain' if draining else 'undrain'} {instance_id} from a proxy with "
                                f"--discovery {target} (it only reads pods): kubectl annotate pod {instance_id} -n "
                                f"{target.namespace} kvferry.io/drain={'true' if draining else 'false'} --overwrite")
    if target.scheme == "file":
        def change(doc: dict) -> None:
            d = set(doc["drain"]) - {instance_id}
            doc["drain"] = sorted(d | {instance_id} if draining else d)
        await asyncio.to_thread(edit_file, target.path, change)
        return
    etcd = connect(target, timeout)
    try:
        key = drain_key(target.prefix, instance_id)
        if not draining:
            await etcd.delete(key)
            return
        kv = await etcd.get(record_key(target.prefix, instance_id))
        try:
            if kv is None or not kv.value:
                raise Rejected("absent", "no record")
            rec = verify(secret, kv, target.prefix)
        except Rejected as e:
            raise DiscoveryError(f"cannot drain {instance_id}: it has no record that counts in {target} ({e}); it is "
                                 "leaving or registering again") from None
        await write_entry(etcd, secret, key, m.DrainMark(instance_id=instance_id, lease=rec.inner.lease))
    finally:
        await etcd.close()
