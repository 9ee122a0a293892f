"""The prefiller side of a transfer: handshake, alloc, NIXL WRITE into the decoder's pd_buffer.

`KVSender.send()` returns a `concurrent.futures.Future` at once, so the caller (vLLM's forward
pass) never waits on the network. The work runs on two threads of the sender's own: an asyncio
loop (``kvf-send``) owning every ZMQ socket, and ``kvf-send-nixl``, the NIXL agent's only user,
which posts writes and polls them every 50 us while one is in flight and sleeps on its queue
otherwise. Every wait is bounded:

- handshake: pd_handshake_timeout, once per receiver, cached in a bounded peer table
  (buffer/peering.py, shared with P2P); a receiver that restarted (new epoch) answers the next
  alloc with ``stale_epoch`` and the sender handshakes again, once.
- alloc: pd_alloc_timeout (the receiver's own bound) plus the handshake bound as slack.
- write: the lease. No write is posted after the lease deadline, counted from when the alloc
  request left (earlier than the receiver's own start of the lease), less a safety margin.

A transfer given up before its write was posted is aborted with ``final``: the receiver may reuse
its pages at once. Once a write was posted, only its notification or the lease's end frees them
(how each grant ends: sender/grant_ends.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zmq
import zmq.asyncio

from kvferry.buffer import nixl_agent, peering
from kvferry.common import zsock
from kvferry.common.config import KVFerryConfig
from kvferry.common.log import get_logger
from kvferry.common.samples import Samples
from kvferry.common.wire import messages as m
from kvferry.sender import prepared
from kvferry.sender.addr import ReceiverAddr
from kvferry.sender.errors import (
    AllocFailed,
    ChunkError,
    FingerprintMismatch,
    HandshakeFailed,
    ReceiverRestarted,
    SendError,
)
from kvferry.sender.grant_ends import GrantEnds
from kvferry.sender.grants import (
    LEASE_MARGIN,
    AllocLink,
    Grant,
    check_ranges,
    pd_region,
    refusal,
    renew_until_done,
    send_abort,
)
from kvferry.sender.prepared import checked_descs
from kvferry.sender.results import ALLOC_SAMPLES, SenderCounters, SendResult

logger = get_logger(__name__)

POLL_S = 0.00005


@dataclass(frozen=True)
class SenderConfig:
    sender_id: str
    handshake_timeout: float = 5.0  # pd_handshake_timeout
    alloc_timeout: float = 10.0  # pd_alloc_timeout
    tp_rank: int = 0
    trust: zsock.Trust = zsock.PLAIN
    max_receivers: int = peering.MAX_PEERS
    net_devices: str | None = None  # nixl_net_devices


def sender_config(cfg: KVFerryConfig, sender_id: str, tp_rank: int = 0) -> SenderConfig:
    return SenderConfig(sender_id, handshake_timeout=cfg.pd_handshake_timeout, alloc_timeout=cfg.pd_alloc_timeout,
                        tp_rank=tp_rank, trust=zsock.trust_of(cfg), net_devices=cfg.nixl_net_devices)


class KVSender:
    """Sends chunks from this worker's registered memory to receivers; one per prefiller TP rank."""

    def __init__(self, cfg: SenderConfig, fingerprint: m.LayoutFingerprint, device: str = "cpu",
                 samples: Samples | None = None) -> None:
        self.cfg = cfg
        self.samples = samples if samples is not None else Samples()  # alloc round trips (ALLOC_SAMPLES)
        self.fingerprint = fingerprint
        self.device = device
        self._device_id, self._mem = nixl_agent.device_id(device), nixl_agent.mem_type(device)
        self._agent = nixl_agent.make_agent(f"kvf-send-{cfg.sender_id}-{id(self):x}", cfg.net_devices)
        self._metadata = b""  # refreshed after each registration
        self._regs: list = []
        self._tensors: list = []  # what is registered: registered again after vLLM sleep mode
        self._ranges: list[tuple[int, int]] = []
        self._asleep = False
        self._loop = asyncio.new_event_loop()
        self._ctx = zmq.asyncio.Context()
        self._nixl = nixl_agent.NixlThread(self._agent, self._loop, POLL_S)
        self._preps = prepared.Handles(self._nixl)  # prepared writes' NIXL handles, released in time
        self._peers = peering.PeerTable(
            self._ctx, cfg.trust, self._nixl, self._hello, fingerprint, roles=("sender", "receiver"), me=cfg.sender_id,
            timeout_key="pd_handshake_timeout", on_drop=self._on_drop, max_peers=cfg.max_receivers,
            error=HandshakeFailed, fingerprint_error=FingerprintMismatch, watch_disconnect=True, new_state=AllocLink)
        self.counters = SenderCounters()
        self._ends = GrantEnds(self._loop, self._peers, self._preps, self.counters)  # sender/grant_ends.py
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvf-send", daemon=True)
        self._thread.start()

    # ---- memory ----
    def register(self, tensor) -> None:  # torch.Tensor
        """Register local memory that chunks will be sent from (e.g. this worker's staging pages)."""
        self._regs.append(self._call(self._agent.register_memory, tensor))
        self._tensors.append(tensor)
        self._metadata = self._call(self._agent.get_agent_metadata)
        start = tensor.data_ptr()
        self._ranges.append((start, start + tensor.numel() * tensor.element_size()))

    def _call(self, fn, *args):
        """Run `fn` on the NIXL thread from a caller's thread, and wait (bounded) for it."""
        async def run():
            return await self._nixl.call(fn, *args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    # ---- API ----
    def send(self, transfer_id: str, receiver: ReceiverAddr, chunk_keys: Sequence[bytes],
             chunks: Sequence[tuple[int, int]], num_tokens: int) -> concurrent.futures.Future[SendResult]:
        """Send `chunks` ((address, nbytes) in registered memory, one per key) for `transfer_id`:
        `reserve`, then one `write` of them all that notifies the receiver."""
        if len(chunk_keys) != len(chunks):
            raise ChunkError(f"{len(chunk_keys)} chunk keys for {len(chunks)} chunks")
        check_ranges(self._ranges, chunks)
        self._check_open(transfer_id)
        return asyncio.run_coroutine_threadsafe(
            self._send(transfer_id, receiver, list(chunk_keys), list(chunks), num_tokens, time.monotonic()),
            self._loop)

    def reserve(self, transfer_id: str, receiver: ReceiverAddr, chunk_keys: Sequence[bytes], num_tokens: int,
                keep_alive: bool = False, share: tuple[int, int] = (1, 0)) -> concurrent.futures.Future[Grant]:
        """Ask `receiver` for one page per key before the chunks exist (the alloc round trip runs
        while the caller computes them); `keep_alive` renews the lease until the notifying write.
        `share`: (writers, this writer) when several prefiller ranks write into the same pages."""
        self._check_open(transfer_id)
        return asyncio.run_coroutine_threadsafe(
            self._reserve(transfer_id, receiver, list(chunk_keys), num_tokens, time.monotonic(), keep_alive, share),
            self._loop)

    def write(self, grant: Grant, chunks: Sequence[tuple[int, int]], first: int = 0, notify: bool = False,
              runs: Sequence[np.ndarray] | None = None) -> concurrent.futures.Future[SendResult]:
        """Write `chunks` into the grant's pages from `first` on (straight to the NIXL thread); with
        `runs`, only those byte runs of each chunk (sender/descs.py). Only the last write may
        `notify` (the transfer is read once notified): post it after the others end."""
        self._check_open(grant.transfer_id)
        called = time.monotonic()
        out: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        region = pd_region(grant.peer)
        local, remote, nbytes, widest, prep = checked_descs(grant, chunks, first, runs, self._ranges, self._device_id)
        xf: concurrent.futures.Future[nixl_agent.XferDone] = concurrent.futures.Future()
        with grant.lock:  # against the receiver's drop (GrantEnds.cut), which reads `writes` on the loop
            refused = refusal(grant, widest, called)
            if refused is None:
                grant.posted = True
                grant.finishing = grant.finishing or notify
                grant.writes.add(xf)  # all before the post: once queued, the NIXL thread only waits for the GIL
        if refused is not None:
            err, reason = refused  # no reason: it ended (or was dropped) already, nothing to abort
            self._ends.fail(grant, out, err, reason) if reason else out.set_exception(err)
            return out
        xf.add_done_callback(lambda f: self._ends.written(grant, len(chunks), nbytes, called, notify, f, out))
        self._nixl.post("WRITE", local, self._mem, remote, region.mem_type,
                        grant.peer.agent, grant.notice if notify else b"", grant.deadline, xf, prep)
        return out

    def prepare(self, grant: Grant, chunks: Sequence[tuple[int, int]], first: int = 0,
                runs: Sequence[np.ndarray] | None = None) -> None:
        """Check and build now the descriptors of a later `write(grant, chunks, first, runs=runs)`
        (sender/prepared.py), which then only posts them; raises what that write would."""
        gen = self._preps.gen  # read before the check: a sleep from here on makes this preparation's handle stale
        self._check_open(grant.transfer_id)
        self._preps.make(grant, prepared.prepare(self._agent, grant, chunks, first, runs, self._ranges,
                                                 self._device_id, self._mem), gen)

    def release(self, grant: Grant, reason: str) -> None:
        """The caller will not finish this transfer: tell the receiver (see grants.nothing_in_flight)."""
        asyncio.run_coroutine_threadsafe(self._ends.end(grant, reason, abort=True), self._loop)

    def _check_open(self, transfer_id: str) -> None:
        if not self._thread.is_alive():
            raise SendError(f"transfer {transfer_id}: this sender is closed")
        if self._asleep:
            raise SendError(f"transfer {transfer_id}: this sender is asleep (vLLM sleep mode): its staging "
                            "memory is not registered")

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        finally:
            self._nixl.stop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._ctx.destroy(linger=0)
            self._thread.is_alive() or self._loop.close()

    async def _shutdown(self) -> None:
        # Transfers still running fail with CancelledError: no caller's future is left pending.
        me = asyncio.current_task()
        running = [t for t in asyncio.all_tasks() if t is not me]
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self._peers.close()
        for descs in self._regs:
            await self._nixl.call(self._agent.deregister_memory, descs)
        self._regs.clear()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- peers ----
    def _hello(self) -> m.Hello:
        return m.Hello(peer_id=self.cfg.sender_id, tp_rank=self.cfg.tp_rank, agent_name=self._agent.name,
                       agent_metadata=self._metadata, fingerprint=self.fingerprint)

    async def _peer(self, addr: ReceiverAddr) -> tuple[peering.Peer[AllocLink], bool]:
        peer, new = await self._peers.get(addr.host, addr.init_port, addr.alloc_port, self.cfg.handshake_timeout)
        if new:
            w = peer.welcome
            if w.region is None:
                self._peers.drop(peer, "no pd_buffer in its welcome")
                raise HandshakeFailed(f"receiver {addr} ({w.peer_id}) offers no pd_buffer to write into: is it a "
                                      "decoder's pd_peer_init_port?")
            peer.state.addr, peer.state.reader = addr, asyncio.ensure_future(self._read_allocs(peer))
            self.counters.handshakes += 1
            logger.info("connected to receiver %s (%s, epoch %d, %d pages of %d bytes)", addr, w.peer_id, w.epoch,
                        w.region.num_pages, w.region.page_bytes)
        return peer, new

    def _on_drop(self, peer: peering.Peer[AllocLink], why: str) -> None:
        self._preps.close_peer(peer)  # queued before the peer's agent is removed
        if peer.state.reader is not None:
            peer.state.reader.cancel()
        for fut in peer.state.pending.values():
            if not fut.done():
                fut.set_exception(SendError(f"connection to receiver {peer.state.addr} was reset: {why}"))

    async def _read_allocs(self, peer: peering.Peer[AllocLink]) -> None:
        """Route alloc replies (which may come out of order) to their transfers."""
        pending = peer.state.pending
        while True:
            body = await peer.sock.recv()
            try:
                reply = m.decode(body, expect=(m.AllocResponse, m.ErrorReply, m.LeaseRenewed, m.AbortTransfer))
            except m.MessageError as e:
                logger.warning("receiver %s sent a bad alloc reply: %s", peer.state.addr, e)
                continue
            if isinstance(reply, m.AbortTransfer):
                self._ends.dropped(peer, reply)
                continue
            fut = pending.pop(reply.transfer_id or "", None)
            if fut is not None and not fut.done():
                fut.set_result(reply)
            elif isinstance(reply, m.AllocResponse):
                # We gave up on it already and wrote nothing: the pages may go back at once.
                await send_abort(peer, reply.transfer_id, reply.generation, "sender gave up waiting", final=True)

    # ---- one transfer ----
    async def _send(self, tid: str, addr: ReceiverAddr, keys: list[bytes], chunks: list[tuple[int, int]],
                    num_tokens: int, t0: float) -> SendResult:
        grant = await self._reserve(tid, addr, keys, num_tokens, t0)
        return await asyncio.wrap_future(self.write(grant, chunks, 0, notify=True))

    async def _reserve(self, tid: str, addr: ReceiverAddr, keys: list[bytes], num_tokens: int,
                       t0: float, keep_alive: bool = False, share: tuple[int, int] = (1, 0)) -> Grant:
        try:
            try:
                grant = await self._reserve_once(tid, addr, keys, num_tokens, t0, share)
            except ReceiverRestarted:
                logger.info("receiver %s restarted: handshaking again", addr)
                grant = await self._reserve_once(tid, addr, keys, num_tokens, t0, share)
        except ReceiverRestarted as e:
            self.counters.failed += 1
            raise AllocFailed("stale_epoch", f"receiver {addr} refused transfer {tid} twice: {e}") from None
        except SendError:
            self.counters.failed += 1
            raise
        if keep_alive:
            asyncio.ensure_future(renew_until_done(grant, self.cfg.handshake_timeout))
        return grant

    async def _reserve_once(self, tid: str, addr: ReceiverAddr, keys: list[bytes], num_tokens: int,
                            t0: float, share: tuple[int, int]) -> Grant:
        began = time.monotonic()
        peer, handshook = await self._peer(addr)
        region = pd_region(peer)
        pending = peer.state.pending
        fut = asyncio.get_running_loop().create_future()
        pending[tid] = fut
        peer.busy += 1  # until the grant ends (GrantEnds.end): the peer is not dropped for room meanwhile
        granted = False
        try:
            sent_at = time.monotonic()
            wait = self.cfg.alloc_timeout + self.cfg.handshake_timeout
            request = m.encode(m.AllocRequest(transfer_id=tid, sender_id=self.cfg.sender_id, epoch=peer.welcome.epoch,
                                              chunk_keys=keys, num_tokens=num_tokens, writers=share[0],
                                              writer=share[1]))
            try:
                # The send is bounded too: with the receiver gone, ZMQ's queue can fill up.
                await asyncio.wait_for(peer.sock.send(request), wait)
                reply = await asyncio.wait_for(fut, max(0.0, sent_at + wait - time.monotonic()))
            except TimeoutError:
                self.samples.add(ALLOC_SAMPLES, self.counters.waited(sent_at))
                pending.pop(tid, None)
                await send_abort(peer, tid, 0, "alloc timed out", final=True)
                raise AllocFailed("timeout", f"receiver {addr} did not answer the alloc for transfer {tid} within "
                                             f"{wait:.1f}s (pd_alloc_timeout + pd_handshake_timeout)") from None
            self.samples.add(ALLOC_SAMPLES, self.counters.waited(sent_at))
            if isinstance(reply, m.ErrorReply):
                if reply.code == "stale_epoch":
                    self._peers.drop(peer, "the receiver restarted")
                    raise ReceiverRestarted(reply.message)
                raise AllocFailed(reply.code, f"receiver {addr} refused transfer {tid}: {reply.message}")
            if len(keys) != len(reply.pages) or any(p >= region.num_pages for p in reply.pages) or \
                    len(set(reply.pages)) != len(reply.pages):
                await send_abort(peer, tid, reply.generation, "bad page list", final=True)
                raise SendError(f"receiver {addr} answered transfer {tid} with a page list that does not match")
            now = time.monotonic()
            phases = {"to_loop": began - t0, "alloc": now - sent_at}
            if handshook:
                phases["handshake"] = sent_at - began
            granted = True
            grant = Grant(tid, addr, peer, reply.generation, list(reply.pages),
                          sent_at + reply.lease_seconds * (1 - LEASE_MARGIN), t0, phases, handshook,
                          reply.lease_seconds, share=share)
            peer.state.grants[tid] = grant
            why = peer.state.early_drops.pop(tid, None)
            if why is not None:
                self._ends.cut(grant, why)
            return grant
        finally:
            if not granted:
                peer.busy -= 1

    # ---- vLLM sleep mode: the caller drained the writes that read the registered memory ----
    def suspend(self) -> None:
        """vLLM sleep mode: deregister every region from NIXL; the caller drained the writes that
        read them. Sends are refused until resume(). Idempotent."""
        if self._asleep:
            return
        self._asleep = True
        self._preps.close_all()  # no prepared handle outlives the registrations it reads
        for descs in self._regs:
            self._call(self._agent.deregister_memory, descs)
        self._regs.clear()
        self._metadata = self._call(self._agent.get_agent_metadata)

    def resume(self) -> None:
        """Register the same regions again (vLLM remapped them at the same addresses). Idempotent."""
        if not self._asleep:
            return
        self._regs = [self._call(self._agent.register_memory, t) for t in self._tensors]
        self._metadata = self._call(self._agent.get_agent_metadata)
        self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep
