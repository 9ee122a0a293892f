"""vLLM sleep mode on the decoder side: the receiver drains the writes that may still land in its
pd_buffer, deregisters it from NIXL before vLLM unmaps its memory, and registers it again (with a
new epoch, so every sender handshakes again) after vLLM maps it back (docs/compatibility.md).

A mixin of :class:`~kvferry.receiver.kv_receiver.KVReceiver`: it uses the receiver's buffer, table,
NIXL agent and threads.
"""

from __future__ import annotations

import concurrent.futures
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from kvferry.common.errors import UnavailableError
from kvferry.common.log import get_logger

logger = get_logger(__name__)


class SleepError(UnavailableError, RuntimeError):
    """The receiver could not go to sleep in time (writes still in flight); it stays registered."""


class ReceiverSleep:
    # The receiver's state this mixin uses (set by KVReceiver.__init__), declared for the type checker.
    receiver_id: str
    cfg: Any
    buffer: Any
    table: Any
    epoch: int
    _agent: Any
    _agent_metadata: bytes
    _allocating: set[str]
    _threads: list[threading.Thread]
    _kick: threading.Event

    def _init_sleep(self) -> None:
        self._asleep = False  # allocs are refused while the pd_buffer is not registered
        self._sleep_lock = threading.Lock()  # an alloc is either refused or seen by suspend()'s drain
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # work for the NIXL thread (agent calls)

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
