"""The controller's ZMQ side: what workers report, the schedulers' lookups, and commands to workers.

Sockets (`--monitor-ports`, as LMCache's controller has them): pull and heartbeat (PULL) take registrations, heartbeats,
chunk admissions/evictions and transfer reports; reply (ROUTER) answers lookups ("who holds the
longest prefix of these chunks?"); each worker's `lmcache_worker_ports` (our DEALER) takes move,
drop, clear and resync commands.

Nothing a worker sends can stop the controller: a frame that does not decode, or a message that
cannot be applied, is logged (rate-limited) and counted; every loop runs under a supervisor whose
state /health shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from kvferry.common import zsock
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.supervise import LoopHealth, supervise
from kvferry.common.wire import messages as m
from kvferry.controller.registry import RegistryError, Worker, WorkerRegistry

logger = get_logger(__name__)

RESYNC_AFTER = 3  # heartbeats whose chunk count disagrees with the index before a resync
PORTS = "kvferry-controller (--monitor-ports)"  # one exposure warning for all of them
WORKER_MSGS = (m.RegisterWorker, m.Heartbeat, m.DeregisterWorker, m.ChunkAdmit, m.ChunkEvict, m.TransferReport)
Command = m.PullChunks | m.DropChunks | m.ClearChunks | m.Resync  # what the controller asks a worker

WorkerKey = tuple[str, int, str]  # instance id, worker id (TP rank), epoch


def new_id() -> str:
    """An event id for a move, clear or resync."""
    return uuid.uuid4().hex[:16]


class WorkerLinks:
    """The monitor ports' loops and the command sockets to workers, over one registry."""

    def __init__(self, registry: WorkerRegistry, host: str, ports: dict[str, int], trust: zsock.Trust,
                 counters: dict[str, int], command_timeout: float = 120.0, sweep_interval: float = 0.5) -> None:
        self.registry, self.host, self.ports, self.trust = registry, host, ports, trust
        self.counters = counters  # shared with the HTTP side: /health shows them together
        self.command_timeout, self.sweep_interval = command_timeout, sweep_interval
        self.ctx = zmq.asyncio.Context()
        self.health: dict[str, LoopHealth] = {}
        self._bad_frame_log, self._apply_log = RateLimitedLog(logger), RateLimitedLog(logger)
        self._command_log = RateLimitedLog(logger)
        # One command at a time per worker; a socket is dropped (and made again) after a timeout, so
        # a late answer is never read as the next command's.
        self._cmd: dict[WorkerKey, zmq.asyncio.Socket] = {}
        self._cmd_locks: dict[WorkerKey, asyncio.Lock] = {}
        self._mismatch: dict[tuple[str, int], int] = {}
        self._resyncing: set[WorkerKey] = set()  # one Resync in flight per worker at most
        self._tasks: list[asyncio.Task] = []
        self._socks: list[zmq.asyncio.Socket] = []

    # ---- lifecycle ----
    def start(self) -> None:
        """Bind the monitor ports and start their loops (the host's exposure is judged already)."""
        for name in ("pull", "heartbeat"):
            if self.ports.get(name):
                s = self._bind(zmq.PULL, self.ports[name], name)
                self._loop(name, functools.partial(self._pull_loop, s, name))
        rep = self._bind(zmq.ROUTER, self.ports["reply"], "reply")
        self._loop("reply", lambda: self._reply_loop(rep))
        self._loop("sweep", self._sweep_loop)

    def _loop(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        health = self.health[name] = LoopHealth(f"kvferry-controller {name} loop")
        self._tasks.append(asyncio.create_task(supervise(health, fn)))

    def _bind(self, kind: int, port: int, name: str) -> zmq.asyncio.Socket:
        try:
            s = zsock.listen(self.ctx, kind, self.trust, self.host, port, PORTS)
        except zsock.BindError as e:
            raise SystemExit(f"kvferry-controller: the {name} port: {e} (in --monitor-ports, and the workers' "
                             f"controller_{name}_url)") from None
        self._socks.append(s)
        return s

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in self._cmd.values():
            s.close(linger=0)
        for s in self._socks:
            s.close(linger=0)
        self.ctx.term()

    # ---- worker messages ----
    async def _pull_loop(self, sock: zmq.asyncio.Socket, name: str) -> None:
        health = self.health[name]
        while True:
            frame = await sock.recv()
            health.recovered()
            try:
                msg = m.decode(frame, expect=WORKER_MSGS)
            except m.MessageError as e:
                self.counters["bad_frames"] += 1
                self._bad_frame_log.warning("dropped a bad message on the %s port: %s", name, e)
                continue
            try:
                self.handle(msg)
            except Exception as e:  # noqa: BLE001 - one worker's message must not stop the controller
                self.counters["rejected_messages"] += 1
                self._apply_log.warning("dropped a %s from instance %s on the %s port: %s%s", type(msg).__name__,
                                        _sender(msg), name, e if isinstance(e, RegistryError) else
                                        f"{type(e).__name__}: {e}", "" if isinstance(e, RegistryError) else
                                        " (a controller bug: please report it)")

    def handle(self, msg: m.Msg) -> None:
        reg = self.registry
        if isinstance(msg, m.RegisterWorker):
            reg.register(msg.worker)
        elif isinstance(msg, m.Heartbeat):
            self._heartbeat(msg)
        elif isinstance(msg, m.DeregisterWorker):
            reg.deregister(msg.instance_id, msg.worker_id, msg.epoch)
        elif isinstance(msg, m.ChunkAdmit):
            reg.admit(msg)
        elif isinstance(msg, m.ChunkEvict):
            reg.evict(msg)
        elif isinstance(msg, m.TransferReport):
            reg.record_transfer(msg)

    def _heartbeat(self, msg: m.Heartbeat) -> None:
        info = msg.worker
        known = self.registry.worker(info.instance_id, info.worker_id, info.epoch) is not None
        w = self.registry.heartbeat(msg)
        if w is None:
            return
        key = (info.instance_id, info.worker_id)
        # A worker with keys left out of the index (a bound) disagrees for good: no resync storm.
        bad = self._mismatch.get(key, 0) + 1 if msg.num_chunks != len(w.chunks) and not w.capped else 0
        self._mismatch[key] = bad
        if (not known and msg.num_chunks) or bad >= RESYNC_AFTER:
            # A restarted controller, or reports lost: the worker sends its whole list again.
            self._mismatch[key] = 0
            self._resync(w)

    def _resync(self, w: Worker) -> None:
        k = (w.info.instance_id, w.info.worker_id, w.info.epoch)
        if k in self._resyncing:
            return  # one is on its way (or waiting out --command-timeout): do not pile them up
        self._resyncing.add(k)

        async def run() -> None:
            try:
                res = await self.command(w, m.Resync(event_id=new_id()))
                if not res.ok:
                    self._command_log.warning("resync of instance %s worker %d failed: %s", w.info.instance_id,
                                              w.info.worker_id, res.message)
            finally:
                self._resyncing.discard(k)

        self.spawn(run())

    async def _reply_loop(self, sock: zmq.asyncio.Socket) -> None:
        health = self.health["reply"]
        while True:
            parts = await sock.recv_multipart()
            health.recovered()
            if len(parts) < 2:
                continue
            try:
                msg = m.decode(parts[-1], expect=m.LookupRequest)
                reply: m.Msg = self.registry.lookup(msg.keys, asker=msg.instance_id)
            except m.MessageError as e:
                self.counters["bad_lookups"] += 1
                self._bad_frame_log.warning("answered a bad message on the reply port with an error: %s", e)
                reply = m.ErrorReply(code="bad_message", message=str(e)[:4000])
            except Exception as e:  # noqa: BLE001 - one lookup must not stop the controller
                self.counters["bad_lookups"] += 1
                self._apply_log.warning("a lookup failed: %s: %s (a controller bug: please report it)",
                                        type(e).__name__, e)
                reply = m.ErrorReply(code="internal", message=f"the controller failed on this lookup: {e}"[:4000])
            await sock.send_multipart([*parts[:-1], m.encode(reply)])

    async def _sweep_loop(self) -> None:
        health = self.health["sweep"]
        while True:
            await asyncio.sleep(self.sweep_interval)
            self.registry.expire()
            live = {(i.id, w.info.worker_id, w.info.epoch) for i in self.registry.instances.values()
                    for w in i.workers.values()}
            for k in [k for k, lock in self._cmd_locks.items() if k not in live and not lock.locked()]:
                self._cmd_locks.pop(k)
                if k in self._cmd:
                    self._cmd.pop(k).close(linger=0)
            ranks = {(i, r) for i, r, _ in live}
            for rank in [rank for rank in self._mismatch if rank not in ranks]:
                del self._mismatch[rank]
            health.recovered()

    # ---- commands to workers ----
    async def command(self, w: Worker, cmd: Command) -> m.CommandResult:
        """Send one command to a worker and wait (bounded) for its result; never raises."""
        try:
            return await self._command_once(w, cmd)
        except Exception as e:  # noqa: BLE001 - e.g. a host ZMQ cannot connect to: a failed command
            self.counters["failed_commands"] += 1
            return m.CommandResult(event_id=cmd.event_id, ok=False, message=(
                f"instance {w.info.instance_id} worker {w.info.worker_id} at {w.info.host}:{w.info.worker_port}: "
                f"{type(e).__name__}: {e}")[:4000])

    async def _command_once(self, w: Worker, cmd: Command) -> m.CommandResult:
        k = (w.info.instance_id, w.info.worker_id, w.info.epoch)
        async with self._cmd_locks.setdefault(k, asyncio.Lock()):
            sock = self._cmd.get(k)
            if sock is None:
                # The worker names its host: resolve it off the event loop (a slow DNS answer must
                # not stall every other worker's messages).
                url = await asyncio.to_thread(zsock.tcp, w.info.host, w.info.worker_port)
                sock = zsock.connect(self.ctx, zmq.DEALER, self.trust, url)
                self._cmd[k] = sock
            try:  # bounded too: a worker gone (or refusing our secret) takes no frames
                await asyncio.wait_for(sock.send(m.encode(cmd)), self.command_timeout)
            except TimeoutError:
                self._cmd.pop(k, None)
                sock.close(linger=0)
                raise
            while True:  # skip results of commands that timed out earlier
                if not await sock.poll(int(self.command_timeout * 1000)):  # POLLIN
                    self._cmd.pop(k, None)
                    sock.close(linger=0)
                    return m.CommandResult(event_id=cmd.event_id, ok=False, message=(
                        f"instance {w.info.instance_id} worker {w.info.worker_id} did not answer within "
                        f"{self.command_timeout:g}s (--command-timeout)"))
                try:
                    res = m.decode(await sock.recv(), expect=m.CommandResult)
                except m.MessageError as e:
                    self.counters["failed_commands"] += 1
                    return m.CommandResult(event_id=cmd.event_id, ok=False, message=f"bad answer: {e}")
                if res.event_id == cmd.event_id:
                    return res

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` in the background until done or stop(); a failure is logged and counted."""
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a background command must never fail unobserved
                self.counters["failed_commands"] += 1
                self._command_log.warning("a background command failed: %s: %s", type(e).__name__, e)

        t = asyncio.create_task(guarded())
        self._tasks.append(t)
        t.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)


def _sender(msg: m.Msg) -> str:
    info = getattr(msg, "worker", None)
    iid = info.instance_id if info is not None else getattr(msg, "instance_id", "?")
    return repr(iid[:64])
