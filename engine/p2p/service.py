"""One TP rank's side of P2P sharing between instances, coordinated by kvferry-controller.

:class:`P2PService` owns the rank's thread, asyncio loop, NIXL agent and sockets, and wires up
the jobs that run on them, each in its own module:

- lends its CPU tier to peers (sender/lender.py: handshake on `p2p_init_ports`, leases on
  `p2p_lookup_ports`); the peer then READs the chunks over NIXL;
- reads from peers the same way (p2p/fetching.py over receiver/peer_reader.py) for a request's
  load or a controller's move, in bounded time;
- reports to the controller: registration, heartbeats, every chunk its CPU tier admits or drops
  (p2p/reports.py), and tells its own scheduler what a move changed (p2p/notices.py);
- carries out the controller's commands on `lmcache_worker_ports` (p2p/commands.py).

Every socket is made by common/zsock.py (the cluster secret, when set, on all of them), and the
handshake, peer table and fingerprint check are the ones PD transfers use (buffer/peering.py).
What a peer answers is checked before NIXL uses it, and with the secret every chunk carries a
keyed MAC (receiver/peer_reader.py); a peer that fails a check is a counted miss
(``p2p_rejected``), never an exception in vLLM's worker.
Background loops log and restart when they fail (common/supervise.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import uuid
from collections.abc import Sequence

import torch
import zmq
import zmq.asyncio

from kvferry.buffer import nixl_agent, peering
from kvferry.common import zsock
from kvferry.common.config import ConfigError, KVFerryConfig
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.netutil import advertised
from kvferry.common.supervise import LoopHealth, supervise
from kvferry.common.wire import chunk_mac
from kvferry.common.wire import messages as m
from kvferry.engine.p2p.commands import ControllerCommands
from kvferry.engine.p2p.fetching import PeerFetcher
from kvferry.engine.p2p.lookup import zmq_url
from kvferry.engine.p2p.reports import ControllerReports
from kvferry.engine.tiers.cpu import CPUTier
from kvferry.receiver.peer_reader import PeerReader
from kvferry.sender.lender import ChunkLender

logger = get_logger(__name__)

POLL_S = 0.0002


class P2PService:
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
            instance_id=cfg.lmcache_instance_id, worker_id=tp_rank, epoch=self.epoch,
            host=advertised(cfg.p2p_host, cfg.p2p_advertise_host, "config key p2p_host"),
            worker_port=work[tp_rank], p2p_init_port=init[tp_rank], p2p_lookup_port=look[tp_rank],
            tp_size=tp_size, salt=salt, chunk_size=cfg.chunk_size, partial_chunks=cfg.save_unfull_chunk,
            heartbeat_timeout=cfg.lmcache_worker_heartbeat_timeout, cpu_capacity=cpu.capacity)
        self.mac = chunk_mac.for_secret(self.trust.secret)  # None without a secret: chunks carry no tag
        self.health = {name: LoopHealth(f"P2P service {cfg.lmcache_instance_id} rank {tp_rank}: {name}")
                       for name in ("heartbeats", "reports")}
        self._warn = RateLimitedLog(logger)
        self._tasks: list[asyncio.Task] = []
        self._socks: list[zmq.asyncio.Socket] = []
        self._notice_addr = notices
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"kvf-p2p-{tp_rank}", daemon=True)
        self._thread.start()
        try:
            self._call(self._start(), 15.0)
        except BaseException:
            self.close()
            raise
        cpu.listener = self.reports.on_tier

    # ---- lifecycle ----
    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        me = self.info.instance_id
        self.agent = nixl_agent.make_agent(f"kvf-p2p-{me}-{self.rank}-{self.epoch}", self.cfg.nixl_net_devices)
        self.nixl = nixl_agent.NixlThread(self.agent, self.loop, POLL_S, name=f"kvf-p2p-nixl-{self.rank}")
        self.lender = ChunkLender(self.cpu, self.nixl, self.fp, me, random.SystemRandom().randrange(1, 1 << 62),
                                  2 * self.cfg.blocking_timeout_secs, mac=self.mac)
        await self.lender.start()
        self.reader = PeerReader(self.ctx, self.trust, self.nixl, self._hello, self.fp, me, self.cpu.alloc,
                                 self.cpu.arena, mac=self.mac)
        controller = self.cfg.controller_pull_url or self.cfg.controller_url
        assert controller is not None  # config.py requires it with the controller
        self._push = zsock.connect(self.ctx, zmq.PUSH, self.trust, zmq_url(controller))
        self._push.setsockopt(zmq.SNDHWM, 10000)
        notice = zsock.connect(self.ctx, zmq.PUSH, self.trust, self._notice_addr)
        self._socks += [self._push, notice]
        timeout = self.cfg.blocking_timeout_secs
        self.reports = ControllerReports(self.info, self.cpu, self.lender, self._push, notice,
                                         self.cfg.lmcache_worker_heartbeat_time, self.health)
        self.fetcher = PeerFetcher(me, self.cpu, self.reader, self.reports, self.loop, timeout)
        self.commands = ControllerCommands(self.cpu, self.reports, self.fetcher, self.loop, timeout)
        host = self.cfg.p2p_host
        assert host is not None  # config.py requires it with the controller
        ports = ((self.info.p2p_init_port, "p2p_init_ports", self.lender.on_hello),
                 (self.info.p2p_lookup_port, "p2p_lookup_ports", self.lender.on_fetch),
                 (self.info.worker_port, "lmcache_worker_ports", self.commands.on_command))
        for port, key, handler in ports:
            try:
                sock = zsock.listen(self.ctx, zmq.ROUTER, self.trust, host, port, f"config key {key}")
            except zsock.BindError as e:
                raise ConfigError(f"{e} (give each instance and TP rank its own port)") from None
            self._socks.append(sock)
            self._tasks.append(asyncio.ensure_future(peering.serve(sock, handler, key, self._bad_frame)))
        self.reports.send(m.RegisterWorker(worker=self.info))
        for name, fn in (("heartbeats", self.reports.heartbeat_loop), ("reports", self.reports.report_loop)):
            self._tasks.append(asyncio.ensure_future(supervise(self.health[name], fn)))
        logger.info("P2P service %s rank %d: peers on %s:%d (init) / %d (lookup), controller commands on %d",
                    me, self.rank, host, self.info.p2p_init_port, self.info.p2p_lookup_port, self.info.worker_port)

    def _hello(self) -> m.Hello:
        return m.Hello(peer_id=self.info.instance_id, tp_rank=self.rank, agent_name=self.agent.name,
                       agent_metadata=self.lender.metadata, fingerprint=self.fp)

    def _bad_frame(self, why: str) -> None:
        self._warn.warning("P2P service %s: rejected %s", self.info.instance_id, why)

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

    def fetch(self, peer_id: str | None, addr: m.PeerAddr, keys: Sequence[bytes], sizes: Sequence[int]) -> \
            list[torch.Tensor] | None:
        """A request's load (from vLLM's worker thread): every chunk, checked, or None (then
        recompute); never raises. `peer_id`: the instance the controller named (checked)."""
        return self.fetcher.fetch(peer_id, addr, keys, sizes)

    def stats(self) -> dict[str, float]:
        restarts = sum(h.restarts for h in self.health.values())
        return {**self.fetcher.counters.as_dict(), **self.reader.counters, **self.lender.counters,
                "p2p_loop_restarts": restarts}
