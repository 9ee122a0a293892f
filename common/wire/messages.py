"""Every control message kvferry puts on a wire, as tagged, versioned msgspec Structs.

Frames are msgpack maps. :func:`decode` is the only way in: it bounds the frame size, checks the
protocol version, validates types and lengths, and raises :class:`MessageError` (never anything
else) for bad input, so a hostile peer can cost a log line but not a crash.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, Union, overload

import msgspec

from kvferry.common.errors import BadDataError

# 2: one Hello/Welcome handshake for PD and P2P, AbortTransfer.final, lm:// server greeting.
# 3: AllocResponse without `skip`; PeerChunks' `spans` and `tags` (a mixed cluster fails with
#    "peer speaks protocol 2", not "malformed" frames or leases rejected as hostile).
# 4: RenewLease / LeaseRenewed: a sender that reserved pages before its prompt computed keeps them.
#    AbortTransfer.ack / AbortAck (optional: an older receiver ignores `ack` and answers nothing).
PROTOCOL_VERSION = 4
MAX_FRAME_BYTES = 4 << 20

# Length limits: generous for real use, small enough that a hostile frame cannot balloon memory.
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=1 << 16)]
Blob = Annotated[bytes, msgspec.Meta(max_length=2 << 20)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Tokens = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]], msgspec.Meta(max_length=1 << 20)]
Indices = Annotated[list[NonNeg], msgspec.Meta(max_length=1 << 16)]
# Seconds from a peer: finite and bounded (NaN and inf fail the bounds).
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


class MessageError(BadDataError, ValueError):
    """A frame that is not a valid kvferry message; `kind` says why."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind  # too_large | malformed | version | unexpected


class Msg(msgspec.Struct, tag_field="t", kw_only=True, frozen=True):
    """Base of every wire message; `v` is the protocol version of the sender."""

    v: int = PROTOCOL_VERSION


class LayoutFingerprint(msgspec.Struct, kw_only=True, frozen=True):
    """What must match between a prefiller and a decoder for KV bytes to mean the same thing."""

    model: Text
    dtype: Text
    num_layers: NonNeg
    num_kv_heads: NonNeg  # per TP rank
    head_size: NonNeg
    block_size: NonNeg
    kv_layout: Text  # e.g. "cpu:[blocks,kv_heads,block_size,2*head_size]"
    chunk_format: Text  # "block" | "token"
    chunk_size: NonNeg
    tp_size: NonNeg = 1
    page_bytes: NonNeg = 0
    kv_kind: Text = "mha"  # "mha": K and V per head (dense, GQA, MoE); "mla": one latent per token (DeepSeek)
    total_kv_heads: NonNeg = 0  # over all TP ranks (0: not said); a slicing sender may differ in TP (docs/pd.md)
    slices: bool = False  # a sender that writes each decoder rank only its own heads (kernels/head_map.py)

    def diff(self, other: LayoutFingerprint) -> list[str]:
        """Field-by-field differences, for an error message that shows both sides."""
        return [f"{f}: {getattr(self, f)!r} != {getattr(other, f)!r}" for f in self.__struct_fields__
                if getattr(self, f) != getattr(other, f)]


# ---- init ports (pd_peer_init_port, p2p_init_ports): the one NIXL handshake (buffer/peering.py) ----
class Region(msgspec.Struct, kw_only=True, frozen=True):
    """Registered memory the asker may WRITE into: a decoder's pd_buffer, in pages."""

    addr: NonNeg
    page_bytes: NonNeg
    num_pages: NonNeg
    mem_type: Text = "DRAM"  # "DRAM" | "VRAM"
    device_id: NonNeg = 0


class Hello(Msg, tag="hello", frozen=True):
    peer_id: Id  # the asker: a sender id, or a P2P instance id
    agent_name: Id
    agent_metadata: Blob
    fingerprint: LayoutFingerprint
    tp_rank: NonNeg = 0


class Welcome(Msg, tag="welcome", frozen=True):
    peer_id: Id  # the server: a receiver id, or a P2P instance id
    epoch: NonNeg  # changes on every restart
    agent_name: Id
    agent_metadata: Blob
    fingerprint: LayoutFingerprint
    region: Region | None = None  # PD: where to WRITE; P2P leases name their addresses instead


# ---- alloc port: page reservation ----
class AllocRequest(Msg, tag="alloc_req", frozen=True):
    transfer_id: Id
    sender_id: Id
    epoch: NonNeg  # the receiver epoch the sender handshook with
    chunk_keys: Annotated[list[Key], msgspec.Meta(min_length=1, max_length=1 << 16)]
    num_tokens: NonNeg
    writers: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1  # prefiller ranks writing into the same pages
    writer: NonNeg = 0  # this one of them: the transfer is read once all `writers` notified


class AllocResponse(Msg, tag="alloc_resp", frozen=True):
    transfer_id: Id
    generation: NonNeg
    pages: Indices  # page index for each chunk to send, in order
    lease_seconds: Seconds


class RenewLease(Msg, tag="renew", frozen=True):
    """The sender still computes the chunks it reserved pages for: restart their lease. Only from a
    connection that reserved them, only before the data arrived, never past pd_queue_seconds."""

    transfer_id: Id
    generation: NonNeg


class LeaseRenewed(Msg, tag="renewed", frozen=True):
    transfer_id: Id
    generation: NonNeg
    lease_seconds: Seconds  # from when the receiver handled the renewal


class ErrorReply(Msg, tag="error", frozen=True):
    code: Text  # e.g. "buffer_full", "too_large", "bad_message", "stale_epoch", "fingerprint"
    message: Text
    transfer_id: str | None = None


# ---- NIXL notification payload and aborts ----
class ArrivalNotice(Msg, tag="arrived", frozen=True):
    transfer_id: Id
    generation: NonNeg
    writer: NonNeg = 0  # AllocRequest.writer


class AbortTransfer(Msg, tag="abort", frozen=True):
    """Drop a transfer. Its pages are reused only when no WRITE can still land in them: at its arrival
    notice, at its lease's end, or at once when `final` comes from the connection that reserved them
    (the sender: it posted no WRITE and never will). Generation 0 means any (the proxy has none).
    The receiver sends it too, to the connection that reserved the pages, when anyone else dropped
    the transfer: that sender posts no more WRITEs and answers with its own abort."""

    transfer_id: Id
    generation: NonNeg = 0
    reason: Text = ""
    final: bool = False
    ack: bool = False  # the receiver answers AbortAck once the abort is applied (or refused)


class AbortAck(Msg, tag="abort_ack", frozen=True):
    """The receiver's answer to an AbortTransfer that asked for one (`ack`), sent once the abort was
    handled: whatever it changed (pages freed or quarantined, a late alloc refused) holds for the
    next request on any connection. An abort the receiver refuses (another connection's final
    abort) is acknowledged too: the answer says it was read, not that it freed anything."""

    transfer_id: Id
    generation: NonNeg = 0


class ProxyNotification(Msg, tag="proxy_notify", frozen=True):
    """Sent to the configured pd_proxy_host:pd_proxy_port once a whole transfer has arrived."""

    transfer_id: Id
    receiver_id: Id
    num_chunks: NonNeg
    num_tokens: NonNeg


# ---- the lm:// cache server (kvferry-server): a header frame, then `nbytes` raw payload bytes ----
class RemotePut(Msg, tag="rput", frozen=True):
    key: Key
    nbytes: NonNeg  # payload bytes that follow the header


class RemoteGet(Msg, tag="rget", frozen=True):
    key: Key


class RemoteExists(Msg, tag="rexists", frozen=True):
    keys: Keys


class ServerHello(Msg, tag="server_hello", frozen=True):
    """The lm:// server's first frame on every connection: with a cluster secret, a challenge."""

    auth: bool
    nonce: bytes = b""


class AuthAnswer(Msg, tag="auth_answer", frozen=True):
    """The client's proof: HMAC over both nonces with the secret's lm:// key (common/secret.py)."""

    nonce: Nonce
    mac: Annotated[bytes, msgspec.Meta(min_length=32, max_length=64)]


class AuthOk(Msg, tag="auth_ok", frozen=True):
    """The server's proof back: the client knows it talks to a holder of the secret too."""

    mac: Annotated[bytes, msgspec.Meta(min_length=32, max_length=64)]


class RemoteReply(Msg, tag="rreply", frozen=True):
    """Answer to put (ok), get (found, then `nbytes` payload bytes) and exists (`found_keys`)."""

    ok: bool = True
    found: bool = False
    nbytes: NonNeg = 0
    found_keys: Annotated[list[bool], msgspec.Meta(max_length=1 << 16)] = []


# ---- controller (kvferry-controller) and P2P peers ----
Location = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]  # "LocalCPUBackend"
Sizes = Annotated[list[NonNeg], msgspec.Meta(max_length=1 << 16)]
Salt = Annotated[bytes, msgspec.Meta(max_length=4096)]


class WorkerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """One worker (TP rank) of one instance, as it registers with the controller."""

    instance_id: Id
    worker_id: NonNeg  # the TP rank
    epoch: Id  # new on every process start: a restart is a new worker, not a stale one
    host: Text  # p2p_host
    worker_port: Port  # lmcache_worker_ports[rank]: the controller's commands
    p2p_init_port: Port
    p2p_lookup_port: Port
    tp_size: NonNeg = 1
    # What the controller needs to key tokens the way this worker does (POST /lookup, /move).
    salt: Salt
    chunk_size: NonNeg
    partial_chunks: bool
    heartbeat_timeout: Annotated[float, msgspec.Meta(ge=0.1, le=86400.0)]
    cpu_capacity: NonNeg = 0  # bytes


class RegisterWorker(Msg, tag="register", frozen=True):
    worker: WorkerInfo


class DeregisterWorker(Msg, tag="deregister", frozen=True):
    instance_id: Id
    worker_id: NonNeg
    epoch: Id


class Heartbeat(Msg, tag="heartbeat", frozen=True):
    """Carries the registration, so a restarted controller learns the worker again."""

    worker: WorkerInfo
    num_chunks: NonNeg
    used_bytes: NonNeg


class ChunkAdmit(Msg, tag="admit", frozen=True):
    instance_id: Id
    worker_id: NonNeg
    epoch: Id
    location: Location
    keys: Keys
    sizes: Sizes  # bytes of each chunk
    reset: bool = False  # these keys are all the worker holds (a resync)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.sizes):
            raise ValueError(f"{len(self.keys)} keys and {len(self.sizes)} sizes")


class ChunkEvict(Msg, tag="evict", frozen=True):
    instance_id: Id
    worker_id: NonNeg
    epoch: Id
    location: Location
    keys: Keys


class TransferReport(Msg, tag="transfer", frozen=True):
    """A P2P retrieval a worker made, for the controller's page."""

    instance_id: Id
    peer_id: Id
    num_chunks: NonNeg
    nbytes: NonNeg
    seconds: Seconds
    ok: bool
    kind: Text = "p2p"  # "p2p" (a request's load) | "move"


class PeerAddr(msgspec.Struct, kw_only=True, frozen=True):
    host: Text
    init_port: Port
    lookup_port: Port


class LookupRequest(Msg, tag="lookup_req", frozen=True):
    """The scheduler's question: who holds the longest prefix of these chunk keys?"""

    instance_id: Id  # the asker (its own chunks count: a move may have put them there)
    keys: Keys


class LookupResponse(Msg, tag="lookup_resp", frozen=True):
    instance_id: str | None = None
    location: str | None = None
    num_chunks: NonNeg = 0
    peers: Annotated[list[PeerAddr], msgspec.Meta(max_length=1024)] = []  # one per TP rank


# Controller -> worker commands (worker port); each is answered with a CommandResult.
class PullChunks(Msg, tag="pull", frozen=True):
    """Fetch `keys` from `source` (the same TP rank of another instance) into the CPU tier."""

    event_id: Id
    source_id: Id
    source: PeerAddr
    keys: Keys


class DropChunks(Msg, tag="drop", frozen=True):
    """Remove `keys` from the CPU tier (the source of a move with copy false)."""

    event_id: Id
    keys: Keys


class ClearChunks(Msg, tag="clear", frozen=True):
    event_id: Id


class Resync(Msg, tag="resync", frozen=True):
    """The controller lost this worker's chunk list: send all of it again."""

    event_id: Id


class CommandResult(Msg, tag="cmd_result", frozen=True):
    event_id: Id
    ok: bool
    num_chunks: NonNeg = 0
    nbytes: NonNeg = 0
    message: Text = ""


class TierNotice(Msg, tag="tier_notice", frozen=True):
    """Worker -> its own scheduler (ipc): chunks a controller command put into or took out of the
    CPU tier behind the scheduler's index."""

    adopted: Keys = []
    sizes: Sizes = []
    dropped: Keys = []

    def __post_init__(self) -> None:
        if len(self.adopted) != len(self.sizes):
            raise ValueError(f"{len(self.adopted)} adopted keys and {len(self.sizes)} sizes")


# Peer <-> peer: p2p_init_ports (Hello/Welcome) and p2p_lookup_ports (lease chunks for a NIXL READ).
class PeerFetch(Msg, tag="peer_fetch", frozen=True):
    request_id: Id
    agent_name: Id  # the asker's NIXL agent (the holder sends it the registrations it has not seen)
    keys: Keys


class Span(msgspec.Struct, kw_only=True, frozen=True):
    """A holder's NIXL registration: the only memory its leases may name."""

    addr: Annotated[int, msgspec.Meta(ge=1)]
    nbytes: Annotated[int, msgspec.Meta(ge=1, lt=1 << 48)]


# A chunk's keyed MAC (common/wire/chunk_mac.py TAG_BYTES; messages import no hashing library).
Tag = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


class PeerChunks(Msg, tag="peer_chunks", frozen=True):
    """The holder's memory for the leading `len(addrs)` of the asked keys, held until released
    or `lease_seconds` pass."""

    request_id: Id
    lease_id: Id
    addrs: Sizes
    sizes: Sizes
    lease_seconds: Seconds
    # NIXL partial metadata of chunks registered since this asker last heard: load before READing.
    metadata: Annotated[list[Blob], msgspec.Meta(max_length=1 << 16)] = []
    # The registration each `metadata` entry describes (the reader checks every address against them).
    spans: Annotated[list[Span], msgspec.Meta(max_length=1 << 16)] = []
    # With a cluster secret: each chunk's keyed MAC over its key and bytes, checked after the READ.
    tags: Annotated[list[Tag], msgspec.Meta(max_length=1 << 16)] = []

    def __post_init__(self) -> None:
        if len(self.addrs) != len(self.sizes):
            raise ValueError(f"{len(self.addrs)} addresses and {len(self.sizes)} sizes")
        if len(self.spans) != len(self.metadata):
            raise ValueError(f"{len(self.metadata)} metadata entries and {len(self.spans)} spans")
        if self.tags and len(self.tags) != len(self.addrs):
            raise ValueError(f"{len(self.addrs)} chunks and {len(self.tags)} tags")


class PeerRelease(Msg, tag="peer_release", frozen=True):
    lease_id: Id


class InstanceRecord(Msg, tag="instance", frozen=True):  # discovery/sources.py: one registration
    instance_id: Id
    role: Annotated[str, msgspec.Meta(pattern="^(prefiller|decoder)$")]
    model: Text  # the served model name
    url: Text  # its OpenAI server as proxies reach it
    receiver_host: Text = ""  # decoder: the receiver's advertised host ("": the URL's)
    init_ports: Annotated[list[Port], msgspec.Meta(max_length=64)] = []  # decoder: one per TP rank
    alloc_ports: Annotated[list[Port], msgspec.Meta(max_length=64)] = []
    kv_events: Annotated[list[Text], msgspec.Meta(max_length=2)] = []  # vLLM's event publisher [, replay socket]
    fingerprint: Text = ""  # discovery.fingerprint(): KV layout, else model|dtype
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    kvferry_version: Text = ""
    lease: NonNeg = 0  # the etcd lease it is written under (0: a file entry); held under another: refused


class DrainMark(Msg, tag="drain", frozen=True):  # every proxy drains this instance's registration
    instance_id: Id
    lease: NonNeg = 0  # the drained record's lease, which the mark is held under too (0: written before leases)


class SignedEntry(Msg, tag="signed", frozen=True):  # body: an encoded InstanceRecord or DrainMark
    body: Blob
    sig: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # HMAC(key, body): what readers before `seal` check
    revision: NonNeg = 0  # its key's create revision (0: a writer before revisions: refused, "version")
    expires: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)] = 0.0  # a record: unix time it stops counting
    seal: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # HMAC(key, body, revision, expires)

Message = Union[
    Hello, Welcome, AllocRequest, AllocResponse, RenewLease, LeaseRenewed, ErrorReply, ArrivalNotice,
    AbortTransfer, AbortAck, ProxyNotification, ServerHello, AuthAnswer, AuthOk, RemotePut, RemoteGet, RemoteExists,
    RemoteReply, RegisterWorker, DeregisterWorker, Heartbeat, ChunkAdmit, ChunkEvict, TransferReport,
    LookupRequest, LookupResponse, PullChunks, DropChunks, ClearChunks, Resync, CommandResult, TierNotice,
    PeerFetch, PeerChunks, PeerRelease, InstanceRecord, DrainMark, SignedEntry
]


class _Header(msgspec.Struct):
    t: Any = None
    v: Any = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


Frame = bytes | bytearray | memoryview
# The message classes a caller expects: decode() returns their union.
A = TypeVar("A", bound=Msg)
B = TypeVar("B", bound=Msg)
C = TypeVar("C", bound=Msg)
D = TypeVar("D", bound=Msg)


@overload
def decode(frame: Frame, expect: type[A], max_bytes: int = ...) -> A: ...
@overload
def decode(frame: Frame, expect: tuple[type[A], type[B]], max_bytes: int = ...) -> A | B: ...
@overload
def decode(frame: Frame, expect: tuple[type[A], type[B], type[C]], max_bytes: int = ...) -> A | B | C: ...
@overload
def decode(frame: Frame, expect: tuple[type[A], type[B], type[C], type[D]],
           max_bytes: int = ...) -> A | B | C | D: ...
@overload
def decode(frame: Frame, expect: tuple[type[Msg], ...], max_bytes: int = ...) -> Msg: ...
@overload
def decode(frame: Frame, expect: None = None, max_bytes: int = ...) -> Message: ...
def decode(frame: Frame, expect: type | tuple[type, ...] | None = None,
           max_bytes: int = MAX_FRAME_BYTES) -> Any:
    """Decode one frame, checking size, version, types and (optionally) the message class."""
    if len(frame) > max_bytes:
        raise MessageError("too_large", f"frame of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        # A peer on another protocol version fails validation: say so rather than "malformed".
        try:
            header = _header_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            header = None
        if header is not None and isinstance(header.v, int) and header.v != PROTOCOL_VERSION:
            raise MessageError("version", f"peer speaks protocol {header.v}, this side {PROTOCOL_VERSION}") from None
        raise MessageError("malformed", str(e)[:300]) from None
    if msg.v != PROTOCOL_VERSION:
        raise MessageError("version", f"peer speaks protocol {msg.v}, this side {PROTOCOL_VERSION}")
    if expect is not None and not isinstance(msg, expect):
        names = [t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,))]
        raise MessageError("unexpected", f"got {type(msg).__name__}, expected {' or '.join(names)}")
    return msg
