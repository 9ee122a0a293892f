"""The worker -> scheduler channel of one instance: chunks a controller's move put into or took
out of the worker's CPU tier, which the planner's index must learn about."""

from __future__ import annotations

import contextlib
import os
import sys

import zmq

from kvferry.common import zsock
from kvferry.common.log import get_logger
from kvferry.common.wire import messages as m

logger = get_logger(__name__)


def notice_addr(engine_id: str) -> str:
    """The ipc address the worker tells its scheduler about adopted and dropped chunks on.

    Linux: an abstract socket (no file; gone with the process, which vLLM may SIGKILL)."""
    if sys.platform.startswith("linux"):
        return f"ipc://@kvferry-p2p-{engine_id}"
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"ipc://{base}/kvferry-p2p-{engine_id}.sock"


class PlannerNotices:
    """Scheduler side of the worker -> scheduler channel: chunks a move put into or took out of
    the worker's CPU tier, which the planner's index must learn about."""

    def __init__(self, addr: str, trust: zsock.Trust = zsock.PLAIN) -> None:
        self.addr = addr
        self._sock: zmq.Socket = zsock.socket(zmq.Context.instance(), zmq.PULL, trust, server=True)
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
                logger.warning("bad notice from the P2P service: %s", e)
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
