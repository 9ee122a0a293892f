"""Each scheduled request's KV block ids, followed through vLLM's public scheduler output.

vLLM tells a connector a request's blocks only as they change: a newly scheduled request carries
all of them (``scheduled_new_reqs[i].block_ids``), a running one the blocks added this step
(``scheduled_cached_reqs.new_block_ids``), and a resumed one (after preemption) its whole new
list. The table replays that, for the one KV cache group kvferry handles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


class BlockTable:
    def __init__(self) -> None:
        self._blocks: dict[str, list[int]] = {}

    def update(self, so: SchedulerOutput) -> None:
        """Apply one step's allocations; call before reading the step's requests."""
        for new in so.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
        cached = so.scheduled_cached_reqs
        for rid, groups in zip(cached.req_ids, cached.new_block_ids, strict=True):
            added = list(groups[0]) if groups else []
            if rid in cached.resumed_req_ids:
                self._blocks[rid] = added
            elif added:
                self._blocks.setdefault(rid, []).extend(added)

    def get(self, req_id: str) -> list[int]:
        return list(self._blocks.get(req_id, ()))

    def forget(self, req_id: str) -> None:
        self._blocks.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._blocks)
