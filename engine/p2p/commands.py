"""The controller's commands to one P2P service (``lmcache_worker_ports``): pull chunks from a
peer into the CPU tier (a move), drop some, clear all, or resync the controller's view."""

from __future__ import annotations

import asyncio
import time

import zmq.asyncio

from kvferry.buffer import peering
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.units import fmt_bytes
from kvferry.common.wire import messages as m
from kvferry.engine.p2p.fetching import P2PError, PeerFetcher
from kvferry.engine.p2p.reports import ControllerReports
from kvferry.engine.tiers.cpu import CPUTier

logger = get_logger(__name__)


class ControllerCommands:
    """Carries out each command on the service's loop and answers the controller with its result."""

    def __init__(self, cpu: CPUTier, reports: ControllerReports, fetcher: PeerFetcher,
                 loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.cpu, self.reports, self.fetcher, self.loop, self.timeout = cpu, reports, fetcher, loop, timeout
        self._warn = RateLimitedLog(logger)

    async def on_command(self, sock: zmq.asyncio.Socket, ident: bytes, body: bytes) -> None:
        try:
            msg = m.decode(body, expect=(m.PullChunks, m.DropChunks, m.ClearChunks, m.Resync))
        except m.MessageError as e:
            await peering.reply(sock, ident, m.ErrorReply(code="bad_message", message=str(e)[:4000]))
            return
        try:
            result = await self.run(msg)
        except Exception as e:  # noqa: BLE001 - the controller hears what failed; the port serves on
            logger.exception("P2P service: command %s failed", type(msg).__name__)
            result = m.CommandResult(event_id=msg.event_id, ok=False, message=f"{type(e).__name__}: {e}"[:4000])
        await peering.reply(sock, ident, result)

    async def run(self, msg: m.PullChunks | m.DropChunks | m.ClearChunks | m.Resync) -> m.CommandResult:
        if isinstance(msg, m.PullChunks):
            return await self._pull(msg)
        if isinstance(msg, m.DropChunks):
            n = nbytes = 0
            for key in msg.keys:
                d = self.cpu.get(key)
                if d is not None and self.cpu.delete(key):
                    n, nbytes = n + 1, nbytes + d.numel()
                    self.reports.news((key,))
            self.reports.tell_planner([], list(msg.keys))
            return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=n, nbytes=nbytes)
        if isinstance(msg, m.ClearChunks):
            keys = self.cpu.keys()
            n = self.cpu.clear()
            self.reports.news(keys)
            self.reports.tell_planner([], keys)
            logger.info("P2P service: CPU tier cleared by the controller (%d chunks)", n)
            return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=n)
        n = await self.reports.resync()
        return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=n)

    async def _pull(self, msg: m.PullChunks) -> m.CommandResult:
        want = [k for k in msg.keys if self.cpu.get(k) is None]
        t0 = time.monotonic()
        try:
            # Evicting is the scheduler's decision, so a move only fills free space.
            datas = await self.fetcher.read(msg.source, want, None, self.timeout,
                                            max_bytes=self.cpu.capacity - self.cpu.used, peer_id=msg.source_id) \
                if want else []
        except P2PError as e:
            # Nothing of a failed pull is adopted: a chunk of the wrong size or bytes never enters the tier.
            self._warn.warning("P2P move of %d chunks from %s failed: %s", len(want), msg.source_id, e)
            self.reports.transfer(self.loop, msg.source_id, 0, 0, time.monotonic() - t0, False, "move")
            return m.CommandResult(event_id=msg.event_id, ok=False, message=str(e))
        nbytes = sum(d.numel() for d in datas)
        for k, d in zip(want, datas, strict=False):
            self.reports.news((k,))  # the put below is news to the planner
            self.cpu.put(k, d)
        await self.reports.report()
        self.reports.transfer(self.loop, msg.source_id, len(datas), nbytes, time.monotonic() - t0, True, "move")
        logger.info("P2P service: moved in %d chunks (%s) from %s", len(datas), fmt_bytes(nbytes), msg.source_id)
        return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=len(datas), nbytes=nbytes)
