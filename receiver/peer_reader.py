"""The reader side of P2P sharing: pull chunks out of a peer's CPU tier with a NIXL READ.

Data flows into this process, as in a PD receive; this side starts it. Per peer (a holder, see
sender/lender.py): one handshake (buffer/peering.py's bounded table), then per fetch a lease on
its lookup port (the holder's addresses of the leading chunks it holds, kept for us until we
release them) and one READ of them into local memory, every step bounded by a deadline.
A peer whose READ failed, or that stopped answering, is dropped: a restarted peer has a new NIXL
agent, and the next fetch handshakes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq
import zmq.asyncio

from kvferry.buffer import peering
from kvferry.buffer.nixl_agent import NixlThread
from kvferry.common import messages as m
from kvferry.common import zsock
from kvferry.common.log import get_logger
from kvferry.common.units import fmt_bytes

logger = get_logger(__name__)



class FetchError(peering.PeerError):
    """A fetch from a peer failed; the caller recomputes."""


class PeerReader:
    """One worker's reading side. Runs on its owner's asyncio loop; NIXL calls go to `nixl`."""

    def __init__(self, ctx: zmq.asyncio.Context, trust: zsock.Trust, nixl: NixlThread,
                 hello: Callable[[], m.Hello], fingerprint: m.LayoutFingerprint, me: str,
                 alloc: Callable[[int], torch.Tensor], arena: Any = None) -> None:
        self.nixl, self.me, self.alloc, self.arena = nixl, me, alloc, arena
        self.peers = peering.PeerTable(ctx, trust, nixl, hello, fingerprint, roles=("reader", "holder"), me=me,
                                       timeout_key="blocking_timeout_secs", error=FetchError,
                                       fingerprint_error=FetchError)
        self.counters = {"p2p_read_chunks": 0, "p2p_read_bytes": 0, "p2p_read_seconds": 0.0}

    def _in_arena(self, d: torch.Tensor) -> bool:
        return self.arena is not None and self.arena.holds(d)

    async def lease(self, addr: m.PeerAddr, keys: Sequence[bytes], deadline: float
                    ) -> tuple[peering.Peer, m.PeerChunks]:
        """Ask the peer's lookup port for `keys`: their addresses, held for us until released."""
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
            raise FetchError(str(e)) from None
        if isinstance(reply, m.ErrorReply):  # a refusal (e.g. busy): the connection is fine, keep it
            raise FetchError(f"peer {peer.welcome.peer_id}: {reply.message}")
        return peer, reply

    async def release(self, peer: peering.Peer, lease_id: str) -> None:
        with contextlib.suppress(zmq.ZMQError):  # NOBLOCK: a peer gone is no reason to wait (its lease expires)
            await peer.sock.send(m.encode(m.PeerRelease(lease_id=lease_id)), flags=zmq.NOBLOCK)

    async def read(self, peer: peering.Peer, reply: m.PeerChunks, sizes: Sequence[int] | None,
                   deadline: float) -> list[torch.Tensor]:
        """READ the leased chunks into new local memory (the lease is released on every path).
        With `sizes`, every asked chunk must be there, of exactly those sizes."""
        read_failed = False
        if self.arena is not None:
            self.arena.pause()  # its touch-ahead thread would take cores from the READ
        who = peer.welcome.peer_id
        try:
            n = len(reply.addrs)
            if sizes is not None:
                if n < len(sizes):
                    raise FetchError(f"peer {who} holds {n} of the {len(sizes)} chunks (evicted since the lookup)")
                if list(reply.sizes) != list(sizes):
                    raise FetchError(f"peer {who} has chunks of other sizes ({reply.sizes[:3]}... vs "
                                     f"{list(sizes[:3])}...): another KV layout")
            if not n:
                return []
            deadline += sum(reply.sizes) / (peering.MIN_GBPS * 1e9)  # the lookup's timeout plus time for the bytes
            t0 = time.monotonic()
            for md in reply.metadata:
                await self.nixl.call(self.nixl.agent.add_remote_agent, md)
            dest = [self.alloc(s) for s in reply.sizes]
            own = [d for d in dest if not self._in_arena(d)]
            descs = await self.nixl.call(self.nixl.agent.register_memory, own) if own else None
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
