"""The reader side of P2P sharing: pull chunks out of a peer's CPU tier with a NIXL READ.

Data flows into this process, as in a PD receive; this side starts it. Per peer (a holder, see
sender/lender.py): one handshake (buffer/peering.py's bounded table), then per fetch a lease on
its lookup port (the holder's addresses of the leading chunks it holds, kept for us until we
release them) and one READ of them into local memory, every step bounded by a deadline.
A peer whose READ failed, or that stopped answering, is dropped: a restarted peer has a new NIXL
agent, and the next fetch handshakes again.

Nothing a peer sends reaches NIXL unchecked: its handshake (names, metadata size, buffer/peering.py)
and each lease (chunk count against the keys asked, every size against the one expected, or for
a move a whole number of blocks up to a chunk; metadata size and count; every address a slot of
the arena its handshake declared or the start of a registration a lease declared). With a cluster
secret each chunk's MAC is checked after the READ. A failed check is a :class:`BadPeerAnswer`,
which the caller counts and recomputes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
import zmq.asyncio

from kvferry.buffer import peering
from kvferry.buffer.nixl_agent import NixlThread
from kvferry.common import zsock
from kvferry.common.log import get_logger
from kvferry.common.units import fmt_bytes
from kvferry.common.wire import messages as m
from kvferry.common.wire.chunk_mac import ChunkMAC

logger = get_logger(__name__)

# One NIXL metadata blob from a peer (a UCX agent's is a few hundred bytes): far above real use,
# far below what could hurt.
MAX_PEER_METADATA = 64 << 10
MAX_SPANS_PER_PEER = 1 << 16  # registrations of one peer remembered (then handshake again)


class FetchError(peering.PeerError):
    """A fetch from a peer failed; the caller recomputes."""


class BadPeerAnswer(FetchError, peering.BadPeerData):
    """A peer's handshake, lease or bytes failed a check: counted (p2p_rejected), recomputed."""


@dataclass
class HolderSpans:
    """What a reader keeps per holder: the memory it registered (address: bytes), from its leases'
    spans, which bounds where a chunk it names may lie."""

    spans: dict[int, int] = field(default_factory=dict)


class PeerReader:
    """One worker's reading side. Runs on its owner's asyncio loop; NIXL calls go to `nixl`."""

    def __init__(self, ctx: zmq.asyncio.Context, trust: zsock.Trust, nixl: NixlThread,
                 hello: Callable[[], m.Hello], fingerprint: m.LayoutFingerprint, me: str,
                 alloc: Callable[[int], torch.Tensor], arena: Any = None, mac: ChunkMAC | None = None) -> None:
        self.nixl, self.me, self.alloc, self.arena, self.mac = nixl, me, alloc, arena, mac
        self.peers = peering.PeerTable(ctx, trust, nixl, hello, fingerprint, roles=("reader", "holder"), me=me,
                                       timeout_key="blocking_timeout_secs", error=FetchError,
                                       fingerprint_error=FetchError, bad_error=BadPeerAnswer,
                                       max_metadata=MAX_PEER_METADATA, new_state=HolderSpans)
        # A chunk is a whole number of blocks, up to `chunk_size` tokens (the handshake's layout).
        fp = fingerprint
        per = fp.chunk_size // fp.block_size if fp.block_size and not fp.chunk_size % fp.block_size else 0
        self.chunk_bytes = fp.page_bytes
        self.block_bytes = fp.page_bytes // per if per and not fp.page_bytes % per else fp.page_bytes
        self.counters = {"p2p_read_chunks": 0, "p2p_read_bytes": 0, "p2p_read_seconds": 0.0}

    def _in_arena(self, d: torch.Tensor) -> bool:
        return self.arena is not None and self.arena.holds(d)

    async def lease(self, addr: m.PeerAddr, keys: Sequence[bytes], deadline: float,
                    sizes: Sequence[int] | None = None, peer_id: str | None = None
                    ) -> tuple[peering.Peer[HolderSpans], m.PeerChunks]:
        """Ask the peer's lookup port for `keys`: their addresses, held for us until released and
        checked (see the module docstring). With `sizes`, every asked chunk must be there, of
        exactly those sizes; with `peer_id`, the peer must be that instance."""
        peer = None
        try:
            peer, new = await self.peers.get(addr.host, addr.init_port, addr.lookup_port,
                                             max(0.001, deadline - time.monotonic()))
            if new:  # LMCache's line, which its users look for
                logger.info("Established connection to peer_init_url %s:%d. The peer_lookup_url: %s:%d", addr.host,
                            addr.init_port, addr.host, addr.lookup_port)
            async with peer.lock:
                rid = uuid.uuid4().hex[:16]
                try:  # bounded: a peer gone since the handshake takes no frames
                    await asyncio.wait_for(peer.sock.send(m.encode(m.PeerFetch(
                        request_id=rid, agent_name=self.nixl.agent.name, keys=list(keys)))),
                        max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise FetchError(f"peer {peer.welcome.peer_id} took no lookup within the deadline") from None
                while True:
                    try:  # recv under a timeout, not poll then recv: one wake-up less (0.4 vs 0.6 ms here)
                        raw = await asyncio.wait_for(peer.sock.recv(), max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        raise FetchError(f"peer {peer.welcome.peer_id} did not answer the lookup in time") from None
                    reply = m.decode(raw, expect=(m.PeerChunks, m.ErrorReply))
                    if isinstance(reply, m.ErrorReply) or reply.request_id == rid:
                        break
        except (FetchError, m.MessageError, zmq.ZMQError) as e:
            if peer is not None:
                self.peers.drop(peer, str(e))  # a restarted peer has a new agent: handshake again next time
            raise (e if isinstance(e, FetchError) else FetchError(str(e))) from None
        if isinstance(reply, m.ErrorReply):  # a refusal (e.g. busy): the connection is fine, keep it
            raise FetchError(f"peer {peer.welcome.peer_id}: {reply.message}")
        err = self._check(peer, reply, keys, sizes, peer_id)
        if err is not None:
            if reply.lease_id:
                await self.release(peer, reply.lease_id)
            raise err
        return peer, reply

    def _check(self, peer: peering.Peer[HolderSpans], reply: m.PeerChunks, keys: Sequence[bytes],
               sizes: Sequence[int] | None, peer_id: str | None) -> FetchError | None:
        """Why this lease must not be READ (before any NIXL call sees it), or None."""
        who = peer.welcome.peer_id
        if peer_id is not None and who != peer_id:  # e.g. a restarted peer's ports reused: a plain miss
            return FetchError(f"the holder at {peer.key[0]}:{peer.key[1]} is {who}, not {peer_id} (its ports were "
                              "reused since the controller heard of it)")
        n = len(reply.addrs)

        def bad(why: str) -> BadPeerAnswer:
            return BadPeerAnswer(f"peer {who} sent a bad lease: {why}")

        if n > len(keys):
            return bad(f"{n} chunks for {len(keys)} keys asked")
        if sizes is not None:
            if n < len(sizes):
                return FetchError(f"peer {who} holds {n} of the {len(sizes)} chunks (evicted since the lookup)")
            if list(reply.sizes) != list(sizes):
                i = next(i for i, (a, b) in enumerate(zip(reply.sizes, sizes, strict=True)) if a != b)
                return bad(f"chunk {i} is {reply.sizes[i]} bytes, expected {sizes[i]}")
        elif self.chunk_bytes:
            for i, size in enumerate(reply.sizes):
                if not 0 < size <= self.chunk_bytes or size % self.block_bytes:
                    return bad(f"chunk {i} is {size} bytes, not a whole number of {self.block_bytes}-byte blocks "
                               f"up to {self.chunk_bytes}")
        if len(reply.metadata) > n:
            return bad(f"{len(reply.metadata)} NIXL metadata entries for {n} chunks")
        if big := [len(md) for md in reply.metadata if len(md) > MAX_PEER_METADATA]:
            return bad(f"NIXL metadata of {big[0]} bytes (at most {MAX_PEER_METADATA})")
        if self.mac is not None and n and len(reply.tags) != n:
            return bad(f"no MAC on its {n} chunks, though this cluster has a secret (an older kvferry?)")
        spans = {**peer.state.spans, **{sp.addr: sp.nbytes for sp in reply.spans}}
        if len(spans) > MAX_SPANS_PER_PEER:
            self.peers.drop(peer, "too many registrations remembered")  # a new handshake starts both sides afresh
            return FetchError(f"peer {who}: more than {MAX_SPANS_PER_PEER} registrations; handshaking again")
        region = peer.welcome.region
        for i, (a, size) in enumerate(zip(reply.addrs, reply.sizes, strict=True)):
            if region is not None and region.page_bytes and \
                    region.addr <= a < region.addr + region.page_bytes * region.num_pages:
                if (a - region.addr) % region.page_bytes or size > region.page_bytes:
                    return bad(f"chunk {i} at {a:#x} ({size} bytes) is not one slot of its arena")
            elif size > spans.get(a, 0):
                return bad(f"chunk {i} at {a:#x} ({size} bytes) is outside the memory it registered")
        return None

    async def release(self, peer: peering.Peer[HolderSpans], lease_id: str) -> None:
        with contextlib.suppress(zmq.ZMQError):  # NOBLOCK: a peer gone is no reason to wait (its lease expires)
            await peer.sock.send(m.encode(m.PeerRelease(lease_id=lease_id)), flags=zmq.NOBLOCK)

    async def read(self, peer: peering.Peer[HolderSpans], reply: m.PeerChunks, keys: Sequence[bytes],
                   deadline: float) -> list[torch.Tensor]:
        """READ a checked lease (from :meth:`lease`) into new local memory, releasing it on every
        path; with a cluster secret, every chunk's MAC over its key in `keys` is checked after."""
        dest = await self._read(peer, reply, deadline)
        if self.mac is not None and dest:
            bad = await asyncio.to_thread(self._forged, keys, dest, reply.tags)  # ~1 ms per 4 MiB: off the loop
            if bad:
                raise BadPeerAnswer(f"peer {peer.welcome.peer_id}: {len(bad)} of {len(dest)} chunks failed the "
                                    f"cluster-secret MAC (corrupted or forged; first: chunk {bad[0]})")
        return dest

    def _forged(self, keys: Sequence[bytes], dest: list[torch.Tensor], tags: Sequence[bytes]) -> list[int]:
        assert self.mac is not None  # called only with the cluster secret
        return [i for i, (k, d, t) in enumerate(zip(keys, dest, tags, strict=False))
                if not self.mac.check(t, k, d.numpy().data)]

    async def _add_metadata(self, peer: peering.Peer[HolderSpans], reply: m.PeerChunks) -> None:
        """Load the lease's NIXL metadata; it must describe the peer's own agent."""
        for md in reply.metadata:
            try:
                name = await self.nixl.call(self.nixl.agent.add_remote_agent, md)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own types on bad metadata
                raise BadPeerAnswer(f"peer {peer.welcome.peer_id}: NIXL refused its metadata "
                                    f"({type(e).__name__}: {e})") from None
            name = name.decode() if isinstance(name, bytes) else name
            if name != peer.agent:
                raise BadPeerAnswer(f"peer {peer.welcome.peer_id}: its lease's metadata names NIXL agent "
                                    f"{str(name)[:64]!r}, not its own {peer.agent!r}")
        peer.state.spans.update((sp.addr, sp.nbytes) for sp in reply.spans)

    async def _read(self, peer: peering.Peer[HolderSpans], reply: m.PeerChunks, deadline: float) -> list[torch.Tensor]:
        read_failed = False
        if self.arena is not None:
            self.arena.pause()  # its touch-ahead thread would take cores from the READ
        who = peer.welcome.peer_id
        try:
            n = len(reply.addrs)
            if not n:
                return []
            deadline += sum(reply.sizes) / (peering.MIN_GBPS * 1e9)  # the lookup's timeout plus time for the bytes
            t0 = time.monotonic()
            try:
                await self._add_metadata(peer, reply)
            except BadPeerAnswer:
                read_failed = True  # what NIXL holds of this agent is in doubt: handshake again
                raise
            dest = [self.alloc(s) for s in reply.sizes]
            own = [d for d in dest if not self._in_arena(d)]
            try:
                descs = await self.nixl.call(self.nixl.agent.register_memory, own) if own else None
            except Exception as e:  # noqa: BLE001 - NIXL raises its own types
                raise FetchError(f"could not register {fmt_bytes(sum(d.numel() for d in own))} to READ into: "
                                 f"{type(e).__name__}: {e}") from None
            xfer = self.nixl.xfer("READ", [(d.data_ptr(), d.numel(), 0) for d in dest], "DRAM",
                                  [(a, s, 0) for a, s in zip(reply.addrs, reply.sizes, strict=True)], "DRAM",
                                  peer.agent, b"", deadline)
            try:
                state = await asyncio.shield(xfer)
            except asyncio.CancelledError:
                # The READ may write into `dest` until NIXL ends it (at `deadline` at the latest):
                # keep the memory (and its registration) until then.
                await asyncio.wait([xfer])
                raise
            finally:
                if descs is not None:
                    await self.nixl.call(self.nixl.agent.deregister_memory, descs)
            if state != "DONE":
                read_failed = True
                raise FetchError(f"NIXL READ from {who}: {state}")
            dt = time.monotonic() - t0
            nbytes = sum(reply.sizes)
            self.counters["p2p_read_chunks"] += n
            self.counters["p2p_read_bytes"] += nbytes
            self.counters["p2p_read_seconds"] += dt
            logger.debug("P2P: read %d chunks (%s) from %s in %.2f ms", n, fmt_bytes(nbytes), who, dt * 1e3)
            return dest
        finally:
            if self.arena is not None:
                self.arena.resume()
            if reply.lease_id:
                await self.release(peer, reply.lease_id)
            if read_failed:  # e.g. a peer restarted on the same ports has a new agent: handshake again
                self.peers.drop(peer, "its READ failed")
