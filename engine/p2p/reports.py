"""What one P2P service tells others: the controller hears its CPU tier's admissions and drops,
heartbeats and transfers; its own scheduler hears what a controller's move put in or took out."""

from __future__ import annotations

import asyncio
import queue

import torch
import zmq
import zmq.asyncio

from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.supervise import LoopHealth
from kvferry.common.wire import messages as m
from kvferry.engine.tiers.cpu import CPUTier
from kvferry.sender.lender import ChunkLender

logger = get_logger(__name__)

LOCATION = "LocalCPUBackend"
REPORT_S = 0.02  # admissions/evictions go to the controller at most this late
REPORT_BATCH = 4096


class ControllerReports:
    """Runs on the service's asyncio loop, except :meth:`on_tier` (the CPU tier's listener, any thread)."""

    def __init__(self, info: m.WorkerInfo, cpu: CPUTier, lender: ChunkLender, push: zmq.asyncio.Socket,
                 notice: zmq.asyncio.Socket, heartbeat_s: float, health: dict[str, LoopHealth]) -> None:
        self.info, self.cpu, self.lender, self.heartbeat_s, self.health = info, cpu, lender, heartbeat_s, health
        self._push, self._notice = push, notice
        self._warn = RateLimitedLog(logger)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._news: set[bytes] = set()  # a later put of these is news to the planner (moves, drops)
        self._lock = asyncio.Lock()

    def send(self, msg: m.Msg) -> None:
        try:
            self._push.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the controller is away and the queue is full: the next resync fixes it
            self._warn.warning("P2P service: a report to the controller was dropped (%s)", e)

    def on_tier(self, event: str, key: bytes, data: torch.Tensor) -> None:
        self._events.put((event, key, data))

    def news(self, keys: list[bytes] | tuple[bytes, ...] | set[bytes]) -> None:
        """A later put of these keys is news to the planner (a move brought them, or they were dropped)."""
        self._news.update(keys)

    def transfer(self, loop: asyncio.AbstractEventLoop, peer_id: str, chunks: int, nbytes: int, seconds: float,
                 ok: bool, kind: str) -> None:
        msg = m.TransferReport(instance_id=self.info.instance_id, peer_id=peer_id, num_chunks=chunks, nbytes=nbytes,
                               seconds=seconds, ok=ok, kind=kind)
        loop.call_soon_threadsafe(self.send, msg)

    async def heartbeat_loop(self) -> None:
        while True:
            self.send(m.Heartbeat(worker=self.info, num_chunks=len(self.cpu), used_bytes=self.cpu.used))
            self.health["heartbeats"].recovered()
            await asyncio.sleep(self.heartbeat_s)

    async def report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            await self.report()
            await self.lender.expire()
            self.health["reports"].recovered()

    async def report(self) -> None:
        """Send what the CPU tier admitted and dropped since the last call, in order."""
        async with self._lock:
            await self._report_locked()

    async def _report_locked(self) -> None:
        admit: dict[bytes, int] = {}
        evict: list[bytes] = []
        adopted: list[tuple[bytes, int]] = []
        while True:
            try:
                event, key, data = self._events.get_nowait()
            except queue.Empty:
                break
            if event == "put":
                admit[key] = data.numel()
                await self.lender.added(key, data)
                if key in self._news:
                    self._news.discard(key)
                    adopted.append((key, data.numel()))
            else:
                admit.pop(key, None)
                evict.append(key)
                await self.lender.removed(key, data)
        info = self.info
        for i in range(0, len(evict), REPORT_BATCH):
            self.send(m.ChunkEvict(instance_id=info.instance_id, worker_id=info.worker_id, epoch=info.epoch,
                                   location=LOCATION, keys=evict[i:i + REPORT_BATCH]))
        items = list(admit.items())
        for i in range(0, len(items), REPORT_BATCH):
            part = items[i:i + REPORT_BATCH]
            self.send(m.ChunkAdmit(instance_id=info.instance_id, worker_id=info.worker_id, epoch=info.epoch,
                                   location=LOCATION, keys=[k for k, _ in part], sizes=[n for _, n in part]))
        if adopted:
            self.tell_planner(adopted, [])

    async def resync(self) -> int:
        """Send a snapshot of the CPU tier (what is queued first; the snapshot then supersedes it)."""
        await self.report()
        keys = self.cpu.keys()
        sizes = [d.numel() if (d := self.cpu.get(k)) is not None else 0 for k in keys]
        info = self.info
        for i in range(0, max(len(keys), 1), REPORT_BATCH):
            self.send(m.ChunkAdmit(instance_id=info.instance_id, worker_id=info.worker_id, epoch=info.epoch,
                                   location=LOCATION, keys=keys[i:i + REPORT_BATCH],
                                   sizes=sizes[i:i + REPORT_BATCH], reset=i == 0))
        return len(keys)

    def tell_planner(self, adopted: list[tuple[bytes, int]], dropped: list[bytes]) -> None:
        for i in range(0, max(len(adopted), len(dropped), 1), REPORT_BATCH):
            a = adopted[i:i + REPORT_BATCH]
            try:  # NOBLOCK: the scheduler is this process's own; if it is not reading, do not wait
                self._notice.send(m.encode(m.TierNotice(adopted=[k for k, _ in a], sizes=[n for _, n in a],
                                                        dropped=dropped[i:i + REPORT_BATCH])), zmq.NOBLOCK)
            except zmq.ZMQError as e:
                self._warn.warning("P2P service: a notice to the scheduler was dropped (%s)", e)
