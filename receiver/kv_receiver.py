"""The decoder side of a transfer, one per TP rank: init port, alloc port, NIXL arrivals.

Two threads, neither of which spins:

- ``kvf-recv-ports``: an asyncio loop serving the init and alloc ports (receiver/ports.py). Each
  request is its own task, and allocations that must wait for pages wait in a thread pool, so a
  slow or stuck request never holds up another.
- ``kvf-recv-nixl``: the only user of the NIXL agent after start-up. It polls notifications
  (every 50 us for 50 ms after pages were reserved or a notification came, then backing off to
  every 0.5 ms while a transfer is still awaited; every 20 ms when none is; an alloc wakes it),
  commits arrived transfers, sends the optional proxy notification, and expires leases. Its
  polls also drive UCX's progress on this side, which large writes need: UCX's rendezvous
  protocol moves the data when the target answers, so idle polling would stall a write. A
  failure in it is logged and the loop starts again (common/supervise.py).

The rules that keep one request from reading another's KV (single-use transfer ids, quarantined
pages after an abort, pinned transfers) live in receiver/transfer_table.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvferry.buffer import nixl_agent, peering
from kvferry.buffer.pd_buffer import BufferFullTimeout, BufferTooSmall, PDBuffer, PDBufferError
from kvferry.common import zsock
from kvferry.common.config import KVFerryConfig
from kvferry.common.counters import Counters
from kvferry.common.errors import UnavailableError
from kvferry.common.live_gauges import LiveGauges
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.supervise import LoopHealth, supervise_thread
from kvferry.common.wire import messages as m
from kvferry.receiver.errors import TransferError
from kvferry.receiver.joints import Joints
from kvferry.receiver.ports import Ports
from kvferry.receiver.transfer_states import Incoming
from kvferry.receiver.transfer_table import ReceivedTransfer, TransferTable

logger = get_logger(__name__)

ACTIVE_POLL_S = 0.00005  # for FAST_S after pages were reserved or a notification came
FAST_S = 0.05
AWAIT_POLL_S = 0.0005  # the longest pause while a transfer is still awaited after that
IDLE_POLL_S = 0.02  # nothing awaited
SWEEP_S = 0.5
# After a sender's alloc connection closed, how long a write it posted before it saw the close
# may still be landing (its process is gone, or it refuses new writes on that connection).
WRITER_GONE_GRACE_S = 1.0


def poll_pause(last: float, awaited: bool, fast: bool) -> float:
    """The NIXL thread's next pause after `last`: ACTIVE_POLL_S while `fast` (within FAST_S of
    pages reserved or a notification: a short prefill's KV comes then, and UCX's rendezvous needs
    this side's progress to move it), then doubling to AWAIT_POLL_S while a transfer is still
    awaited; IDLE_POLL_S when none is. Each poll holds the GIL (NIXL's binding keeps it): a poll
    every 50 us through a whole prefill step (seconds on a CPU) would starve the receiver's ports
    thread of it on a busy machine, and an abort or alloc would be read seconds late."""
    if not awaited:
        return IDLE_POLL_S
    return ACTIVE_POLL_S if fast else min(2 * last, AWAIT_POLL_S)


@dataclass(frozen=True)
class ReceiverConfig:
    host: str
    init_port: int
    alloc_port: int
    alloc_timeout: float = 10.0  # pd_alloc_timeout
    lease_seconds: float = 30.0  # pd_lease_seconds
    kv_ready_timeout: float = 30.0  # pd_kv_ready_timeout
    proxy_host: str | None = None  # pd_proxy_host
    proxy_port: int | None = None  # pd_proxy_port
    max_waiting_allocs: int = 64
    queue_seconds: float = 600.0  # pd_queue_seconds
    trust: zsock.Trust = zsock.PLAIN
    net_devices: str | None = None  # nixl_net_devices
    advertise_host: str | None = None  # pd_peer_advertise_host


def receiver_config(cfg: KVFerryConfig, tp_rank: int = 0) -> ReceiverConfig:
    """This TP rank's receiver settings from LMCache's PD keys (one init/alloc port per rank)."""
    init, alloc = cfg.ports("pd_peer_init_port"), cfg.ports("pd_peer_alloc_port")
    if tp_rank >= len(init) or tp_rank >= len(alloc):
        raise ReceiverError(f"TP rank {tp_rank} has no port: pd_peer_init_port / pd_peer_alloc_port list "
                            f"{len(init)} / {len(alloc)} ports; give one per decoder TP rank")
    return ReceiverConfig(cfg.pd_peer_host or "0.0.0.0", init[tp_rank], alloc[tp_rank],
                          alloc_timeout=cfg.pd_alloc_timeout, lease_seconds=cfg.pd_lease_seconds,
                          kv_ready_timeout=cfg.pd_kv_ready_timeout, proxy_host=cfg.pd_proxy_host,
                          proxy_port=cfg.pd_proxy_port, queue_seconds=cfg.pd_queue_seconds, trust=zsock.trust_of(cfg),
                          net_devices=cfg.nixl_net_devices, advertise_host=cfg.pd_peer_advertise_host)


@dataclass
class ReceiverCounters(Counters):
    """What one receiver did since it started; the pd tier exports these as metrics."""

    handshakes: int = 0
    allocs: int = 0
    arrivals: int = 0
    bad_frames: int = 0
    alloc_errors: int = 0
    aborts: int = 0  # AbortTransfer frames handled on the alloc port, from senders, proxies and requests
    proxy_notifications: int = 0
    refusals: dict[str, int] = field(default_factory=dict)  # alloc refusals by ErrorReply code


class ReceiverError(UnavailableError, RuntimeError):
    """The receiver cannot start (port taken, NIXL missing); the message names the fix."""


class SleepError(UnavailableError, RuntimeError):
    """The receiver could not go to sleep in time (writes still in flight); it stays registered."""


class KVReceiver:
    """Serves one TP rank's pd_buffer to senders; hands arrived transfers to the engine."""

    def __init__(self, cfg: ReceiverConfig, buffer: PDBuffer, fingerprint: m.LayoutFingerprint, *,
                 receiver_id: str | None = None) -> None:
        if fingerprint.page_bytes and fingerprint.page_bytes != buffer.page_bytes:
            raise ReceiverError(f"fingerprint says {fingerprint.page_bytes}-byte chunks, the pd_buffer "
                                f"has {buffer.page_bytes}-byte pages")
        self.cfg = cfg
        self.buffer = buffer
        self.fingerprint = fingerprint
        # Changes on every start: a sender holding an older epoch must handshake again.
        self.epoch = random.SystemRandom().randrange(1, 1 << 62)
        self.receiver_id = receiver_id or f"{cfg.host}:{cfg.init_port}"
        self.table = TransferTable(buffer, cfg.lease_seconds, cfg.queue_seconds)
        # Transfers several prefiller ranks write into (receiver/joints.py).
        self.joints = Joints(self.table, cfg.alloc_timeout + cfg.lease_seconds + cfg.queue_seconds)
        self._allocating: set[str] = set()  # ids between an alloc's arrival and its table entry
        self._agent = nixl_agent.make_agent(f"kvf-recv-{self.receiver_id}-{self.epoch}", cfg.net_devices)
        self._agent_metadata = b""
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the NIXL thread out of its idle wait
        self._threads: list[threading.Thread] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.max_waiting_allocs, thread_name_prefix="kvf-alloc")
        self._bad = RateLimitedLog(logger)
        self._ports = Ports(cfg.host, cfg.init_port, cfg.alloc_port, cfg.trust, cfg.advertise_host, self._on_init,
                            self._on_alloc, self._bad_frame, self._writer_gone, WRITER_GONE_GRACE_S)
        self.table.on_quarantine = self._quarantined
        self.nixl_health = LoopHealth("receiver NIXL thread")
        self.counters = ReceiverCounters()
        self._asleep = False  # vLLM sleep mode: allocs are refused while the pd_buffer is not registered
        self._sleep_lock = threading.Lock()  # an alloc is either refused or seen by suspend()'s drain
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # work for the NIXL thread (agent calls)

    # ---- lifecycle ----
    def start(self) -> KVReceiver:
        self.buffer.register(self._agent)
        self._agent_metadata = self._agent.get_agent_metadata()
        self._threads.append(self._ports.start())
        if not self._ports.started(10):
            self.close()
            raise ReceiverError(f"receiver ports did not start: {self._ports.error}")
        t = threading.Thread(target=supervise_thread, args=(self.nixl_health, self._nixl_main, self._stop),
                             name="kvf-recv-nixl", daemon=True)
        t.start()
        self._threads.append(t)
        logger.info("receiver %s listening: init port %d, alloc port %d, pd_buffer %d pages of %d bytes "
                    "(epoch %d)", self.receiver_id, self.cfg.init_port, self.cfg.alloc_port,
                    self.buffer.num_pages, self.buffer.page_bytes, self.epoch)
        return self

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        self._ports.stop()
        for t in self._threads:
            t.join(timeout=5)
        self._threads.clear()
        self.buffer.cancel_waiters("receiver closed")  # no pool thread blocks on for pd_alloc_timeout
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.table.close()
        self.buffer.deregister()

    def __enter__(self) -> KVReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, live: LiveGauges) -> None:
        """Keep `live`'s free pages and transfers in flight true as they change (vLLM's /metrics
        reads them when scraped, between engine steps too)."""
        self.buffer.on_free = lambda n: live.set("pd_buffer_free_pages", n)
        self.table.on_expecting = lambda n: live.set("pd_transfers_in_flight", n)
        live.set("pd_buffer_pages", self.buffer.num_pages)
        live.set("pd_buffer_free_pages", self.buffer.free_pages)
        live.set("pd_transfers_in_flight", self.table.expecting())

    # ---- engine side ----
    @contextmanager
    def claim(self, transfer_id: str, timeout: float | None = None) -> Iterator[ReceivedTransfer]:
        """The arrived transfer's pages, pinned until the block exits; waits up to pd_kv_ready_timeout."""
        with self.table.claim(transfer_id, self.cfg.kv_ready_timeout if timeout is None else timeout) as t:
            yield t

    # ---- ports ----
    def _bad_frame(self, why: str, port_name: str) -> None:
        self.counters.bad_frames += 1
        self._bad.warning("receiver %s: rejected %s on the %s port", self.receiver_id, why, port_name)

    async def _on_init(self, sock: zmq.asyncio.Socket, ident: bytes, body: bytes) -> None:
        try:
            hello = m.decode(body, expect=m.Hello)
        except m.MessageError as e:
            self._bad_frame(f"a bad frame ({e})", "init")
            await peering.reply(sock, ident, m.ErrorReply(code="bad_message", message=str(e)[:4000]))
            return
        answer = peering.welcome(hello, ("receiver", "sender"), self.receiver_id, self.fingerprint, self.epoch,
                                 self._agent.name, self._agent_metadata, m.Region(
                                     addr=self.buffer.base_addr, page_bytes=self.buffer.page_bytes,
                                     num_pages=self.buffer.num_pages, mem_type=nixl_agent.mem_type(self.buffer.device),
                                     device_id=nixl_agent.device_id(self.buffer.device)))
        if isinstance(answer, m.Welcome):
            self.counters.handshakes += 1
            logger.info("handshake from %s (rank %d, agent %s)", hello.peer_id, hello.tp_rank, hello.agent_name)
        await peering.reply(sock, ident, answer)

    async def _on_alloc(self, sock: zmq.asyncio.Socket, ident: bytes, body: bytes) -> None:
        arrival = time.monotonic()  # a queued alloc's wait counts from here
        try:
            req = m.decode(body, expect=(m.AllocRequest, m.AbortTransfer, m.RenewLease))
        except m.MessageError as e:
            self._bad_frame(f"a bad frame ({e})", "alloc")
            await peering.reply(sock, ident, m.ErrorReply(code="bad_message", message=str(e)[:4000]))
            return
        if isinstance(req, m.AbortTransfer):
            if not self.joints.abort(req, ident):
                self.table.abort(req.transfer_id, req.generation, req.reason, conn=ident, final=req.final)
            self.counters.aborts += 1
            if req.ack:
                await peering.reply(sock, ident, m.AbortAck(transfer_id=req.transfer_id, generation=req.generation))
            return
        if isinstance(req, m.RenewLease):
            left = self.table.renew(req.transfer_id, req.generation, self.joints.conn(req.transfer_id, ident))
            await peering.reply(sock, ident, m.ErrorReply(
                code="lease_gone", transfer_id=req.transfer_id,
                message=f"transfer {req.transfer_id} cannot be renewed: it ended, arrived, or is not this "
                        "connection's") if left is None else m.LeaseRenewed(
                transfer_id=req.transfer_id, generation=req.generation, lease_seconds=left))
            return
        tid = req.transfer_id

        def error(code: str, message: str) -> m.ErrorReply:
            self._refused(code)
            return m.ErrorReply(code=code, message=message[:4000], transfer_id=tid)

        if req.epoch != self.epoch:
            await peering.reply(sock, ident, error("stale_epoch", f"receiver {self.receiver_id} restarted "
                                                   f"(epoch {self.epoch}, request carried {req.epoch}): "
                                                   "handshake again"))
            return
        if req.writers > 1 and tid in self.joints:  # another prefiller rank of a transfer already reserved
            await peering.reply(sock, ident, await self.joints.join(req, ident, self.cfg.alloc_timeout))
            return
        why = self.table.refusal(tid) or (f"transfer {tid} is already in progress" if tid in self._allocating else None)
        if why is not None:  # "aborted": dropped before the prefiller asked (its client left), not a reused id
            await peering.reply(sock, ident, error("aborted" if self.table.aborted_before_alloc(tid) else "duplicate",
                                                   why))
            return
        with self._sleep_lock:
            asleep = self._asleep
            if not asleep:
                self._allocating.add(tid)
        if asleep:
            await peering.reply(sock, ident, error("asleep", f"receiver {self.receiver_id} is asleep (vLLM sleep "
                                                   "mode): its pd_buffer is not registered; the request recomputes"))
            return
        try:
            reply = await (self.joints.first(req, ident, arrival, self._reserve) if req.writers > 1
                           else self._reserve(req, ident, arrival))
        finally:
            self._allocating.discard(tid)
        if isinstance(reply, m.ErrorReply):
            self._refused(reply.code)
        await peering.reply(sock, ident, reply)

    def _quarantined(self, inc: Incoming, reason: str) -> None:  # any thread, under the table's lock
        self._ports.call_soon(self._tell_writers, inc.transfer_id, inc.res.generation, inc.conn, reason)

    def _tell_writers(self, sock: zmq.asyncio.Socket, tid: str, generation: int, conn: bytes, reason: str) -> None:
        """On the ports loop: the transfer `conn` reserved was dropped by someone else (the proxy: its
        client left). Its writers (each prefiller rank of a joint one) are told, so they post no
        more writes and answer with their own abort, final when nothing can land: the quarantine
        ends then, while the prefiller's compute step may still run."""
        msg = m.AbortTransfer(transfer_id=tid, generation=generation, reason=reason[:200])
        for ident in self.joints.writers(tid) or [conn]:
            asyncio.ensure_future(peering.reply(sock, ident, msg))

    def _refused(self, code: str) -> None:
        self.counters.alloc_errors += 1
        self.counters.refusals[code] = self.counters.refusals.get(code, 0) + 1

    def _writer_gone(self, conn: bytes) -> int:
        self.joints.writer_gone(conn)
        return self.table.writer_gone(conn)

    async def _reserve(self, req: m.AllocRequest, ident: bytes, arrival: float) -> m.Msg:
        """Pages for `req`; `ident`: the connection key the table keeps (joints.conn_key for several writers)."""
        tid = req.transfer_id
        need = len(req.chunk_keys)
        try:
            res = self.buffer.reserve(need, tid, self.cfg.lease_seconds, timeout=0)
        except BufferTooSmall as e:
            return m.ErrorReply(code="too_large", message=str(e)[:4000], transfer_id=tid)
        except BufferFullTimeout as e:
            if len(self._allocating) > self.cfg.max_waiting_allocs:
                return m.ErrorReply(code="buffer_full", transfer_id=tid, message=(
                    f"{e}; {len(self._allocating) - 1} allocs are waiting already, the most this receiver "
                    "queues")[:4000])
            # Wait our turn (FIFO) off the loop; other requests go on meanwhile.
            deadline = arrival + self.cfg.alloc_timeout
            logger.info("transfer %s waits for %d pages (pd_alloc_timeout %.1fs)", tid, need,
                        self.cfg.alloc_timeout)
            try:
                res = await asyncio.get_running_loop().run_in_executor(
                    self._pool, lambda: self.buffer.reserve(need, tid, self.cfg.lease_seconds,
                                                            timeout=max(0.001, deadline - time.monotonic())))
            except PDBufferError as e:  # timed out, or the receiver is closing
                return m.ErrorReply(code="buffer_full", message=str(e)[:4000], transfer_id=tid)
        try:
            self.table.add(Incoming(tid, req.sender_id, list(req.chunk_keys), req.num_tokens, res, ident))
        except TransferError as e:  # aborted while it waited for pages: no WRITE can be under way yet
            self.buffer.release(res)
            return m.ErrorReply(code="aborted", message=str(e)[:4000], transfer_id=tid)
        self._kick.set()  # poll fast from now on: UCX needs this side's progress to move the data
        self.counters.allocs += 1
        return m.AllocResponse(transfer_id=tid, generation=res.generation, pages=list(res.pages),
                               lease_seconds=self.cfg.lease_seconds)

    # ---- NIXL arrivals ----
    def _nixl_main(self) -> None:
        nixl_agent.tight_sleeps()
        ctx = zmq.Context()
        proxy = None
        if self.cfg.proxy_host and self.cfg.proxy_port:
            proxy = zsock.connect(ctx, zmq.PUSH, self.cfg.trust, zsock.tcp(self.cfg.proxy_host, self.cfg.proxy_port))
            proxy.setsockopt(zmq.SNDHWM, 1000)
        next_sweep = time.monotonic() + SWEEP_S
        wait, fast_until = IDLE_POLL_S, 0.0
        try:
            while not self._stop.is_set():
                self._run_calls()
                notified = False
                for _agent, msgs in self._agent.get_new_notifs().items():
                    for raw in msgs:
                        notified = True
                        self._on_notif(raw, proxy)
                now = time.monotonic()
                if now >= next_sweep:
                    self.table.sweep()
                    next_sweep = now + SWEEP_S
                if notified:
                    fast_until = now + FAST_S
                wait = poll_pause(wait, self.table.expecting() > 0, now < fast_until)
                if self._kick.wait(wait):  # pages reserved (or the receiver woke from sleep)
                    fast_until = time.monotonic() + FAST_S
                self._kick.clear()
                self.nixl_health.recovered()
        finally:
            ctx.destroy(linger=0)

    def _on_notif(self, raw: bytes, proxy: zmq.Socket | None) -> None:
        try:
            note = m.decode(raw, expect=m.ArrivalNotice)
        except m.MessageError as e:
            self.counters.bad_frames += 1
            self._bad.warning("receiver %s: bad NIXL notification dropped (%s)", self.receiver_id, e)
            return
        if self.joints.notified(note.transfer_id, note.generation, note.writer) is False:
            return  # other prefiller ranks still write into this transfer
        inc = self.table.arrived(note.transfer_id, note.generation)
        if inc is None:
            return
        self.counters.arrivals += 1
        if proxy is not None:
            try:
                proxy.send(m.encode(m.ProxyNotification(
                    transfer_id=inc.transfer_id, receiver_id=self.receiver_id,
                    num_chunks=len(inc.chunk_keys), num_tokens=inc.num_tokens)), flags=zmq.NOBLOCK)
                self.counters.proxy_notifications += 1
            except zmq.Again:
                self._bad.warning("proxy at %s:%s is not reading notifications; dropped one",
                                  self.cfg.proxy_host, self.cfg.proxy_port)

    # ---- vLLM sleep mode (docs/compatibility.md): drain the writes that may land, deregister the
    # pd_buffer, register it again with a new epoch ----
    @property
    def asleep(self) -> bool:
        return self._asleep

    def suspend(self) -> int:
        """Before vLLM frees or remaps the pd_buffer's memory: refuse new allocs, quarantine the
        transfers not arrived yet (their senders are told, and stop writing), wait until no WRITE
        can land in any page (each arrives, its sender says none will, or its lease ends; bounded by
        pd_lease_seconds), then deregister the pd_buffer from NIXL.
        Returns how many transfers were quarantined; idempotent."""
        with self._sleep_lock:
            if self._asleep:
                return 0
            self._asleep = True
        self.buffer.cancel_waiters("the decoder is going to sleep (vLLM sleep mode)")
        why = "the decoder went to sleep (vLLM sleep mode)"
        n = self.table.quarantine_unarrived(why)
        deadline = time.monotonic() + self.cfg.lease_seconds + 2.0  # each write lands or its lease ends
        while self._allocating or self.table.writes_may_land():
            if time.monotonic() >= deadline:
                with self._sleep_lock:
                    self._asleep = False  # vLLM's sleep fails with this: the receiver serves on
                raise SleepError(f"receiver {self.receiver_id}: writes still in flight after pd_lease_seconds "
                                 f"({self.cfg.lease_seconds:.0f}s); the pd_buffer stays registered and in service")
            self.buffer.cancel_waiters("the decoder is going to sleep (vLLM sleep mode)")
            n += self.table.quarantine_unarrived(why)  # an alloc granted while this began
            self.table.sweep()
            time.sleep(0.01)
        self._on_nixl(self._deregister)
        logger.info("receiver %s asleep: pd_buffer deregistered from NIXL (%d transfers in flight were "
                    "quarantined and drained)", self.receiver_id, n)
        return n

    def resume(self) -> None:
        """After vLLM remapped the memory: register the pd_buffer again and take a new epoch, so
        every sender handshakes again and loads the new registration. Idempotent."""
        with self._sleep_lock:
            if not self._asleep:
                return
        self._on_nixl(self._register)
        with self._sleep_lock:
            self.epoch = random.SystemRandom().randrange(1, 1 << 62)
            self._asleep = False
        logger.info("receiver %s awake: pd_buffer registered again (epoch %d)", self.receiver_id, self.epoch)

    def _deregister(self) -> None:
        self.buffer.deregister()
        self._agent_metadata = self._agent.get_agent_metadata()

    def _register(self) -> None:
        self.buffer.register(self._agent)
        self._agent_metadata = self._agent.get_agent_metadata()

    def _on_nixl(self, fn: Callable[[], object], timeout: float = 30.0) -> None:
        """Run `fn` on the NIXL thread, the agent's only user (inline when that thread is not running)."""
        alive = [t for t in self._threads if t.name == "kvf-recv-nixl" and t.is_alive()]
        if not alive:
            fn()
            return
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        self._kick.set()
        fut.result(timeout)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
