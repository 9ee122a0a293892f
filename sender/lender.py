"""The holder side of P2P sharing: lend this worker's CPU-tier chunks to peers for a NIXL READ.

Data flows out of this process, as in a PD send; the peer pulls it. On `p2p_init_ports` a peer
handshakes (buffer/peering.py: its KV layout must equal ours); on `p2p_lookup_ports` it asks for
chunk keys and gets the addresses of the leading ones held here, with the NIXL registration
metadata it has not seen yet, *leased*: the chunks' memory is kept (an evicted chunk's arena slot
is not reused) until the peer releases the lease or it expires. While a lease is open this
side's NIXL agent keeps progressing (the peer's READ needs it) and the arena touches nothing
ahead (its cores are the READ's).

Everything a peer can make this side hold is bounded: leases per peer (MAX_LEASES_PER_PEER, then
"busy"), their length, and the table of what metadata each peer has seen (MAX_SEEN_PEERS, least
recently used first out: a forgotten peer is sent the metadata again).

The CPU tier's arena is registered once (engine/tiers/host_arena.py says why); a chunk outside it gets a
registration of its own when it enters the tier, dropped when it leaves and no lease holds it.
The handshake declares the arena and every lease the spans of the registrations it sends, so a
reader can check each address before its NIXL READ (receiver/peer_reader.py).

With a cluster secret every lent chunk carries a keyed MAC over its key and bytes
(common/wire/chunk_mac.py), made when the chunk enters the tier (off the fetch path: a get then costs
the reader's check only; a tag made at the lease adds the hash to every get's latency), or at its
first lease if that comes first. Bytes changed in this tier after the tag was made (by a bug, or
a WRITE from anyone holding our NIXL metadata) fail the reader's check.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import zmq.asyncio

from kvferry.buffer import peering
from kvferry.buffer.nixl_agent import NixlThread
from kvferry.common.log import get_logger
from kvferry.common.wire import messages as m
from kvferry.common.wire.chunk_mac import ChunkMAC

logger = get_logger(__name__)

MAX_LEASES_PER_PEER = 64
MAX_SEEN_PEERS = 1024


class ChunkSource(Protocol):
    """What the lender lends from (engine's CPUTier)."""

    arena: Any  # .buf, .holds(t), .pause(), .resume(); or None

    def get(self, key: bytes) -> torch.Tensor | None: ...


@dataclass
class _Reg:
    """A NIXL registration: the CPU tier's arena (for good), or one chunk outside it (while it stays)."""

    data: torch.Tensor
    descs: object
    md: bytes  # NIXL partial metadata a peer needs to READ it
    serial: int
    span: m.Span  # what the peer may READ through it
    leases: int = 0
    dead: bool = False  # left the tier; deregistered once no lease holds it


@dataclass
class _Lease:
    peer: str  # the asker's NIXL agent name
    datas: list[torch.Tensor]  # held: an arena slot is not reused while a peer may read it
    expires: float


class ChunkLender:
    """One worker's lending side. Runs on its owner's asyncio loop; NIXL calls go to `nixl`."""

    def __init__(self, source: ChunkSource, nixl: NixlThread, fingerprint: m.LayoutFingerprint, me: str,
                 epoch: int, lease_base: float, mac: ChunkMAC | None = None) -> None:
        self.source, self.nixl, self.fp, self.me, self.epoch = source, nixl, fingerprint, me, epoch
        self.mac = mac
        self.tag_on_store = True  # False: tags are made at a chunk's first lease (p2p_bench compares)
        self._tags: dict[bytes, tuple[torch.Tensor, bytes]] = {}  # key -> (the bytes tagged, their tag)
        self.lease_base = lease_base  # seconds a lease lasts before the time its bytes take
        self.metadata = b""  # this agent's full metadata (after the arena's registration)
        self._regs: dict[int, _Reg] = {}  # chunks outside the arena, by address
        self._arena_reg: _Reg | None = None
        self._serial = 0
        self._seen: OrderedDict[str, set[int]] = OrderedDict()  # peer agent -> registrations it loaded
        self._leases: dict[str, _Lease] = {}
        self._lock = asyncio.Lock()  # registrations and leases change one request at a time
        self.counters = {"p2p_served_chunks": 0, "p2p_served_bytes": 0, "p2p_refused_leases": 0}

    @property
    def agent(self) -> Any:
        return self.nixl.agent

    async def start(self) -> None:
        if self.source.arena is not None:
            self._arena_reg = await self._new_reg(self.source.arena.buf)
        self.metadata = await self.nixl.call(self.agent.get_agent_metadata)

    async def close(self) -> None:
        for reg in [*self._regs.values(), *([self._arena_reg] if self._arena_reg else [])]:
            try:
                await self.nixl.call(self.agent.deregister_memory, reg.descs)
            except Exception as e:  # noqa: BLE001 - closing: log and go on
                logger.debug("deregister at close: %s", e)
        self._regs.clear()
        self._arena_reg = None

    # ---- the tier's chunks ----
    def _in_arena(self, d: torch.Tensor) -> bool:
        return self._arena_reg is not None and self.source.arena.holds(d)

    async def added(self, key: bytes, data: torch.Tensor) -> None:
        """A chunk entered the tier: registered (and tagged) ahead, so serving it costs nothing."""
        held = self._tags.get(key)
        fresh = held is None or held[0] is not data  # a lease may have tagged it already
        tag = await self._make_tag(key, data) if self.mac is not None and self.tag_on_store and fresh else None
        async with self._lock:
            await self._reg_of(data)
            if tag is not None and self.source.get(key) is data:
                self._tags[key] = (data, tag)

    async def removed(self, key: bytes, data: torch.Tensor) -> None:
        """A chunk left the tier: its tag goes, its own registration once no lease holds it."""
        async with self._lock:
            held = self._tags.get(key)
            if held is not None and held[0] is data:
                del self._tags[key]
            reg = self._regs.get(data.data_ptr())
            if reg is not None and reg.data is data:
                reg.dead = True
                if not reg.leases:
                    await self._deregister(data.data_ptr())

    async def _reg_of(self, d: torch.Tensor) -> _Reg:
        """The registration a peer READs `d` through: the arena's, or (made now) its own."""
        arena = self._arena_reg
        if arena is not None and self.source.arena.holds(d):
            return arena
        reg = self._regs.get(d.data_ptr())
        if reg is None:
            reg = self._regs[d.data_ptr()] = await self._new_reg(d)
        return reg

    async def _new_reg(self, d: torch.Tensor) -> _Reg:
        descs = await self.nixl.call(self.agent.register_memory, d)
        md = await self.nixl.call(self.agent.get_partial_agent_metadata, descs, False, ["UCX"])
        self._serial += 1
        return _Reg(d, descs, md, self._serial, m.Span(addr=d.data_ptr(), nbytes=d.numel()))

    async def _make_tag(self, key: bytes, d: torch.Tensor) -> bytes:
        # A thread: hashing 4 MiB takes ~1 ms, which this loop's other peers must not wait for
        # (BLAKE3 drops the GIL while it hashes).
        assert self.mac is not None  # called only with the cluster secret
        return await asyncio.to_thread(self.mac.tag, key, d.numpy().data)

    async def _tag_of(self, key: bytes, d: torch.Tensor) -> bytes:
        held = self._tags.get(key)
        if held is None or held[0] is not d:
            held = self._tags[key] = (d, await self._make_tag(key, d))
        return held[1]

    def region(self) -> m.Region | None:
        """The arena, declared in the handshake: leased addresses must be its slots."""
        arena = self.source.arena if self._arena_reg is not None else None
        if arena is None:
            return None
        return m.Region(addr=arena.base, page_bytes=arena.slot_bytes, num_pages=arena.num_slots)

    async def _deregister(self, ptr: int) -> None:
        reg = self._regs.pop(ptr)
        for seen in self._seen.values():
            seen.discard(reg.serial)
        try:
            await self.nixl.call(self.agent.deregister_memory, reg.descs)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not deregister a P2P chunk: %s", e)

    # ---- the ports ----
    async def on_hello(self, sock: zmq.asyncio.Socket, ident: bytes, body: bytes) -> None:
        try:
            hello = m.decode(body, expect=m.Hello)
        except m.MessageError as e:
            await peering.reply(sock, ident, m.ErrorReply(code="bad_message", message=str(e)[:4000]))
            return
        answer = peering.welcome(hello, ("holder", "reader"), self.me, self.fp, self.epoch, self.agent.name,
                                 self.metadata, self.region())
        if isinstance(answer, m.Welcome):
            self._seen.pop(hello.agent_name, None)  # a new handshake: the peer starts from our full metadata
        await peering.reply(sock, ident, answer)

    async def on_fetch(self, sock: zmq.asyncio.Socket, ident: bytes, body: bytes) -> None:
        try:
            msg = m.decode(body, expect=(m.PeerFetch, m.PeerRelease))
        except m.MessageError as e:
            await peering.reply(sock, ident, m.ErrorReply(code="bad_message", message=str(e)[:4000]))
            return
        async with self._lock:
            if isinstance(msg, m.PeerRelease):
                await self._release(msg.lease_id)
                return
            reply = await self._lend(msg)
        await peering.reply(sock, ident, reply)
        if isinstance(reply, m.PeerChunks) and reply.addrs:
            self.nixl.wake()  # after the reply is sent: the woken thread takes the GIL

    async def _lend(self, msg: m.PeerFetch) -> m.Msg:
        if sum(1 for lease in self._leases.values() if lease.peer == msg.agent_name) >= MAX_LEASES_PER_PEER:
            self.counters["p2p_refused_leases"] += 1
            return m.ErrorReply(code="busy", message=f"{self.me}: {MAX_LEASES_PER_PEER} leases of yours are open "
                                                     "already; release some first")
        datas = []
        for key in msg.keys:
            d = self.source.get(key)
            if d is None:
                break
            datas.append(d)
        seen = self._seen.pop(msg.agent_name, set())
        self._seen[msg.agent_name] = seen  # most recently used last
        while len(self._seen) > MAX_SEEN_PEERS:
            self._seen.popitem(last=False)
        mds, spans = [], []
        for d in datas:
            reg = await self._reg_of(d)
            if reg.serial not in seen:
                seen.add(reg.serial)
                mds.append(reg.md)
                spans.append(reg.span)
            reg.leases += 1
        tags = [await self._tag_of(k, d) for k, d in zip(msg.keys, datas, strict=False)] \
            if self.mac is not None else []
        nbytes = sum(d.numel() for d in datas)
        lease_s = self.lease_base + nbytes / (peering.MIN_GBPS * 1e9)
        lid = uuid.uuid4().hex[:16]
        if datas:
            self._leases[lid] = _Lease(msg.agent_name, datas, time.monotonic() + lease_s)
            if self.source.arena is not None:
                self.source.arena.pause()  # until released: the peer's READ needs these cores
            self.nixl.progress += 1  # the peer's READ needs this agent to make progress
        self.counters["p2p_served_chunks"] += len(datas)
        self.counters["p2p_served_bytes"] += nbytes
        return m.PeerChunks(request_id=msg.request_id, lease_id=lid, addrs=[d.data_ptr() for d in datas],
                            sizes=[d.numel() for d in datas], lease_seconds=lease_s, metadata=mds, spans=spans,
                            tags=tags)

    async def _release(self, lid: str) -> None:
        lease = self._leases.pop(lid, None)
        if lease is None:
            return
        if self.source.arena is not None:
            self.source.arena.resume()
        self.nixl.progress -= 1
        for d in lease.datas:
            reg = self._arena_reg if self._in_arena(d) else self._regs.get(d.data_ptr())
            if reg is None:
                continue
            reg.leases -= 1
            if reg.dead and not reg.leases:
                await self._deregister(d.data_ptr())

    async def expire(self) -> None:
        """End leases their peers did not release in time."""
        now = time.monotonic()
        async with self._lock:
            for lid in [lid for lid, lease in self._leases.items() if lease.expires < now]:
                logger.warning("P2P lease %s expired before the peer released it", lid)
                await self._release(lid)

    def sizes(self) -> dict[str, int]:
        return {"leases": len(self._leases), "seen_peers": len(self._seen), "registrations": len(self._regs),
                "tags": len(self._tags)}

