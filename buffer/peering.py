"""NIXL peers over ZMQ: the one handshake, peer table and request port shared by PD push
(prefiller -> decoder's pd_buffer) and P2P pull (reader <- holder's CPU tier).

A handshake is one Hello/Welcome round trip on the serving side's init port: the asker's NIXL
agent metadata and KV layout fingerprint for the server's. The server answers only what decodes,
and only with the same layout (``welcome``); with a cluster secret, only peers holding it get a
frame through at all (common/zsock.py), so NIXL metadata, which lets a peer READ and WRITE the
registered memory, never reaches anyone else.

The asking side keeps its handshaken peers in a :class:`PeerTable`: bounded, least recently used
first out, never a peer a transfer still uses; a dropped peer's NIXL agent is removed and its
socket closed. Requests after the handshake go to the server's data port (alloc or lookup),
which :func:`serve` reads: [identity, body] frames only, each handled as its own task, never more
than `max_tasks` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import zmq
import zmq.asyncio

from kvferry.buffer.nixl_agent import NixlThread
from kvferry.common import zsock
from kvferry.common.errors import BadDataError, UnavailableError
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.wire import messages as m

logger = get_logger(__name__)

MAX_PEERS = 256
MIN_GBPS = 0.2  # P2P: a lease, and a READ's deadline, grow by its bytes at this rate


class PeerError(UnavailableError, RuntimeError):
    """A peer could not be reached or refused; the message names the peer and the fix."""


class FingerprintError(PeerError):
    """The peer keeps its KV in another layout: its bytes would be garbage here."""


class BadPeerData(PeerError, BadDataError):
    """A peer's answer failed a check before any NIXL call used it (names, metadata, addresses,
    sizes) or its bytes failed one after (a MAC): a counted miss, never trusted."""


def check_name(what: str, name: str) -> str | None:
    """Why `name` (a peer id or NIXL agent name from a peer) is unfit for logs and NIXL, or None."""
    if not name.isprintable():  # control characters would forge log lines
        return f"{what} {name[:64]!r} has unprintable characters"
    return None


def check_welcome(w: m.Welcome, where: str, me: str, others: set[str], max_metadata: int | None) -> str | None:
    """Why a Welcome must not reach NIXL, or None: names, metadata size, an agent name that is
    ours or another peer's (its metadata would replace that agent's)."""
    for what, name in (("peer id", w.peer_id), ("NIXL agent name", w.agent_name)):
        if (why := check_name(what, name)) is not None:
            return f"{where}: {why}"
    if max_metadata is not None and len(w.agent_metadata) > max_metadata:
        return f"{where}: NIXL agent metadata of {len(w.agent_metadata)} bytes (at most {max_metadata})"
    if w.agent_name == me or w.agent_name in others:
        return f"{where}: NIXL agent name {w.agent_name!r} is this side's own or another peer's"
    return None


# What to change when a field differs (docs/pd.md, "Compatibility matrix").
LAYOUT_FIXES = {
    "model": "serve the same model on both sides",
    "kv_kind": "serve the same model on both sides (one is MLA, the other has K/V heads)",
    "block_size": "start both sides with the same --block-size (a kvferry prefiller maps block sizes only for "
                  "a K/V-head model in a GPU flash layout whose chunk_size is a multiple of both; vLLM CPU's "
                  "blocks keep K transposed per block size, and vLLM CPU forces 16 for MLA models)",
    "tp_size": "start both sides with the same --tensor-parallel-size, or use a prefiller that slices K/V heads "
               "per decoder rank (kvferry's does, for the same model; docs/pd.md)",
    "num_kv_heads": "start both sides with the same --tensor-parallel-size (KV heads per rank differ)",
    "total_kv_heads": "serve the same model on both sides (the number of KV heads differs)",
    "kv_layout": "run both sides with the same KV cache layout; on vLLM CPU its attention kernels (isa=) "
                 "must match too: bf16 on a CPU with AMX packs blocks unlike one without AMX, so pair such "
                 "machines with their like, or serve --dtype float32 on both",
    "chunk_size": "set the same chunk_size on both sides",
    "chunk_format": "set the same pd_chunk_format on both sides",
}


def slicing(roles: tuple[str, str], mine: m.LayoutFingerprint, theirs: m.LayoutFingerprint) -> bool:
    """Whether a PD sender will slice K/V heads for this receiver, so their TP sizes may differ:
    the sender says it slices and both sides name the same total of KV heads."""
    sender = mine if roles[0] == "sender" else theirs if roles[1] == "sender" else None
    return (sender is not None and sender.slices and mine.kv_kind == theirs.kv_kind == "mha"
            and mine.total_kv_heads == theirs.total_kv_heads > 0)


# Layouts whose blocks keep each token's head vector whole (at token x head), whatever the block
# size: vLLM's flash layouts. vLLM CPU's blocks do not (its attention stores K transposed, or
# VNNI-packed in 16-token tiles, within each block): whole blocks copy, tokens cannot be mapped.
TOKEN_ADDRESSABLE = ("flash_nhd", "flash_hnd")


def maps_blocks(roles: tuple[str, str], mine: m.LayoutFingerprint, theirs: m.LayoutFingerprint) -> bool:
    """Whether a PD sender will write each decoder page in the decoder's block size, so the block
    sizes may differ: a slicing sender (its byte runs address tokens), layouts whose blocks are
    token-addressable on both sides, and a chunk_size that is a multiple of both block sizes
    (docs/pd.md, "Different block sizes")."""
    bs = (mine.block_size, theirs.block_size)
    return (slicing(roles, mine, theirs) and min(bs) > 0 and all(mine.chunk_size % b == 0 for b in bs)
            and all(fp.kv_layout.split(":", 1)[0] in TOKEN_ADDRESSABLE for fp in (mine, theirs)))


def layout_error(roles: tuple[str, str], names: tuple[str, str], mine: m.LayoutFingerprint,
                 theirs: m.LayoutFingerprint) -> str | None:
    """The one message for a layout mismatch, both sides' fields shown; None when they agree.
    `roles`/`names`: (this side, the other side), e.g. ("receiver", "sender")."""
    diff = [d for d in mine.diff(theirs) if not d.startswith("slices:")]  # a capability, not a layout
    if not (mine.total_kv_heads and theirs.total_kv_heads):  # a peer that does not say: TP and heads decide
        diff = [d for d in diff if not d.startswith("total_kv_heads:")]
    if mine.kv_kind == theirs.kv_kind == "mla":
        # An MLA latent is the same on every TP rank: any rank's copy fits any rank (docs/pd.md).
        diff = [d for d in diff if not d.startswith("tp_size:")]
    elif slicing(roles, mine, theirs):
        # The sender writes each decoder rank exactly its heads, in its chunk format (docs/pd.md).
        diff = [d for d in diff if not d.startswith(("tp_size:", "num_kv_heads:", "page_bytes:"))]
        if maps_blocks(roles, mine, theirs):  # the sender's runs put each token where this block size wants it
            diff = [d for d in diff if not d.startswith("block_size:")]
    if not diff:
        return None
    fixes = dict.fromkeys(LAYOUT_FIXES[f] for f in mine.__struct_fields__
                          if f in LAYOUT_FIXES and any(d.startswith(f"{f}:") for d in diff))
    hint = f" Fix: {'; '.join(fixes)}." if fixes else ""
    return (f"KV layout mismatch between {roles[0]} {names[0]} and {roles[1]} {names[1]}: " + "; ".join(diff)
            + f".{hint} {roles[0]}: {mine}; {roles[1]}: {theirs}")


def welcome(hello: m.Hello, roles: tuple[str, str], me: str, mine: m.LayoutFingerprint, epoch: int,
            agent_name: str, agent_metadata: bytes, region: m.Region | None = None) -> m.Welcome | m.ErrorReply:
    """The server's answer to a Hello: its NIXL metadata, or a fingerprint error naming both sides.
    `roles`: (this side's, the asker's), e.g. ("receiver", "sender")."""
    err = layout_error(roles, (me, hello.peer_id), mine, hello.fingerprint)
    if err is not None:
        logger.error(err)
        return m.ErrorReply(code="fingerprint", message=err[:4000])
    return m.Welcome(peer_id=me, epoch=epoch, agent_name=agent_name, agent_metadata=agent_metadata,
                     fingerprint=mine, region=region)


S = TypeVar("S")  # what the table's owner keeps per peer (PeerTable's `new_state` makes it)


@dataclass(eq=False)
class Peer(Generic[S]):
    """One handshaken peer: its Welcome, its NIXL agent as added here, the data-port socket, and
    the owner's per-peer state."""

    key: tuple[str, int]  # (host, init_port)
    welcome: m.Welcome
    agent: str
    sock: zmq.asyncio.Socket
    busy: int = 0  # transfers using it: never dropped for room while > 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request-reply at a time, where wanted
    state: S = field(kw_only=True)  # PeerTable gives each peer a new_state()
    dropped: bool = False
    watch: asyncio.Task | None = None  # drops the peer when its data-port connection closes


class PeerTable(Generic[S]):
    """The asking side's handshaken peers (thread: the owner's asyncio loop); each peer's `state`
    is a fresh `new_state()`."""

    def __init__(self, ctx: zmq.asyncio.Context, trust: zsock.Trust, nixl: NixlThread,
                 hello: Callable[[], m.Hello], fingerprint: m.LayoutFingerprint, *, roles: tuple[str, str],
                 me: str, timeout_key: str, on_drop: Callable[[Peer, str], None] | None = None,
                 max_peers: int = MAX_PEERS, error: type[PeerError] = PeerError,
                 fingerprint_error: type[PeerError] = FingerprintError,
                 bad_error: type[PeerError] = BadPeerData, max_metadata: int | None = None,
                 watch_disconnect: bool = False, new_state: Callable[[], S]) -> None:
        self.ctx, self.trust, self.nixl = ctx, trust, nixl
        self.new_state = new_state
        self.hello, self.fp, self.me, self.timeout_key = hello, fingerprint, me, timeout_key
        self.roles = roles  # (this side's, the servers'), e.g. ("sender", "receiver")
        self.role = roles[1]
        self.on_drop, self.max_peers = on_drop, max_peers
        self.error, self.fingerprint_error, self.bad_error = error, fingerprint_error, bad_error
        self.max_metadata = max_metadata  # bytes of a peer's NIXL agent metadata (None: the frame's bound)
        # A closed data-port connection drops the peer (see _watch()).
        self.watch_disconnect = watch_disconnect
        self._peers: OrderedDict[tuple[str, int], Peer] = OrderedDict()
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def cached(self, host: str, init_port: int) -> Peer | None:
        return self._peers.get((host, init_port))

    async def get(self, host: str, init_port: int, data_port: int, timeout: float) -> tuple[Peer, bool]:
        """The peer at host:init_port, handshaking first if needed; (peer, handshook now)."""
        key = (host, init_port)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                peer = self._peers.get(key)
                if peer is not None:
                    self._peers.move_to_end(key)
                    return peer, False
                welcome = await self._handshake(host, init_port, timeout)
                where = f"{self.role} {host}:{init_port}"
                why = check_welcome(welcome, where, self.nixl.agent.name, {p.agent for p in self._peers.values()},
                                    self.max_metadata)
                if why is not None:
                    raise self.bad_error(why)
                try:
                    name = await self.nixl.call(self.nixl.agent.add_remote_agent, welcome.agent_metadata)
                except Exception as e:  # noqa: BLE001 - NIXL raises its own types on bad metadata
                    raise self.bad_error(f"{where}: NIXL refused its agent metadata ({type(e).__name__}: {e})"
                                         ) from None
                name = name.decode() if isinstance(name, bytes) else name
                if name != welcome.agent_name:
                    if name not in {p.agent for p in self._peers.values()} | {self.nixl.agent.name}:
                        self.nixl.call(self._remove_agent, name)
                    raise self.bad_error(f"{where}: its metadata names NIXL agent {str(name)[:64]!r}, its handshake "
                                         f"{welcome.agent_name!r}")
                sock = zsock.connect(self.ctx, zmq.DEALER, self.trust, zsock.tcp(host, data_port))
                peer = Peer(key, welcome, name, sock, state=self.new_state())
                if self.watch_disconnect:
                    peer.watch = asyncio.ensure_future(self._watch(peer))
                self._make_room()
                self._peers[key] = peer
                return peer, True
        finally:
            # Locks of peers that failed, or were dropped, do not pile up (asked-for addresses are
            # not always trusted: a request may name any host).
            if key not in self._peers and not lock.locked() and self._locks.get(key) is lock:
                del self._locks[key]

    def _make_room(self) -> None:
        while len(self._peers) >= self.max_peers:
            idle = next((p for p in self._peers.values() if not p.busy), None)
            if idle is None:
                return  # every peer is mid-transfer: over the bound until one finishes
            self.drop(idle, f"the peer table is full ({self.max_peers} peers): least recently used dropped")

    def drop(self, peer: Peer, why: str) -> asyncio.Future | None:
        """Forget `peer`: its socket closed, its NIXL agent removed (the future: done once removed,
        on the NIXL thread); a later get() handshakes again. None for a peer already dropped."""
        if peer.dropped:
            return None
        peer.dropped = True
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]
        lock = self._locks.get(peer.key)
        if lock is not None and not lock.locked():
            del self._locks[peer.key]
        logger.debug("%s %s:%d dropped: %s", self.role, *peer.key, why)
        if self.on_drop is not None:
            self.on_drop(peer, why)
        if peer.watch is not None and peer.watch is not _current_task():
            peer.watch.cancel()
        peer.sock.close(linger=0)
        return self.nixl.call(self._remove_agent, peer.agent)

    async def _watch(self, peer: Peer) -> None:
        """Drop `peer` once its data-port connection closes (the receiver died, restarted or gave
        up on us): the receiver then frees the pages it reserved on that connection, so no write
        may go into them from here any more (grants check `peer.dropped`). ZMQ would reconnect
        silently, as a new connection the receiver knows nothing of."""
        mon = peer.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            await mon.recv_multipart()
            self.drop(peer, "the connection closed")
        finally:
            with contextlib.suppress(zmq.ZMQError):
                peer.sock.disable_monitor()
            mon.close(linger=0)

    def _remove_agent(self, name: str) -> None:
        try:
            self.nixl.agent.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001 - already gone is fine
            logger.debug("remove_remote_agent(%s): %s", name, e)

    def close(self) -> list[asyncio.Future]:
        """Drop every peer; the futures say when each one's NIXL agent is removed."""
        return [f for peer in list(self._peers.values()) if (f := self.drop(peer, "closing")) is not None]

    async def _handshake(self, host: str, port: int, timeout: float) -> m.Welcome:
        where = f"{self.role} {host}:{port}"
        s = zsock.connect(self.ctx, zmq.DEALER, self.trust, zsock.tcp(host, port))
        deadline = time.monotonic() + timeout
        secret = "the same cluster secret as this side" if self.trust.secret is not None else \
            "no cluster secret, as this side"
        silent = self.error(f"{where} did not answer the handshake within {timeout:.1f}s ({self.timeout_key}): "
                            f"is it up, are its host and port right, and does it use {secret}?")
        try:
            # Bounded send too: a socket whose handshake failed has no peer, and a send would wait.
            await asyncio.wait_for(s.send(m.encode(self.hello())), timeout)
            if not await s.poll(max(1, int((deadline - time.monotonic()) * 1000))):  # POLLIN
                raise silent
            reply = m.decode(await s.recv(), expect=(m.Welcome, m.ErrorReply))
        except TimeoutError:
            raise silent from None
        except m.MessageError as e:
            raise self.error(f"{where} sent a bad handshake reply: {e}") from None
        finally:
            s.close(linger=0)
        if isinstance(reply, m.ErrorReply):
            cls = self.fingerprint_error if reply.code == "fingerprint" else self.error
            raise cls(f"{where} refused the handshake: {reply.message}")
        err = layout_error(self.roles, (self.me, f"{host}:{port} ({reply.peer_id})"), self.fp, reply.fingerprint)
        if err is not None:
            raise self.fingerprint_error(err)
        return reply


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None


Handler = Callable[[zmq.asyncio.Socket, bytes, bytes], Awaitable[None]]


async def serve(sock: zmq.asyncio.Socket, handler: Handler, port_name: str, on_bad: Callable[[str], None],
                max_tasks: int = 1024, on_seen: Callable[[bytes, int], None] | None = None) -> None:
    """Read a ROUTER port until cancelled: each [identity, body] frame is handled as its own task
    (so a slow request never holds up another), at most `max_tasks` at once; junk is reported to
    `on_bad` and dropped. A handler that raises is logged, and the port reads on. `on_seen` gets
    each request's identity and the file descriptor of the connection it came on."""
    tasks: set[asyncio.Task] = set()
    warn = RateLimitedLog(logger)

    def done(t: asyncio.Task) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            e = t.exception()
            warn.warning("%s port: a request failed: %s: %s", port_name, type(e).__name__, e)

    try:
        while True:
            if on_seen is None:
                frames = await sock.recv_multipart()
            else:
                parts = await sock.recv_multipart(copy=False)
                frames = [p.bytes for p in parts]
                on_seen(frames[0], parts[0].get(zmq.SRCFD))
            if len(frames) != 2:  # [identity, body] from a DEALER; anything else is junk
                on_bad(f"a {len(frames) - 1}-part message")
                continue
            if len(tasks) >= max_tasks:
                on_bad(f"a request beyond {max_tasks} in progress")
                continue
            task = asyncio.ensure_future(handler(sock, frames[0], frames[1]))
            tasks.add(task)
            task.add_done_callback(done)
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)


async def reply(sock: zmq.asyncio.Socket, ident: bytes, msg: m.Msg) -> None:
    """Answer one request; a peer that is gone (ROUTER drops its frames) is nothing to undo."""
    try:
        await sock.send_multipart([ident, m.encode(msg)], flags=zmq.NOBLOCK)
    except zmq.ZMQError as e:
        logger.debug("reply to a gone peer dropped: %s", e)
