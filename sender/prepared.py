"""A write's descriptors, checked and built before the write: `KVSender.prepare` when the grant's
pages are known (engine/pd/producer.py: as the early grant arrives, while the prompt computes),
so that `KVSender.write` at the prompt's end only checks that its arguments are still those and
posts (docs/benchmarks.md, "Transfer with different TP": building them was most of a small sliced
write's added time).

A preparation is used only by a write of the very same chunks (addresses and sizes) into the very
same pages, from the same first page, with the same run arrays (the same objects, and their content
unchanged since); any other write builds its own, as without one. It holds NIXL descriptor lists
(no agent state: only addresses) and, once the NIXL thread made it, the notifying write's NIXL
transfer handle, which that write posts as it is (NIXL's own checks and set-up, `initialize_xfer`,
done too). `Handles` releases a handle not posted, on the NIXL thread, before anything it points at
goes: the grant ends, the receiver's agent is removed, the memory is deregistered (sleep mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvferry.common.log import get_logger
from kvferry.sender.descs import write_descs
from kvferry.sender.errors import ChunkError
from kvferry.sender.grants import Grant, check_ranges, pd_region

logger = get_logger(__name__)


class Prepared:
    """The descriptors of one write into one grant, and what they were built from."""

    __slots__ = ("first", "chunks", "pages", "runs", "run_bytes", "local", "remote", "nbytes", "widest", "peer",
                 "agent_name", "notif", "handle", "closed", "owner", "gen")

    def __init__(self, first: int, chunks: list[tuple[int, int]], pages: list[int], runs: list | None,
                 built: tuple[Any, Any, int, int]) -> None:
        self.first, self.chunks, self.pages, self.runs = first, chunks, pages, runs
        # Each distinct run array's content when prepared: one changed in place since is not these.
        self.run_bytes = [] if runs is None else [(r, r.tobytes()) for r in _distinct(runs)]
        self.local, self.remote, self.nbytes, self.widest = built
        self.peer: Any = None
        self.agent_name, self.notif = "", b""
        self.handle: Any = None  # the NIXL transfer handle: only the NIXL thread touches it
        self.closed = False
        self.owner: Handles | None = None
        self.gen = 0  # the owner's sleep generation when prepared: a handle of an older one is stale

    def matches(self, first: int, chunks: Sequence[tuple[int, int]], pages: list[int],
                runs: Sequence[np.ndarray] | None) -> bool:
        """A write of these arguments would build exactly these descriptors. Plain comparisons, no
        numpy but one `tobytes` per distinct run array: this runs on the caller's thread."""
        if first != self.first or chunks != self.chunks or pages != self.pages:
            return False
        if runs is None or self.runs is None:
            return runs is None and self.runs is None
        if len(runs) != len(self.runs):
            return False
        for a, b in zip(runs, self.runs, strict=True):
            if a is not b:
                return False
        for r, content in self.run_bytes:
            if r.tobytes() != content:
                return False
        return True


    # ---- on the NIXL thread ----
    def make(self, agent: Any, agent_name: str, notif: bytes) -> None:
        """Make the notifying write's transfer handle (NIXL checks the descriptors against the
        registrations here, as it would at the write), unless released meanwhile."""
        if self.closed or self._stale():
            return
        try:
            self.handle = agent.initialize_xfer("WRITE", self.local, self.remote, agent_name, notif)
        except Exception as e:  # noqa: BLE001 - the write then makes its own, and reports
            logger.debug("no prepared NIXL handle: %s", e)
            return
        self.agent_name, self.notif = agent_name, notif

    def take(self, op: str, agent_name: str, notif: bytes) -> Any:
        """The handle, for a post of these descriptors by `op` to `agent_name` with `notif`; it is
        the post's from now on (released when the transfer ends). None: make one."""
        h = self.handle
        if h is None or self.closed or op != "WRITE" or agent_name != self.agent_name or notif != self.notif or \
                self._stale():
            return None
        self.handle = None
        return h

    def _stale(self) -> bool:
        """Prepared before a sleep (the registrations its handle points at were dropped since)."""
        return self.owner is not None and self.gen != self.owner.gen

    def release(self, agent: Any) -> None:
        self.closed = True
        h, self.handle = self.handle, None
        if h is not None:
            agent.release_xfer_handle(h)


class Handles:
    """A sender's preparations that hold, or will hold, a NIXL transfer handle not yet posted.
    Handles are made and released on the NIXL thread, in its queue's order: each `close` is queued
    before what would leave the handle dangling (the peer's agent removal, a deregistration)."""

    def __init__(self, nixl: Any) -> None:
        self._nixl = nixl
        self._open: set[Prepared] = set()
        self.gen = 0  # sleeps so far (close_all): a preparation begun before one never posts its handle

    def make(self, grant: Grant, prep: Prepared | None, gen: int) -> None:
        """`prep` is `grant`'s preparation now (an earlier one is closed); its handle is made on the
        NIXL thread. `gen`: this `gen` as read before the preparation began."""
        self.close(grant.prepared)
        grant.prepared = prep
        if prep is None or grant.ended or grant.cut or grant.peer.dropped:
            return
        prep.peer, prep.owner, prep.gen = grant.peer, self, gen
        self._open.add(prep)  # before the make is queued: a close from now on is queued after it
        self._nixl.run(prep.make, self._nixl.agent, grant.peer.agent, grant.notice)

    def close(self, prep: Prepared | None) -> None:
        if prep is not None and prep in self._open:
            self._open.discard(prep)
            self._nixl.run(prep.release, self._nixl.agent)

    def close_peer(self, peer: Any) -> None:
        for prep in list(self._open):
            if prep.peer is peer:
                self.close(prep)

    def close_all(self) -> None:
        """Sleep mode, before the deregistration is queued: every handle goes, and one whose
        preparation began before now is never made or posted (the write makes its own)."""
        self.gen += 1
        for prep in list(self._open):
            self.close(prep)

    def __len__(self) -> int:
        return len(self._open)


def _distinct(runs: Sequence[np.ndarray]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for r in runs:
        if not any(r is o for o in out):
            out.append(r)
    return out


def checked_descs(grant: Grant, chunks: Sequence[tuple[int, int]], first: int, runs: Sequence[np.ndarray] | None,
                  ranges: list[tuple[int, int]], device_id: int) -> tuple[Any, Any, int, int, Prepared | None]:
    """What `KVSender.write` posts for these arguments: (local, remote, bytes, widest page write,
    the preparation they are), the grant's preparation when it matches, else built now (every
    check of a write on the way)."""
    pages = grant.pages[first:first + len(chunks)]
    prep = grant.prepared
    if prep is not None and prep.matches(first, chunks, pages, runs):
        return prep.local, prep.remote, prep.nbytes, prep.widest, prep
    check_ranges(ranges, chunks)
    if not chunks:
        raise ChunkError(f"transfer {grant.transfer_id}: a write needs at least one chunk")
    if first < 0 or first + len(chunks) > len(grant.pages):
        raise ChunkError(f"chunks {first}..{first + len(chunks)} of transfer {grant.transfer_id} do not fit "
                         f"its {len(grant.pages)} pages")
    return (*write_descs(chunks, pages, pd_region(grant.peer), device_id, runs), None)


def prepare(agent: Any, grant: Grant, chunks: Sequence[tuple[int, int]], first: int,
            runs: Sequence[np.ndarray] | None, ranges: list[tuple[int, int]], device_id: int,
            local_mem: str) -> Prepared | None:
    """Check and build the descriptors of a write of these arguments into `grant`, as NIXL
    descriptor lists (`agent.get_xfer_descs` only makes lists: any thread may call it). None when
    they cannot be kept: run arrays that are not int64 numpy arrays. Raises what the write would."""
    chunks = list(chunks)
    run_list = None if runs is None else list(runs)
    if run_list is not None and any(type(r) is not np.ndarray for r in run_list):
        return None
    local, remote, nbytes, widest, _ = checked_descs(grant, chunks, first, run_list, ranges, device_id)
    built = (agent.get_xfer_descs(local, local_mem), agent.get_xfer_descs(remote, pd_region(grant.peer).mem_type),
             nbytes, widest)
    return Prepared(first, chunks, list(grant.pages[first:first + len(chunks)]), run_list, built)
