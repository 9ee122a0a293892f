"""Discovery's etcd entries: where they live, how they are signed and bound, and what counts.

An entry is a :class:`~kvferry.common.wire.messages.SignedEntry` whose body is an ``InstanceRecord``
(at ``PREFIX/instances/<id>``) or a ``DrainMark`` (at ``PREFIX/drain/<id>``). With a cluster
secret it counts only when its seal, an HMAC over (key, body, revision, expires), checks, and
whatever the secret:

- it is held under the etcd lease its body names (a record: its registration's lease; a drain
  mark: the lease of the record it drains);
- its signed ``revision`` is its key's create revision. A writer first *claims* the key (puts an
  empty value where no key is: the put's revision is the key's create revision), then writes the
  signed entry over it with a compare-and-put. etcd never reuses a revision, so a copy written
  back after its key was deleted sits at a key with another create revision and is refused, even
  under a lease re-granted with the same ID;
- a record's signed ``expires`` has not passed (plus the target's ``clock_skew``): its registrar
  re-writes it every third of the TTL, so a registrar that died stops counting at most a TTL
  later even if someone else keeps its lease alive.

docs/deploy.md "Trust" argues what this leaves to a stranger with etcd write access.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from kvferry.common.discovery.etcd import KV, Etcd, EtcdError
from kvferry.common.errors import BadDataError
from kvferry.common.secret import ClusterSecret
from kvferry.common.wire import messages as m

PURPOSE = "discovery-entry"
MAX_KEY_BYTES = 512  # a longer key under the prefix is ignored unread
MAX_VALUE_BYTES = 64 << 10  # a record is a few KiB at most
CLAIM_TRIES = 3


class Rejected(BadDataError, ValueError):
    """An entry that does not count; `reason` labels the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        # malformed | unsigned | bad_signature | key | lease | version | replayed | expired
        self.reason = reason


@dataclass(frozen=True)
class Entry:
    """A verified entry: what it says, and until when (0: no expiry, a drain mark)."""

    inner: m.InstanceRecord | m.DrainMark
    expires: float


@dataclass
class Snapshot:
    """What a discovery engine says now."""

    records: dict[str, m.InstanceRecord] = field(default_factory=dict)  # instance_id -> record
    drained: set[str] = field(default_factory=set)


def record_key(prefix: str, instance_id: str) -> bytes:
    return f"{prefix}/instances/{instance_id}".encode()


def drain_key(prefix: str, instance_id: str) -> bytes:
    return f"{prefix}/drain/{instance_id}".encode()


def shown(key: bytes) -> str:
    """A key for a log line: at most 80 characters, with its length when cut."""
    text = key[:80].decode("utf-8", "replace")
    return text if len(key) <= 80 else f"{text}... ({len(key)} bytes)"


def _sealed(key: bytes, body: bytes, revision: int, expires: float) -> tuple[bytes, ...]:
    return key, body, revision.to_bytes(8, "big"), struct.pack(">d", expires)


def sign(secret: ClusterSecret | None, key: bytes, msg: m.Msg, revision: int = 0, expires: float = 0.0) -> bytes:
    """`sig` covers (key, body), what proxies before revision binding check (a rolling upgrade);
    `seal` covers (key, body, revision, expires), what this version checks."""
    body = m.encode(msg)
    sig = seal = b""
    if secret is not None:
        sig, seal = secret.mac(PURPOSE, key, body), secret.mac(PURPOSE, *_sealed(key, body, revision, expires))
    return m.encode(m.SignedEntry(body=body, sig=sig, revision=revision, expires=expires, seal=seal))


def verify(secret: ClusterSecret | None, kv: KV, prefix: str) -> Entry:
    """The record or drain mark an etcd entry holds, or Rejected (expiry is the caller's: it
    depends on the time it is read)."""
    if len(kv.key) > MAX_KEY_BYTES:
        raise Rejected("key", f"a key of {len(kv.key)} bytes (at most {MAX_KEY_BYTES})")
    if len(kv.value) > MAX_VALUE_BYTES:
        raise Rejected("malformed", f"a value of {len(kv.value)} bytes (at most {MAX_VALUE_BYTES})")
    try:
        entry = m.decode(kv.value, m.SignedEntry, max_bytes=MAX_VALUE_BYTES)
        inner = m.decode(entry.body, (m.InstanceRecord, m.DrainMark), max_bytes=MAX_VALUE_BYTES)
    except m.MessageError as e:
        raise Rejected("malformed", str(e)) from None
    if secret is not None:
        if not entry.sig and not entry.seal:
            raise Rejected("unsigned", "no signature (the writer has no cluster secret)")
        if not (secret.verify(PURPOSE, entry.seal, *_sealed(kv.key, entry.body, entry.revision, entry.expires))
                if entry.seal else secret.verify(PURPOSE, entry.sig, kv.key, entry.body)):
            raise Rejected("bad_signature", "its signature does not check with this cluster secret")
    record = isinstance(inner, m.InstanceRecord)
    if kv.key != (record_key if record else drain_key)(prefix, inner.instance_id):
        raise Rejected("key", f"entry for {inner.instance_id!r} stored under {shown(kv.key)!r}")
    if inner.lease == 0 or inner.lease != kv.lease:
        old = " (no lease: written by an older kvferry? upgrade it)" if inner.lease == 0 else ""
        raise Rejected("lease", f"signed for lease {inner.lease:x}, held under lease {kv.lease:x}{old}")
    if entry.revision == 0 or (record and entry.expires == 0.0) or (secret is not None and not entry.seal):
        raise Rejected("version", "not bound to its key's revision: written by an older kvferry; upgrade kvferry "
                                  "join (and the proxies that drain) on that machine")
    if entry.revision != kv.create_revision:
        raise Rejected("replayed", f"bound to a key created at revision {entry.revision}, held at one created at "
                                   f"{kv.create_revision}: a copy written back after its key was deleted")
    return Entry(inner, entry.expires)


async def claim(etcd: Etcd, key: bytes, lease: int) -> int:
    """Make `key` new, held under `lease` with an empty value (a key that exists is deleted
    first); its create revision, to bind the entry written next."""
    for _ in range(CLAIM_TRIES):
        ok, revision = await etcd.put_if(key, b"", lease, create_revision=0)
        if ok:
            return revision
        await etcd.delete(key)
    raise EtcdError(f"etcd {etcd.endpoint}: {shown(key)} was written by someone else {CLAIM_TRIES} times while "
                    "kvferry claimed it; trying again")


async def write_entry(etcd: Etcd, secret: ClusterSecret | None, key: bytes, msg: m.InstanceRecord | m.DrainMark,
                expires: float = 0.0) -> tuple[int, int]:
    """Claim `key` and write `msg` there bound to it, under the lease `msg` names: (the key's
    create revision, the entry's mod revision)."""
    revision = await claim(etcd, key, msg.lease)
    ok, mod = await rewrite_entry(etcd, secret, key, msg, revision, expires)
    if not ok:
        raise EtcdError(f"etcd {etcd.endpoint}: {shown(key)} changed while kvferry wrote it; trying again")
    return revision, mod


async def rewrite_entry(etcd: Etcd, secret: ClusterSecret | None, key: bytes, msg: m.InstanceRecord | m.DrainMark,
                        revision: int, expires: float = 0.0) -> tuple[bool, int]:
    """Write `msg` at `key` only while the key is the one created at `revision`: (succeeded, the
    entry's mod revision)."""
    return await etcd.put_if(key, sign(secret, key, msg, revision, expires), msg.lease, create_revision=revision)
