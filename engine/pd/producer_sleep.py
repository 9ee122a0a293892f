"""vLLM sleep mode on the prefiller side: prompts still computing are cancelled, the writes that
read the staging pages drained, then the sender deregisters them from NIXL (and registers them
again after vLLM remapped the memory).

A mixin of :class:`~kvferry.engine.pd.producer.PDProducer`: it uses the producer's staging
pages, open prompts and sender.
"""

from __future__ import annotations

import time
from typing import Any

from kvferry.common.log import get_logger

logger = get_logger(__name__)


class ProducerSleep:
    # The producer's state this mixin uses (set by PDProducer.__init__), declared for the type checker.
    _asleep: bool
    _open: dict[str, Any]
    _staging_lease: float
    staging: Any
    sender: Any

    def cancel(self, transfer_id: str) -> None:
        raise NotImplementedError  # PDProducer's

    def suspend(self) -> None:
        """vLLM sleep mode, before the staging memory is unmapped: prompts still computing are
        cancelled, every write that reads staging ends (done, or cut at its lease), then the
        staging pages are deregistered from NIXL. Idempotent."""
        if self._asleep:
            return
        self._asleep = True
        for tid in list(self._open):
            self.cancel(tid)
        deadline = time.monotonic() + self._staging_lease
        while not self.staging.fully_free():
            if time.monotonic() >= deadline:
                logger.warning("prefiller going to sleep: staging pages still held after %.0fs; deregistering "
                               "anyway (no write outlives its lease)", self._staging_lease)
                break
            time.sleep(0.005)
        self.sender.suspend()
        logger.info("prefiller asleep: staging deregistered from NIXL")

    def resume(self) -> None:
        """After vLLM remapped the memory: register the staging pages again. Idempotent."""
        if not self._asleep:
            return
        self.sender.resume()
        self._asleep = False
        logger.info("prefiller awake: staging registered again")
