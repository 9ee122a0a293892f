"""A write's descriptors, checked and built before the write: `KVSender.prepare` when the grant's
pages are known (engine/pd/producer.py: as the early grant arrives, while the prompt computes),
so that `KVSender.write` at the prompt's end only checks that its arguments are still those and
posts (docs/benchmarks.md, "Transfer with different TP": building them was most of a small sliced
write's added time).

A preparation is used only by a write of the very same chunks (addresses and sizes) into the very
same pages, from the same first page, with the same run arrays (the same objects, and their content
unchanged since); any other write builds its own, as without one. It holds NIXL descriptor lists
(no agent state: only addresses), so it stays right across sleep mode and needs no release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvferry.sender.descs import write_descs
from kvferry.sender.errors import ChunkError
from kvferry.sender.grants import Grant, check_ranges, pd_region


class Prepared:
    """The descriptors of one write into one grant, and what they were built from."""

    __slots__ = ("first", "chunks", "pages", "runs", "run_bytes", "local", "remote", "nbytes", "widest")

    def __init__(self, first: int, chunks: list[tuple[int, int]], pages: list[int], runs: list | None,
                 built: tuple[Any, Any, int, int]) -> None:
        self.first, self.chunks, self.pages, self.runs = first, chunks, pages, runs
        # Each distinct run array's content when prepared: one changed in place since is not these.
        self.run_bytes = [] if runs is None else [(r, r.tobytes()) for r in _distinct(runs)]
        self.local, self.remote, self.nbytes, self.widest = built

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


def _distinct(runs: Sequence[np.ndarray]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for r in runs:
        if not any(r is o for o in out):
            out.append(r)
    return out


def checked_descs(grant: Grant, chunks: Sequence[tuple[int, int]], first: int, runs: Sequence[np.ndarray] | None,
                  ranges: list[tuple[int, int]], device_id: int) -> tuple[Any, Any, int, int]:
    """What `KVSender.write` posts for these arguments: (local, remote, bytes, widest page write),
    the grant's preparation when it matches, else built now (every check of a write on the way)."""
    pages = grant.pages[first:first + len(chunks)]
    prep = grant.prepared
    if prep is not None and prep.matches(first, chunks, pages, runs):
        return prep.local, prep.remote, prep.nbytes, prep.widest
    check_ranges(ranges, chunks)
    if not chunks:
        raise ChunkError(f"transfer {grant.transfer_id}: a write needs at least one chunk")
    if first < 0 or first + len(chunks) > len(grant.pages):
        raise ChunkError(f"chunks {first}..{first + len(chunks)} of transfer {grant.transfer_id} do not fit "
                         f"its {len(grant.pages)} pages")
    return write_descs(chunks, pages, pd_region(grant.peer), device_id, runs)


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
    local, remote, nbytes, widest = checked_descs(grant, chunks, first, run_list, ranges, device_id)
    built = (agent.get_xfer_descs(local, local_mem), agent.get_xfer_descs(remote, pd_region(grant.peer).mem_type),
             nbytes, widest)
    return Prepared(first, chunks, list(grant.pages[first:first + len(chunks)]), run_list, built)
