"""P2P sharing of the CPU tier between instances, coordinated by kvferry-controller.

Worker side (:class:`P2PWorker`, one per TP rank, its own thread and asyncio loop):

- registers with the controller, heartbeats, and reports every chunk its CPU tier admits or drops;
- serves its CPU tier to peers: a handshake on `p2p_init_ports` (NIXL metadata, KV layout check)
  and leases on `p2p_lookup_ports` (a peer asks for chunk keys and gets their addresses, held
  until it releases them or the lease runs out); the peer then READs them over NIXL;
- fetches from peers the same way (a request's load, or a controller's move), in bounded time;
- carries out the controller's commands on `lmcache_worker_ports` (pull, drop, clear, resync),
  telling its own scheduler what appeared in or left its CPU tier (:class:`PlannerNotices`).

Scheduler side (:class:`ControllerLookup`): "who holds the longest prefix of these chunks?",
bounded, and skipped with a back-off while the controller does not answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import zmq
import zmq.asyncio

from kvferry.buffer import nixl_agent
from kvferry.common import messages as m
from kvferry.common.backoff import Backoff
from kvferry.common.config import ConfigError, KVFerryConfig
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.netutil import zmq_host
from kvferry.common.units import fmt_bytes
from kvferry.engine.cpu_tier import CPUTier

logger = get_logger(__name__)

LOCATION = "LocalCPUBackend"
REPORT_S = 0.02  # admissions/evictions go to the controller at most this late
REPORT_BATCH = 4096
POLL_S = 0.0002
MIN_GBPS = 0.2  # a transfer's deadline grows by its size at this rate


class P2PError(RuntimeError):
    """A fetch from a peer failed; the caller recomputes."""


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
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._backoff = Backoff(f"controller {cfg.controller_reply_url}", logger)
        self.errors = 0

    def lookup(self, keys: Sequence[bytes]) -> m.LookupResponse | None:
        """The instance holding the longest prefix of `keys`; None when the controller is away."""
        if not keys or not self._backoff.up():
            return None
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.url)
        try:
            self._sock.send(m.encode(m.LookupRequest(instance_id=self.instance_id, keys=list(keys[:1 << 16]))))
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

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
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
@dataclass
class _Reg:
    """A NIXL registration: the CPU tier's arena (for good), or one chunk outside it (while it stays)."""

    data: torch.Tensor
    descs: object
    md: bytes  # NIXL partial metadata a peer needs to READ it
    serial: int
    leases: int = 0
    dead: bool = False  # left the tier; deregistered once no lease holds it


@dataclass
class _Lease:
    datas: list[torch.Tensor]  # held: an arena slot is not reused while a peer may read it
    expires: float


@dataclass
class _Peer:
    addr: m.PeerAddr
    name: str  # NIXL agent name
    instance_id: str
    lookup: zmq.asyncio.Socket
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class P2PWorker:
    """One TP rank's P2P side (see the module docstring). Its public calls are thread-safe."""

    def __init__(self, cfg: KVFerryConfig, cpu: CPUTier, tp_rank: int, tp_size: int, salt: bytes, layout: bytes,
                 notices: str) -> None:
        self.cfg, self.cpu, self.rank, self.layout = cfg, cpu, tp_rank, layout
        init, look, work = (cfg.ports(k) for k in ("p2p_init_ports", "p2p_lookup_ports", "lmcache_worker_ports"))
        if tp_rank >= len(init):
            raise ConfigError(f"config key p2p_init_ports lists {len(init)} port(s); this instance has TP rank "
                              f"{tp_rank}: give one port per TP rank in p2p_init_ports, p2p_lookup_ports and "
                              "lmcache_worker_ports")
        self.epoch = uuid.uuid4().hex[:12]
        self.info = m.WorkerInfo(
            instance_id=cfg.lmcache_instance_id, worker_id=tp_rank, epoch=self.epoch, host=cfg.p2p_host,
            worker_port=work[tp_rank], p2p_init_port=init[tp_rank], p2p_lookup_port=look[tp_rank],
            tp_size=tp_size, salt=salt, chunk_size=cfg.chunk_size, partial_chunks=cfg.save_unfull_chunk,
            heartbeat_timeout=cfg.lmcache_worker_heartbeat_timeout, cpu_capacity=cpu.capacity)
        self.counters = {"p2p_read_chunks": 0, "p2p_read_bytes": 0, "p2p_read_seconds": 0.0, "p2p_errors": 0,
                         "p2p_served_chunks": 0, "p2p_served_bytes": 0}
        self._warn = RateLimitedLog(logger)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._regs: dict[int, _Reg] = {}  # chunks outside the CPU tier's arena, by address
        self._arena_reg: _Reg | None = None
        self._serial = 0
        self._seen: dict[str, set[int]] = {}  # peer agent -> serials of the registrations it has loaded
        self._leases: dict[str, _Lease] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._news: set[bytes] = set()  # a later put of these is news to the planner (moves, drops)
        self._tasks: list[asyncio.Task] = []
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
        self.agent = nixl_agent.make_agent(f"kvf-p2p-{self.info.instance_id}-{self.rank}-{self.epoch}")
        self.nixl = nixl_agent.NixlThread(self.agent, self.loop, POLL_S, name=f"kvf-p2p-nixl-{self.rank}")
        if self.cpu.arena is not None:  # registered once: see engine/host_arena.py for why
            self._arena_reg = await self._new_reg(self.cpu.arena.buf)
        self.metadata = await self.nixl.call(self.agent.get_agent_metadata)
        host = zmq_host(self.cfg.p2p_host)
        self._init = self._bind(host, self.info.p2p_init_port, "p2p_init_ports")
        self._lookup = self._bind(host, self.info.p2p_lookup_port, "p2p_lookup_ports")
        self._work = self._bind(host, self.info.worker_port, "lmcache_worker_ports")
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 10000)
        self._push.connect(_url(self.cfg.controller_pull_url or self.cfg.controller_url))
        self._notice = self.ctx.socket(zmq.PUSH)
        self._notice.setsockopt(zmq.LINGER, 0)
        self._notice.connect(self._notice_addr)
        self._send(m.RegisterWorker(worker=self.info))
        for coro in (self._serve(self._init, self._on_hello), self._serve(self._lookup, self._on_fetch),
                     self._serve(self._work, self._on_command), self._heartbeat_loop(), self._report_loop()):
            self._tasks.append(asyncio.ensure_future(coro))
        logger.info("P2P worker %s rank %d: peers on %s:%d (init) / %d (lookup), controller commands on %d",
                    self.info.instance_id, self.rank, self.cfg.p2p_host, self.info.p2p_init_port,
                    self.info.p2p_lookup_port, self.info.worker_port)

    def _bind(self, host: str, port: int, key: str) -> zmq.asyncio.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)
        try:
            s.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            s.close()
            raise ConfigError(f"config key {key}: cannot listen on {self.cfg.p2p_host}:{port} ({e}): give each "
                              "instance (and TP rank) its own port") from None
        return s

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
        if hasattr(self, "_push"):
            with contextlib.suppress(zmq.ZMQError):
                await self._push.send(m.encode(m.DeregisterWorker(instance_id=self.info.instance_id,
                                                                  worker_id=self.rank, epoch=self.epoch)),
                                      zmq.NOBLOCK)
        if hasattr(self, "nixl"):
            for reg in [*self._regs.values(), *([self._arena_reg] if self._arena_reg else [])]:
                with contextlib.suppress(Exception):
                    await self.nixl.call(self.agent.deregister_memory, reg.descs)
            self._regs.clear()
            self._arena_reg = None
            self.nixl.stop()
        if hasattr(self, "ctx"):
            for p in self._peers.values():
                p.lookup.close(linger=0)
            self.ctx.destroy(linger=0)

    def _send(self, msg: m.Msg) -> None:
        try:
            self._push.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the controller is away and the queue is full: the next resync fixes it
            self._warn.warning("P2P worker: a report to the controller was dropped (%s)", e)

    async def _serve(self, sock: zmq.asyncio.Socket, handler) -> None:
        while True:
            parts = await sock.recv_multipart()
            try:
                reply = await handler(m.decode(parts[-1]))
            except m.MessageError as e:
                reply = m.ErrorReply(code="bad_message", message=str(e)[:4000])
            except Exception as e:  # noqa: BLE001 - a peer's request must not stop the server
                logger.exception("P2P worker: handling a request failed")
                reply = m.ErrorReply(code="internal", message=str(e)[:4000])
            if reply is not None:
                await sock.send_multipart([*parts[:-1], m.encode(reply)])

    # ---- reports to the controller ----
    def _on_tier(self, event: str, key: bytes, data: torch.Tensor) -> None:
        self._events.put((event, key, data))

    async def _heartbeat_loop(self) -> None:
        while True:
            self._send(m.Heartbeat(worker=self.info, num_chunks=len(self.cpu), used_bytes=self.cpu.used))
            await asyncio.sleep(self.cfg.lmcache_worker_heartbeat_time)

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            await self._report()
            now = time.monotonic()
            for lid in [lid for lid, lease in self._leases.items() if lease.expires < now]:
                logger.warning("P2P lease %s expired before the peer released it", lid)
                await self._release(lid)

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
                await self._reg_of(data)  # registered ahead: serving it then costs nothing
                if key in self._news:
                    self._news.discard(key)
                    adopted.append((key, data.numel()))
            else:
                admit.pop(key, None)
                evict.append(key)
                reg = self._regs.get(data.data_ptr())
                if reg is not None and reg.data is data:
                    reg.dead = True
                    if not reg.leases:
                        await self._deregister(data.data_ptr())
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
            self._notice.send(m.encode(m.TierNotice(adopted=[k for k, _ in a], sizes=[n for _, n in a],
                                                    dropped=dropped[i:i + REPORT_BATCH])))

    # ---- serving peers ----
    async def _on_hello(self, msg: m.Msg) -> m.Msg:
        if not isinstance(msg, m.PeerHello):
            return m.ErrorReply(code="unexpected", message=f"{type(msg).__name__} on the p2p init port")
        if msg.layout != self.layout:
            return m.ErrorReply(code="fingerprint", message=(
                f"instance {self.info.instance_id} keeps its KV in another layout (model, dtype, block size "
                f"or chunk format differ) than {msg.instance_id}: P2P needs the same"))
        self._seen[msg.agent_name] = set()  # a new handshake: the peer starts from our full metadata
        return m.PeerWelcome(instance_id=self.info.instance_id, agent_name=self.agent.name,
                             agent_metadata=self.metadata)

    async def _on_fetch(self, msg: m.Msg) -> m.Msg | None:
        if isinstance(msg, m.PeerRelease):
            await self._release(msg.lease_id)
            return None
        if not isinstance(msg, m.PeerFetch):
            return m.ErrorReply(code="unexpected", message=f"{type(msg).__name__} on the p2p lookup port")
        datas = []
        for key in msg.keys:
            d = self.cpu.get(key)
            if d is None:
                break
            datas.append(d)
        seen = self._seen.setdefault(msg.agent_name, set())
        mds = []
        for d in datas:
            reg = await self._reg_of(d)
            if reg.serial not in seen:
                seen.add(reg.serial)
                mds.append(reg.md)
            reg.leases += 1
        nbytes = sum(d.numel() for d in datas)
        lease_s = 2 * self.cfg.blocking_timeout_secs + nbytes / (MIN_GBPS * 1e9)
        lid = uuid.uuid4().hex[:16]
        if datas:
            self._leases[lid] = _Lease(datas, time.monotonic() + lease_s)
            if self.cpu.arena is not None:
                self.cpu.arena.pause()  # until released: the peer's READ needs these cores
            self.nixl.progress += 1  # the peer's READ needs this agent to make progress
            self.loop.call_soon(self.nixl.wake)  # after the reply is sent: the woken thread takes the GIL
        self.counters["p2p_served_chunks"] += len(datas)
        self.counters["p2p_served_bytes"] += nbytes
        return m.PeerChunks(request_id=msg.request_id, lease_id=lid, addrs=[d.data_ptr() for d in datas],
                            sizes=[d.numel() for d in datas],
                            lease_seconds=lease_s, metadata=mds)

    async def _release(self, lid: str) -> None:
        lease = self._leases.pop(lid, None)
        if lease is None:
            return
        if self.cpu.arena is not None:
            self.cpu.arena.resume()
        self.nixl.progress -= 1
        for d in lease.datas:
            reg = self._arena_reg if self._in_arena(d) else self._regs.get(d.data_ptr())
            if reg is None:
                continue
            reg.leases -= 1
            if reg.dead and not reg.leases:
                await self._deregister(d.data_ptr())

    def _in_arena(self, d: torch.Tensor) -> bool:
        return self._arena_reg is not None and self.cpu.arena.holds(d)

    async def _reg_of(self, d: torch.Tensor) -> _Reg:
        """The registration a peer READs `d` through: the arena's, or (made now) its own."""
        if self._in_arena(d):
            return self._arena_reg
        reg = self._regs.get(d.data_ptr())
        if reg is None:
            reg = self._regs[d.data_ptr()] = await self._new_reg(d)
        return reg

    async def _new_reg(self, d: torch.Tensor) -> _Reg:
        descs = await self.nixl.call(self.agent.register_memory, d)
        md = await self.nixl.call(self.agent.get_partial_agent_metadata, descs, False, ["UCX"])
        self._serial += 1
        return _Reg(d, descs, md, self._serial)

    async def _deregister(self, ptr: int) -> None:
        reg = self._regs.pop(ptr)
        for seen in self._seen.values():
            seen.discard(reg.serial)
        try:
            await self.nixl.call(self.agent.deregister_memory, reg.descs)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not deregister a P2P chunk: %s", e)

    # ---- fetching from peers ----
    async def _peer(self, addr: m.PeerAddr, deadline: float) -> _Peer:
        k = (addr.host, addr.init_port)
        peer = self._peers.get(k)
        if peer is not None:
            return peer
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(f"tcp://{zmq_host(addr.host)}:{addr.init_port}")
            await s.send(m.encode(m.PeerHello(instance_id=self.info.instance_id, agent_name=self.agent.name,
                                              agent_metadata=self.metadata, layout=self.layout)))
            if not await s.poll(max(1, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
                raise P2PError(f"peer {addr.host}:{addr.init_port} did not answer the handshake")
            reply = m.decode(await s.recv(), expect=(m.PeerWelcome, m.ErrorReply))
        except m.MessageError as e:
            raise P2PError(f"peer {addr.host}:{addr.init_port} sent a bad handshake: {e}") from None
        finally:
            s.close(linger=0)
        if isinstance(reply, m.ErrorReply):
            raise P2PError(f"peer {addr.host}:{addr.init_port} refused: {reply.message}")
        name = await self.nixl.call(self.agent.add_remote_agent, reply.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        look = self.ctx.socket(zmq.DEALER)
        look.setsockopt(zmq.LINGER, 0)
        look.connect(f"tcp://{zmq_host(addr.host)}:{addr.lookup_port}")
        peer = self._peers[k] = _Peer(addr, name, reply.instance_id, look)
        logger.info("Established connection to peer_init_url %s:%d. The peer_lookup_url: %s:%d", addr.host,
                    addr.init_port, addr.host, addr.lookup_port)
        return peer

    async def _forget_peer(self, addr: m.PeerAddr) -> None:
        peer = self._peers.pop((addr.host, addr.init_port), None)
        if peer is not None:
            peer.lookup.close(linger=0)
            with contextlib.suppress(Exception):
                await self.nixl.call(self.agent.remove_remote_agent, peer.name)

    async def _fetch(self, addr: m.PeerAddr, keys: Sequence[bytes], sizes: Sequence[int] | None,
                     timeout: float, max_bytes: int | None = None) -> list[torch.Tensor]:
        """The leading chunks of `keys` the peer holds (all of them when `sizes` is given, else
        P2PError), READ into new CPU memory; P2PError beyond `max_bytes`."""
        deadline = time.monotonic() + timeout
        try:
            peer, reply = await self._lease(addr, keys, deadline)
            need = sum(reply.sizes)
            if max_bytes is not None and need > max_bytes:
                with contextlib.suppress(zmq.ZMQError):
                    await peer.lookup.send(m.encode(m.PeerRelease(lease_id=reply.lease_id)))
                raise P2PError(f"{self.info.instance_id}'s CPU tier has {fmt_bytes(max(max_bytes, 0))} free of "
                               f"{fmt_bytes(self.cpu.capacity)}; the move needs {fmt_bytes(need)}: raise "
                               "max_local_cpu_size, move fewer tokens, or POST /clear it first")
            return await self._read(peer, reply, sizes, deadline)
        except P2PError:
            self.counters["p2p_errors"] += 1
            raise

    async def _lease(self, addr: m.PeerAddr, keys: Sequence[bytes], deadline: float) -> tuple[_Peer, m.PeerChunks]:
        """Ask the peer's lookup port for `keys`: their addresses, held for us until released."""
        try:
            peer = await self._peer(addr, deadline)
            async with peer.lock:
                rid = uuid.uuid4().hex[:16]
                await peer.lookup.send(m.encode(m.PeerFetch(request_id=rid, agent_name=self.agent.name,
                                                            keys=list(keys))))
                while True:
                    try:  # recv under a timeout, not poll then recv: one wake-up less (0.4 vs 0.6 ms here)
                        raw = await asyncio.wait_for(peer.lookup.recv(), max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        raise P2PError(f"peer {peer.instance_id} did not answer the lookup in time") from None
                    reply = m.decode(raw, expect=(m.PeerChunks, m.ErrorReply))
                    if isinstance(reply, m.ErrorReply):
                        raise P2PError(f"peer {peer.instance_id}: {reply.message}")
                    if reply.request_id == rid:
                        return peer, reply
        except (P2PError, m.MessageError, zmq.ZMQError) as e:
            await self._forget_peer(addr)  # a restarted peer has a new agent: handshake again next time
            raise P2PError(str(e)) from None

    async def _read(self, peer: _Peer, reply: m.PeerChunks, sizes: Sequence[int] | None,
                    deadline: float) -> list[torch.Tensor]:
        read_failed = False
        arena = self.cpu.arena
        if arena is not None:
            arena.pause()  # its touch-ahead thread would take cores from the READ
        try:
            n = len(reply.addrs)
            if sizes is not None:
                if n < len(sizes):
                    raise P2PError(f"peer {peer.instance_id} holds {n} of the {len(sizes)} chunks (evicted since "
                                   "the lookup)")
                if list(reply.sizes) != list(sizes):
                    raise P2PError(f"peer {peer.instance_id} has chunks of other sizes ({reply.sizes[:3]}... vs "
                                   f"{list(sizes[:3])}...): another KV layout")
            if not n:
                return []
            deadline += sum(reply.sizes) / (MIN_GBPS * 1e9)  # the lookup's timeout plus time for the bytes
            t0 = time.monotonic()
            for md in reply.metadata:
                await self.nixl.call(self.agent.add_remote_agent, md)
            dest = [self.cpu.alloc(s) for s in reply.sizes]
            own = [d for d in dest if not self._in_arena(d)]
            descs = await self.nixl.call(self.agent.register_memory, own) if own else None
            xfer = self.nixl.xfer("READ", [(d.data_ptr(), d.numel(), 0) for d in dest], "DRAM",
                                  [(a, s, 0) for a, s in zip(reply.addrs, reply.sizes, strict=True)], "DRAM",
                                  peer.name, b"", deadline)
            try:
                state = await asyncio.shield(xfer)
            except asyncio.CancelledError:
                # The READ may write into `dest` until NIXL ends it (at `deadline` at the latest):
                # keep the memory (and its registration) until then.
                await asyncio.wait([xfer])
                raise
            finally:
                if descs is not None:
                    await self.nixl.call(self.agent.deregister_memory, descs)
            if state != "DONE":
                read_failed = True
                raise P2PError(f"NIXL READ from {peer.instance_id}: {state}")
            dt = time.monotonic() - t0
            nbytes = sum(reply.sizes)
            self.counters["p2p_read_chunks"] += n
            self.counters["p2p_read_bytes"] += nbytes
            self.counters["p2p_read_seconds"] += dt
            logger.debug("P2P: read %d chunks (%s) from %s in %.2f ms", n, fmt_bytes(nbytes), peer.instance_id,
                         dt * 1e3)
            return dest
        finally:
            if arena is not None:
                arena.resume()
            if reply.lease_id:
                with contextlib.suppress(zmq.ZMQError):
                    await peer.lookup.send(m.encode(m.PeerRelease(lease_id=reply.lease_id)))
            if read_failed:  # e.g. a peer restarted on the same ports has a new agent: handshake again
                await self._forget_peer(peer.addr)

    def fetch(self, peer_id: str, addr: m.PeerAddr, keys: Sequence[bytes], sizes: Sequence[int]) -> \
            list[torch.Tensor] | None:
        """A request's load (from vLLM's worker thread): every chunk or None (then recompute)."""
        timeout = self.cfg.blocking_timeout_secs
        t0 = time.monotonic()
        fut = asyncio.run_coroutine_threadsafe(self._fetch(addr, keys, sizes, timeout), self.loop)
        try:
            out = fut.result(timeout + sum(sizes) / (MIN_GBPS * 1e9) + 1.0)
        except (P2PError, concurrent.futures.TimeoutError) as e:
            fut.cancel()
            self._warn.warning("P2P fetch of %d chunks from %s failed: %s; recomputing", len(keys), peer_id,
                               e or "timed out")
            self._report_transfer(peer_id, 0, 0, time.monotonic() - t0, False, "p2p")
            return None
        self._report_transfer(peer_id, len(out), sum(sizes), time.monotonic() - t0, True, "p2p")
        return out

    def _report_transfer(self, peer_id: str, chunks: int, nbytes: int, seconds: float, ok: bool, kind: str) -> None:
        msg = m.TransferReport(instance_id=self.info.instance_id, peer_id=peer_id, num_chunks=chunks, nbytes=nbytes,
                               seconds=seconds, ok=ok, kind=kind)
        self.loop.call_soon_threadsafe(self._send, msg)

    # ---- the controller's commands ----
    async def _on_command(self, msg: m.Msg) -> m.Msg:
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
        if isinstance(msg, m.Resync):
            await self._report()  # what is queued first: the snapshot then supersedes it
            keys = self.cpu.keys()
            sizes = [d.numel() if (d := self.cpu.get(k)) is not None else 0 for k in keys]
            for i in range(0, max(len(keys), 1), REPORT_BATCH):
                self._send(m.ChunkAdmit(instance_id=self.info.instance_id, worker_id=self.rank, epoch=self.epoch,
                                        location=LOCATION, keys=keys[i:i + REPORT_BATCH],
                                        sizes=sizes[i:i + REPORT_BATCH], reset=i == 0))
            return m.CommandResult(event_id=msg.event_id, ok=True, num_chunks=len(keys))
        return m.CommandResult(event_id=getattr(msg, "event_id", "?"), ok=False,
                               message=f"{type(msg).__name__} is not a worker command")

    async def _pull(self, msg: m.PullChunks) -> m.CommandResult:
        want = [k for k in msg.keys if self.cpu.get(k) is None]
        t0 = time.monotonic()
        try:
            # Evicting is the scheduler's decision, so a move only fills free space.
            datas = await self._fetch(msg.source, want, None, self.cfg.blocking_timeout_secs,
                                      max_bytes=self.cpu.capacity - self.cpu.used) if want else []
        except P2PError as e:
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
        return dict(self.counters)
