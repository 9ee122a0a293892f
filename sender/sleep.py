"""vLLM sleep mode on the prefiller side: the sender deregisters its memory (the staging pages) from
NIXL before vLLM unmaps it and registers it again after (docs/compatibility.md). The caller
(engine/pd/producer.py) drains the writes that read it first.

A mixin of :class:`~kvferry.sender.kv_sender.KVSender`: it uses the sender's agent, registrations and
NIXL thread.
"""

from __future__ import annotations

from typing import Any


class SenderSleep:
    # The sender's state this mixin uses (set by KVSender.__init__), declared for the type checker.
    _asleep: bool
    _regs: list[Any]
    _tensors: list[Any]
    _metadata: bytes
    _agent: Any
    _call: Any
    _preps: Any

    def suspend(self) -> None:
        """vLLM sleep mode: deregister every region from NIXL; the caller drained the writes that
        read them. Sends are refused until resume(). Idempotent."""
        if self._asleep:
            return
        self._asleep = True
        self._preps.close_all()  # no prepared handle outlives the registrations it reads
        for descs in self._regs:
            self._call(self._agent.deregister_memory, descs)
        self._regs.clear()
        self._metadata = self._call(self._agent.get_agent_metadata)

    def resume(self) -> None:
        """Register the same regions again (vLLM remapped them at the same addresses). Idempotent."""
        if not self._asleep:
            return
        self._regs = [self._call(self._agent.register_memory, t) for t in self._tensors]
        self._metadata = self._call(self._agent.get_agent_metadata)
        self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep
