"""P2P sharing of the CPU tier between instances, coordinated by kvferry-controller.

Worker side (:class:`P2PWorker`, one per TP rank, its own thread and asyncio loop):

- registers with the controller, heartbeats, and reports every chunk its CPU tier admits or drops;
- lends its CPU tier to peers (sender/lender.py: handshake on `p2p_init_ports`, leases on
  `p2p_lookup_ports`); the peer then READs the chunks over NIXL;
- reads from peers the same way (receiver/peer_reader.py) for a request's load or a controller's
  move, in bounded time;
- carries out the controller's commands on `lmcache_worker_ports` (pull, drop, clear, resync),
  telling its own scheduler what appeared in or left its CPU tier (:class:`PlannerNotices`).

Every socket is made by common/zsock.py (the cluster secret, when set, on all of them), and the
handshake, peer table and fingerprint check are the ones PD transfers use (buffer/peering.py).
What a peer answers is checked before NIXL uses it, and with the secret every chunk carries a
keyed MAC (receiver/peer_reader.py); a peer that fails a check is a counted miss
(``p2p_rejected``), never an exception in vLLM's worker.
Background loops log and restart when they fail (common/supervise.py).

Scheduler side (:class:`ControllerLookup`): "who holds the longest prefix of these chunks?",
bounded, and skipped with a back-off while the controller does not answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import random
import sys
import threading
import time
import uuid
from collections.abc import Sequence

import torch
import zmq
import zmq.asyncio

from kvferry.buffer import nixl_agent, peering
from kvferry.common import chunk_mac, zsock
from kvferry.common import messages as m
from kvferry.common.backoff import Backoff
from kvferry.common.config import ConfigError, KVFerryConfig
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.supervise import LoopHealth, supervise
from kvferry.common.units import fmt_bytes
from kvferry.engine.tiers.cpu import CPUTier
from kvferry.receiver.peer_reader import BadPeerAnswer, FetchError, PeerReader
from kvferry.sender.lender import ChunkLender

logger = get_logger(__name__)

LOCATION = "LocalCPUBackend"
REPORT_S = 0.02  # admissions/evictions go to the controller at most this late
REPORT_BATCH = 4096
POLL_S = 0.0002

P2PError = FetchError  # a fetch from a peer failed; the caller recomputes


def _url(hostport: str) -> str:
    return hostport if "://" in hostport else f"tcp://{hostport}"


def notice_addr(engine_id: str) -> str:
    """The ipc address the worker tells its scheduler about adopted and dropped chunks on.

    Linux: an abstract socket (no file; gone with the process, which vLLM may SIGKILL)."""
    if sys.platform.startswith("linux"):
        return f"ipc://@kvferry-p2p-{engine_id}"
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"ipc://{base}/kvferry-p2p-{engine_id}.sock"


# ---------------------------------------------------------------- scheduler side
class ControllerLookup:
    """The scheduler's bounded lookups on the controller's reply port."""

    def __init__(self, cfg: KVFerryConfig, timeout: float) -> None:
        self.url = _url(cfg.controller_reply_url)
        self.instance_id, self.timeout = cfg.lmcache_instance_id, timeout
        self.trust = zsock.trust_of(cfg)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._backoff = Backoff(f"controller {cfg.controller_reply_url}", logger)
        self.errors = 0

    def lookup(self, keys: Sequence[bytes]) -> m.LookupResponse | None:
        """The instance holding the longest prefix of `keys`; None when the controller is away."""
        if not keys or not self._backoff.up():
            return None
        if self._sock is None:
            self._sock = zsock.connect(self._ctx, zmq.DEALER, self.trust, self.url)
        try:
            # NOBLOCK: with the controller away (or refusing our secret) a send would wait for good.
            self._sock.send(m.encode(m.LookupRequest(instance_id=self.instance_id, keys=list(keys[:1 << 16]))),
                            zmq.NOBLOCK)
            if not self._sock.poll(int(self.timeout * 1000), zmq.POLLIN):
                raise TimeoutError(f"no answer within {self.timeout:g}s")
            reply = m.decode(self._sock.recv(), expect=m.LookupResponse)
        except (TimeoutError, zmq.ZMQError, m.MessageError) as e:
            self.errors += 1
            self._sock.close(linger=0)  # a late answer must not be read as the next one's
            self._sock = None
            self._backoff.failed("lookup", e, "P2P lookups skipped")
            return None
        self._backoff.ok()
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class PlannerNotices:
    """Scheduler side of the worker -> scheduler channel: chunks a move put into or took out of
    the worker's CPU tier, which the planner's index must learn about."""

    def __init__(self, addr: str, trust: zsock.Trust = zsock.PLAIN) -> None:
        self.addr = addr
        self._sock = zsock.socket(zmq.Context.instance(), zmq.PULL, trust, server=True)
        self._path = addr.removeprefix("ipc://")
        if not self._path.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
        self._sock.bind(addr)

    def drain(self) -> tuple[list[tuple[bytes, int]], list[bytes]]:
        """(adopted (key, bytes), dropped keys) since the last call, in order."""
        adopted: list[tuple[bytes, int]] = []
        dropped: list[bytes] = []
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return adopted, dropped
            try:
                msg = m.decode(frame, expect=m.TierNotice)
            except m.MessageError as e:
                logger.warning("bad notice from the P2P worker: %s", e)
                continue
            gone = set(msg.dropped)
            adopted = [(k, n) for k, n in adopted if k not in gone]
            dropped += msg.dropped
            adopted += zip(msg.adopted, msg.sizes, strict=True)

    def close(self) -> None:
        self._sock.close(linger=0)
        if not self._path.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)


# ---------------------------------------------------------------- worker side
class P2PWorker:
    """One TP rank's P2P side (see the module docstring). Its public calls are thread-safe."""

    def __init__(self, cfg: KVFerryConfig, cpu: CPUTier, tp_rank: int, tp_size: int, salt: bytes,
                 fingerprint: m.LayoutFingerprint, notices: str) -> None:
        self.cfg, self.cpu, self.rank, self.fp = cfg, cpu, tp_rank, fingerprint
        init, look, work = (cfg.ports(k) for k in ("p2p_init_ports", "p2p_lookup_ports", "lmcache_worker_ports"))
        if tp_rank >= len(init):
            raise ConfigError(f"config key p2p_init_ports lists {len(init)} port(s); this instance has TP rank "
                              f"{tp_rank}: give one port per TP rank in p2p_init_ports, p2p_lookup_ports and "
                              "lmcache_worker_ports")
        self.trust = zsock.trust_of(cfg)
        self.epoch = uuid.uuid4().hex[:12]
        self.info = m.WorkerInfo(
            instance_id=cfg.lmcache_instance_id, worker_id=tp_rank, epoch=self.epoch, host=cfg.p2p_host,
            worker_port=work[tp_rank], p2p_init_port=init[tp_rank], p2p_lookup_port=look[tp_rank],
            tp_size=tp_size, salt=salt, chunk_size=cfg.chunk_size, partial_chunks=cfg.save_unfull_chunk,
            heartbeat_timeout=cfg.lmcache_worker_heartbeat_timeout, cpu_capacity=cpu.capacity)
        self.counters = {"p2p_errors": 0, "p2p_rejected": 0}
        self.mac = chunk_mac.for_secret(self.trust.secret)  # None without a secret: chunks carry no tag
        self.health = {name: LoopHealth(f"P2P worker {cfg.lmcache_instance_id} rank {tp_rank}: {name}")
                       for name in ("heartbeats", "reports")}
        self._warn = RateLimitedLog(logger)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._news: set[bytes] = set()  # a later put of these is news to the planner (moves, drops)
        self._tasks: list[asyncio.Task] = []
        self._socks: list[zmq.asyncio.Socket] = []
        self._report_lock: asyncio.Lock | None = None
        self._notice_addr = notices
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"kvf-p2p-{tp_rank}", daemon=True)
        self._thread.start()
        try:
            self._call(self._start(), 15.0)
        except BaseException:
            self.close()
            raise
        cpu.listener = self._on_tier

    # ---- lifecycle ----
    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        me = self.info.instance_id
        self.agent = nixl_agent.make_agent(f"kvf-p2p-{me}-{self.rank}-{self.epoch}")
        self.nixl = nixl_agent.NixlThread(self.agent, self.loop, POLL_S, name=f"kvf-p2p-nixl-{self.rank}")
        self.lender = ChunkLender(self.cpu, self.nixl, self.fp, me, random.SystemRandom().randrange(1, 1 << 62),
                                  2 * self.cfg.blocking_timeout_secs, mac=self.mac)
        await self.lender.start()
        self.reader = PeerReader(self.ctx, self.trust, self.nixl, self._hello, self.fp, me, self.cpu.alloc,
                                 self.cpu.arena, mac=self.mac)
        host = self.cfg.p2p_host
        ports = ((self.info.p2p_init_port, "p2p_init_ports", self.lender.on_hello),
                 (self.info.p2p_lookup_port, "p2p_lookup_ports", self.lender.on_fetch),
                 (self.info.worker_port, "lmcache_worker_ports", self._on_command))
        for port, key, handler in ports:
            try:
                sock = zsock.listen(self.ctx, zmq.ROUTER, self.trust, host, port, f"config key {key}")
            except zsock.BindError as e:
                raise ConfigError(f"{e} (give each instance and TP rank its own port)") from None
            self._socks.append(sock)
            self._tasks.append(asyncio.ensure_future(peering.serve(sock, handler, key, self._bad_frame)))
        self._push = zsock.connect(self.ctx, zmq.PUSH, self.trust,
                                   _url(self.cfg.controller_pull_url or self.cfg.controller_url))
        self._push.setsockopt(zmq.SNDHWM, 10000)
        self._notice = zsock.connect(self.ctx, zmq.PUSH, self.trust, self._notice_addr)
        self._socks += [self._push, self._notice]
        self._send(m.RegisterWorker(worker=self.info))
        for name, fn in (("heartbeats", self._heartbeat_loop), ("reports", self._report_loop)):
            self._tasks.append(asyncio.ensure_future(supervise(self.health[name], fn)))
        logger.info("P2P worker %s rank %d: peers on %s:%d (init) / %d (lookup), controller commands on %d",
                    me, self.rank, host, self.info.p2p_init_port, self.info.p2p_lookup_port, self.info.worker_port)

    def _hello(self) -> m.Hello:
        return m.Hello(peer_id=self.info.instance_id, tp_rank=self.rank, agent_name=self.agent.name,
                       agent_metadata=self.lender.metadata, fingerprint=self.fp)

    def _bad_frame(self, why: str) -> None:
        self._warn.warning("P2P worker %s: rejected %s", self.info.instance_id, why)

    def close(self) -> None:
        """Deregister, stop the thread, free every registration; bounded."""
        self.cpu.listener = None
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._call(self._stop(), 5.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)

    async def _stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "_push"):
            with contextlib.suppress(zmq.ZMQError):
                await self._push.send(m.encode(m.DeregisterWorker(instance_id=self.info.instance_id,
                                                                  worker_id=self.rank, epoch=self.epoch)),
                                      zmq.NOBLOCK)
        if hasattr(self, "reader"):
            self.reader.peers.close()
        if hasattr(self, "lender"):
            await self.lender.close()
        if hasattr(self, "nixl"):
            self.nixl.stop()
        if hasattr(self, "ctx"):
            for s in self._socks:
                s.close(linger=0)
            self.ctx.destroy(linger=0)

    def _send(self, msg: m.Msg) -> None:
        try:
            self._push.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the controller is away and the queue is full: the next resync fixes it
            self._warn.warning("P2P worker: a report to the controller was dropped (%s)", e)

    # ---- reports to the controller ----
    def _on_tier(self, event: str, key: bytes, data: torch.Tensor) -> None:
        self._events.put((event, key, data))

    async def _heartbeat_loop(self) -> None:
        while True:
            self._send(m.Heartbeat(worker=self.info, num_chunks=len(self.cpu), used_bytes=self.cpu.used))
            self.health["heartbeats"].recovered()
            await asyncio.sleep(self.cfg.lmcache_worker_heartbeat_time)

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            await self._report()
            await self.lender.expire()
            self.health["reports"].recovered()

    async def _report(self) -> None:
        """Send what the CPU tier admitted and dropped since the last call, in order."""
        if self._report_lock is None:
            self._report_lock = asyncio.Lock()
        async with self._report_lock:
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
        for i in range(0, len(evict), REPORT_BATCH):
            self._send(m.ChunkEvict(instance_id=self.info.instance_id, worker_id=self.rank, epoch=self.epoch,
                                    location=LOCATION, keys=evict[i:i + REPORT_BATCH]))
        items = list(admit.items())
        for i in range(0, len(items), REPORT_BATCH):
            part = items[i:i + REPORT_BATCH]
            self._send(m.ChunkAdmit(instance_id=self.info.instance_id, worker_id=self.rank, epoch=self.epoch,
                                    location=LOCATION, keys=[k for k, _ in part], sizes=[n for _, n in part]))
        if adopted:
            self._tell_planner(adopted, [])

    def _tell_planner(self, adopted: list[tuple[bytes, int]], dropped: list[bytes]) -> None:
        for i in range(0, max(len(adopted), len(dropped), 1), REPORT_BATCH):
            a = adopted[i:i + REPORT_BATCH]
            try:  # NOBLOCK: the scheduler is this process's own; if it is not reading, do not wait
                self._notice.send(m.encode(m.TierNotice(adopted=[k for k, _ in a], sizes=[n for _, n in a],
                                                        dropped=dropped[i:i + REPORT_BATCH])), zmq.NOBLOCK)
            except zmq.ZMQError as e:
                self._warn.warning("P2P worker: a notice to the scheduler was dropped (%s)", e)

    # ---- fetching from peers ----
    async def _fetch(self, addr: m.PeerAddr, keys: Sequence[bytes], sizes: Sequence[int] | None,
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
                raise P2PError(f"{self.info.instance_id}'s CPU tier has {fmt_bytes(max(max_bytes, 0))} free of "
                               f"{fmt_bytes(self.cpu.capacity)}; the move needs {fmt_bytes(need)}: raise "
                               "max_local_cpu_size, move fewer tokens, or POST /clear it first")
            return await self.reader.read(peer, reply, keys, deadline)
        except P2PError as e:
            self.counters["p2p_errors"] += 1
            if isinstance(e, BadPeerAnswer):
                self.counters["p2p_rejected"] += 1
            raise
        except Exception as e:  # noqa: BLE001 - whatever a peer makes fail here is a miss, not a crash
            self.counters["p2p_errors"] += 1
            logger.debug("P2P fetch failed", exc_info=True)
            raise P2PError(f"{type(e).__name__}: {e}") from None

    def fetch(self, peer_id: str | None, addr: m.PeerAddr, keys: Sequence[bytes], sizes: Sequence[int]) -> \
            list[torch.Tensor] | None:
        """A request's load (from vLLM's worker thread): every chunk, checked, or None (then
        recompute); never raises. `peer_id`: the instance the controller named (checked)."""
        timeout = self.cfg.blocking_timeout_secs
        t0 = time.monotonic()
        fut = asyncio.run_coroutine_threadsafe(self._fetch(addr, keys, sizes, timeout, peer_id=peer_id), self.loop)
        try:
            out = fut.result(timeout + sum(sizes) / (peering.MIN_GBPS * 1e9) + 1.0)
        except Exception as e:  # noqa: BLE001 - this runs in vLLM's worker: any failure is a miss
            fut.cancel()
            if not isinstance(e, (P2PError, concurrent.futures.TimeoutError)):
                self.counters["p2p_errors"] += 1
            self._warn.warning("P2P fetch of %d chunks from %s failed: %s; recomputing", len(keys), peer_id or "?",
                               e or "timed out")
            self._report_transfer(peer_id or "?", 0, 0, time.monotonic() - t0, False, "p2p")
            return None
        self._report_transfer(peer_id or "?", len(out), sum(sizes), time.monotonic() - t0, True, "p2p")
        return out

    def _report_transfer(self, peer_id: str, chunks: int, nbytes: int, seconds: float, ok: bool, kind: str) -> None:
        msg = m.TransferReport(instance_id=self.info.instance_id, peer_id=peer_id, num_chunks=chunks, nbytes=nbytes,
                               seconds=seconds, ok=ok, kind=kind)
        self.loop.call_soon_threadsafe(self._send, msg)

    # ---- the controller's commands ----
    async def _on_command(self, sock: zmq.asyncio.Socket, ident: bytes, body: bytes) -> None:
        try:
            msg = m.decode(body, expect=(m.PullChunks, m.DropChunks, m.ClearChunks, m.Resync))
        except m.MessageError as e:
            await peering.reply(sock, ident, m.ErrorReply(code="bad_message", message=str(e)[:4000]))
            return
        try:
            result = await self._command(msg)
        except Exception as e:  # noqa: BLE001 - the controller hears what failed; the port serves on
            logger.exception("P2P worker: command %s failed", type(msg).__name__)
            result = m.CommandResult(event_id=msg.event_id, ok=False, message=f"{type(e).__name__}: {e}"[:4000])
        await peering.reply(sock, ident, result)

    async def _command(self, msg: m.Msg) -> m.CommandResult:
        if isinstance(msg, m.PullChunks):
            return await self._pull(msg)
        if isinstance(msg, m.DropChunks):
            n = nbytes = 0
            for key in msg.keys:
                d = self.cpu.get(key)
                if d is not None and self.cpu.delete(key):
                    n, nbytes = n + 1, nbytes + d.numel()
                    self._news.add(key)
            self._tell_planner([], list(msg.keys))
            return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=n, nbytes=nbytes)
        if isinstance(msg, m.ClearChunks):
            keys = self.cpu.keys()
            n = self.cpu.clear()
            self._news.update(keys)
            self._tell_planner([], keys)
            logger.info("P2P worker: CPU tier cleared by the controller (%d chunks)", n)
            return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=n)
        await self._report()  # Resync: what is queued first, the snapshot then supersedes it
        keys = self.cpu.keys()
        sizes = [d.numel() if (d := self.cpu.get(k)) is not None else 0 for k in keys]
        for i in range(0, max(len(keys), 1), REPORT_BATCH):
            self._send(m.ChunkAdmit(instance_id=self.info.instance_id, worker_id=self.rank, epoch=self.epoch,
                                    location=LOCATION, keys=keys[i:i + REPORT_BATCH],
                                    sizes=sizes[i:i + REPORT_BATCH], reset=i == 0))
        return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=len(keys))

    async def _pull(self, msg: m.PullChunks) -> m.CommandResult:
        want = [k for k in msg.keys if self.cpu.get(k) is None]
        t0 = time.monotonic()
        try:
            # Evicting is the scheduler's decision, so a move only fills free space.
            datas = await self._fetch(msg.source, want, None, self.cfg.blocking_timeout_secs,
                                      max_bytes=self.cpu.capacity - self.cpu.used, peer_id=msg.source_id) \
                if want else []
        except P2PError as e:
            # Nothing of a failed pull is adopted: a chunk of the wrong size or bytes never enters the tier.
            self._warn.warning("P2P move of %d chunks from %s failed: %s", len(want), msg.source_id, e)
            self._report_transfer(msg.source_id, 0, 0, time.monotonic() - t0, False, "move")
            return m.CommandResult(event_id=msg.event_id, ok=False, message=str(e))
        nbytes = sum(d.numel() for d in datas)
        for k, d in zip(want, datas, strict=False):
            self._news.add(k)  # the put below is news to the planner
            self.cpu.put(k, d)
        await self._report()
        self._report_transfer(msg.source_id, len(datas), nbytes, time.monotonic() - t0, True, "move")
        logger.info("P2P worker: moved in %d chunks (%s) from %s", len(datas), fmt_bytes(nbytes), msg.source_id)
        return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=len(datas), nbytes=nbytes)

    def stats(self) -> dict[str, float]:
        restarts = sum(h.restarts for h in self.health.values())
        return {**self.counters, **self.reader.counters, **self.lender.counters, "p2p_loop_restarts": restarts}
