"""Reading chunks from a peer's CPU tier: a lease on its lookup port, then one NIXL READ, checked
(receiver/peer_reader.py), in bounded time. Any failure is a counted miss, never a crash."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvferry.buffer import peering
from kvferry.common.counters import Counters
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.units import fmt_bytes
from kvferry.common.wire import messages as m
from kvferry.engine.p2p.reports import ControllerReports
from kvferry.engine.tiers.cpu import CPUTier
from kvferry.receiver.peer_reader import BadPeerAnswer, FetchError, PeerReader

logger = get_logger(__name__)

P2PError = FetchError  # a fetch from a peer failed; the caller recomputes


@dataclass
class FetchCounters(Counters):
    """kvferry:p2p_errors and kvferry:p2p_rejected (the latter also counted in the former)."""

    p2p_errors: int = 0
    p2p_rejected: int = 0


class PeerFetcher:
    """Fetches for a request's load (:meth:`fetch`, any thread) and a controller's move (:meth:`read`)."""

    def __init__(self, instance_id: str, cpu: CPUTier, reader: PeerReader, reports: ControllerReports,
                 loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.instance_id, self.cpu, self.reader, self.reports = instance_id, cpu, reader, reports
        self.loop, self.timeout = loop, timeout
        self.counters = FetchCounters()
        self._warn = RateLimitedLog(logger)

    async def read(self, addr: m.PeerAddr, keys: Sequence[bytes], sizes: Sequence[int] | None,
                   timeout: float, max_bytes: int | None = None, peer_id: str | None = None
                   ) -> list[torch.Tensor]:
        """The leading chunks of `keys` the peer holds (all of them when `sizes` is given, else
        P2PError), READ into new CPU memory and checked; P2PError beyond `max_bytes`, and for
        anything else that fails (BadPeerAnswer when the peer's answer or bytes were wrong)."""
        deadline = time.monotonic() + timeout
        try:
            peer, reply = await self.reader.lease(addr, keys, deadline, sizes, peer_id)
            need = sum(reply.sizes)
            if max_bytes is not None and need > max_bytes:
                await self.reader.release(peer, reply.lease_id)
                raise P2PError(f"{self.instance_id}'s CPU tier has {fmt_bytes(max(max_bytes, 0))} free of "
                               f"{fmt_bytes(self.cpu.capacity)}; the move needs {fmt_bytes(need)}: raise "
                               "max_local_cpu_size, move fewer tokens, or POST /clear it first")
            return await self.reader.read(peer, reply, keys, deadline)
        except P2PError as e:
            self.counters.p2p_errors += 1
            if isinstance(e, BadPeerAnswer):
                self.counters.p2p_rejected += 1
            raise
        except Exception as e:  # noqa: BLE001 - whatever a peer makes fail here is a miss, not a crash
            self.counters.p2p_errors += 1
            logger.debug("P2P fetch failed", exc_info=True)
            raise P2PError(f"{type(e).__name__}: {e}") from None

    def fetch(self, peer_id: str | None, addr: m.PeerAddr, keys: Sequence[bytes], sizes: Sequence[int]) -> \
            list[torch.Tensor] | None:
        """A request's load (from vLLM's worker thread): every chunk, checked, or None (then
        recompute); never raises. `peer_id`: the instance the controller named (checked)."""
        timeout = self.timeout
        t0 = time.monotonic()
        fut = asyncio.run_coroutine_threadsafe(self.read(addr, keys, sizes, timeout, peer_id=peer_id), self.loop)
        try:
            out = fut.result(timeout + sum(sizes) / (peering.MIN_GBPS * 1e9) + 1.0)
        except Exception as e:  # noqa: BLE001 - this runs in vLLM's worker: any failure is a miss
            fut.cancel()
            if not isinstance(e, (P2PError, concurrent.futures.TimeoutError)):
                self.counters.p2p_errors += 1
            self._warn.warning("P2P fetch of %d chunks from %s failed: %s; recomputing", len(keys), peer_id or "?",
                               e or "timed out")
            self.reports.transfer(self.loop, peer_id or "?", 0, 0, time.monotonic() - t0, False, "p2p")
            return None
        self.reports.transfer(self.loop, peer_id or "?", len(out), sum(sizes), time.monotonic() - t0, True, "p2p")
        return out
