"""A write's caller never waits forever: whatever goes wrong while its end is handled (a NIXL
future that failed, a sender whose loop closed under it), the caller's future is resolved."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import pytest

from kvferry.buffer import nixl_agent
from kvferry.sender.errors import SendError, WriteFailed
from kvferry.sender.grant_ends import GrantEnds
from kvferry.sender.grants import Grant
from kvferry.sender.results import SenderCounters


def _grant() -> Grant:
    # The peer is never reached: both cases end before anything is sent to the receiver.
    peer: Any = None
    return Grant("t-1", peer, peer, 1, [0], time.monotonic() + 30, time.monotonic(), {}, False)


def _ends(loop: asyncio.AbstractEventLoop) -> GrantEnds:
    peers: Any = None
    preps: Any = None
    return GrantEnds(loop, peers, preps, SenderCounters())


def test_a_write_that_fails_after_the_loop_closed_still_fails_its_caller() -> None:
    loop = asyncio.new_event_loop()
    loop.close()  # the sender closed while this write was in flight
    ends, grant = _ends(loop), _grant()
    xf: concurrent.futures.Future[nixl_agent.XferDone] = concurrent.futures.Future()
    xf.set_result(nixl_agent.XferDone("ERR (sender closed)", 0.0, 0.0))
    out: concurrent.futures.Future = concurrent.futures.Future()
    ends.written(grant, 1, 100, time.monotonic(), True, xf, out)
    with pytest.raises(WriteFailed, match="sender closed"):
        out.result(0)


def test_an_error_while_ending_a_write_reaches_its_caller() -> None:
    loop = asyncio.new_event_loop()
    try:
        ends, grant = _ends(loop), _grant()
        xf: concurrent.futures.Future[nixl_agent.XferDone] = concurrent.futures.Future()
        xf.set_exception(RuntimeError("the NIXL thread broke"))
        out: concurrent.futures.Future = concurrent.futures.Future()
        ends.written(grant, 1, 100, time.monotonic(), True, xf, out)
        with pytest.raises(SendError, match="the NIXL thread broke"):
            out.result(0)
    finally:
        loop.close()
