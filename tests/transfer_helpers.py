"""Run a real KVReceiver (or KVSender) in a separate process, driven over a multiprocessing pipe."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field

import zmq

from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.receiver.conns import PROBE
from tests.polling import TimedOut, until

PAGE = 64 << 10


def trust(text: str | None):
    """A zsock.Trust for a secret given as text (None: plain ZMQ)."""
    from kvferry.common import secret, zsock
    return zsock.Trust(secret.from_text(text, "test")) if text else zsock.PLAIN


def fingerprint(page: int = PAGE, **over) -> m.LayoutFingerprint:
    base = dict(model="tiny", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64, block_size=32,
                kv_layout="cpu", chunk_format="block", chunk_size=64, page_bytes=page)
    base.update(over)
    return m.LayoutFingerprint(**base)


def p2p_worker(name: str, secret: str | None = None, *, slot: int, slots: int, timeout: float = 5.0, **fp):
    """A P2PService on free loopback ports, its CPU tier `slots` slots of `slot` bytes (tests close
    both: ``w.close(); w.cpu.close()``)."""
    from kvferry.common.config import KVFerryConfig
    from kvferry.engine.p2p.service import P2PService
    from kvferry.engine.tiers.cpu import CPUTier
    cfg = KVFerryConfig(enable_p2p=True, enable_controller=True, p2p_host="127.0.0.1",
                        p2p_init_ports=free_port(), p2p_lookup_ports=free_port(), lmcache_worker_ports=free_port(),
                        lmcache_instance_id=name, controller_pull_url=f"127.0.0.1:{free_port()}",
                        controller_reply_url=f"127.0.0.1:{free_port()}", blocking_timeout_secs=timeout,
                        cluster_secret=secret)
    cpu = CPUTier(capacity=slots * slot, slot_bytes=slot)
    return P2PService(cfg, cpu, 0, 1, b"salt", fingerprint(slot, **fp),
                     f"ipc://@kvferry-test-{name}-{time.monotonic_ns()}")


def peer_addr(w) -> m.PeerAddr:
    """Where a P2PService's peers reach it."""
    return m.PeerAddr(host="127.0.0.1", init_port=w.info.p2p_init_port, lookup_port=w.info.p2p_lookup_port)


def receiver_main(conn, init_port: int, alloc_port: int, pages: int, opts: dict) -> None:
    import faulthandler
    import signal

    import torch

    from kvferry.buffer.pd_buffer import PDBuffer
    from kvferry.receiver.kv_receiver import KVReceiver, ReceiverConfig
    from kvferry.receiver.transfer_table import TransferError

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # tests/conftest.py asks on a timeout

    torch.set_num_threads(1)
    fp = fingerprint(**opts.pop("fingerprint", {}))
    buf = PDBuffer(pages * PAGE, opts.pop("device", "cpu"), PAGE)
    host = opts.pop("host", "127.0.0.1")
    live = opts.pop("live_path", None)
    cfg = ReceiverConfig(host, init_port, alloc_port, trust=trust(opts.pop("secret", None)), **opts)
    with KVReceiver(cfg, buf, fp) as r:
        if live:
            from kvferry.common.live_gauges import LiveGauges
            gauges = LiveGauges(live)
            r.publish(gauges)
        conn.send(("ready", r.epoch, os.getpid()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                if live:
                    gauges.close()
                conn.send(("stopped",))
                return
            if cmd == "claim":
                tid, timeout = args
                try:
                    with r.claim(tid, timeout) as got:
                        data = {i: bytes(v.cpu().numpy()) for i, v in got.pages.items()}
                        conn.send(("ok", got.num_tokens, data))
                except TransferError as e:
                    conn.send(("err", type(e).__name__, str(e)))
            elif cmd == "state":
                s = buf.stats()
                conn.send(("state", buf.fully_free(), s.pages_free, r.counters.as_dict(), s.leases_expired,
                           r.table.sizes(), s.extra["waiting"]))


DUMPABLE: set[int] = set()  # receiver processes that dump their threads' stacks on SIGUSR1


@dataclass
class ReceiverProc:
    """A receiver in its own process; `restart()` keeps its ports (a new epoch, as a real restart)."""

    pages: int = 16
    opts: dict = field(default_factory=dict)
    init_port: int = field(default_factory=free_port)
    alloc_port: int = field(default_factory=free_port)

    def start(self) -> ReceiverProc:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child, self.init_port, self.alloc_port, self.pages,
                                                            dict(self.opts)), daemon=True)
        self.proc.start()
        DUMPABLE.add(self.proc.pid)
        # Far from the few seconds it takes alone: torch, NIXL and UCX start in a fresh process, which
        # a busy 2-core machine running a vLLM prefill step beside it can stretch past a minute.
        _, self.epoch, self.pid = self.ask("ready", timeout=240, send=False)
        return self

    def ask(self, *cmd, timeout: float = 30, send: bool = True):
        if send:
            self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"receiver process did not answer {cmd} within {timeout}s "
                               f"({'alive' if self.proc.is_alive() else f'exited {self.proc.exitcode}'})")
        return self.conn.recv()

    def state(self):
        return self.ask("state")

    def wait_fully_free(self, timeout: float) -> bool:
        """Whether every page is free within `timeout` s (False for the caller's assert and its message)."""
        try:
            return until(lambda: self.state()[1], timeout, "every page free", every=0.1)
        except TimedOut:
            return False

    @property
    def addr(self):
        from kvferry.sender.addr import ReceiverAddr
        return ReceiverAddr(self.opts.get("host", "127.0.0.1"), self.init_port, self.alloc_port)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask("stop", timeout=15)
            except (TimeoutError, EOFError, BrokenPipeError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        DUMPABLE.discard(self.proc.pid)

    def restart(self) -> None:
        self.stop()
        self.start()


def sender_main(conn, addr: tuple, pages: int) -> None:
    """A sender that announces each step of ("go" | "reserve", transfer_id); the test kills it
    where it likes."""
    import torch

    from kvferry.sender.addr import ReceiverAddr
    from kvferry.sender.kv_sender import KVSender, SenderConfig

    src = torch.arange(pages * PAGE, dtype=torch.int64).to(torch.uint8)
    with KVSender(SenderConfig("doomed"), fingerprint()) as s:
        s.register(src)
        conn.send(("ready", os.getpid()))
        cmd, tid = conn.recv()
        chunks = [(src.data_ptr() + i * PAGE, PAGE) for i in range(pages)]
        keys = [bytes([i + 1]) * 16 for i in range(pages)]
        if cmd == "reserve":  # pages reserved, nothing written: as a prefiller still computing
            s.reserve(tid, ReceiverAddr(*addr), keys, pages * 32).result(60)
            conn.send(("reserved",))
        else:
            fut = s.send(tid, ReceiverAddr(*addr), keys, chunks, pages * 32)
            conn.send(("sent",))
            fut.result(60)
            conn.send(("done",))
        try:
            conn.recv()  # wait to be killed; EOF when the test process is gone
        except EOFError:
            pass


def abort_acked(sock: zmq.Socket, transfer_id: str, generation: int = 0, reason: str = "test", final: bool = False,
                timeout_ms: int = 10_000) -> None:
    """Send an abort on `sock` (a DEALER on an alloc port) and wait for the receiver's AbortAck:
    then the abort holds for the next request, on any connection. Other messages are read past."""
    sock.send(m.encode(m.AbortTransfer(transfer_id=transfer_id, generation=generation, reason=reason, final=final,
                                       ack=True)))
    deadline = time.monotonic() + timeout_ms / 1000
    while (left := deadline - time.monotonic()) > 0:
        reply = next_answer(sock, max(1, int(left * 1000)))
        if isinstance(reply, m.AbortAck) and reply.transfer_id == transfer_id:
            return
    raise AssertionError(f"no AbortAck for {transfer_id} within {timeout_ms} ms")


def next_answer(sock: zmq.Socket, timeout_ms: int) -> m.Msg | None:
    """The next message on `sock` that is not a closed-connection probe, or None after `timeout_ms`.

    The alloc port probes the identities last seen on a descriptor that closed, a grace after it
    closed; the kernel hands the number to the next connection, so a socket opened just after
    another one closed (as these tests do) may get that probe, which senders ignore."""
    deadline = time.monotonic() + timeout_ms / 1000
    while (left := deadline - time.monotonic()) > 0 and sock.poll(max(1, int(left * 1000))):
        if (raw := sock.recv()) != PROBE:
            return m.decode(raw)
    return None
