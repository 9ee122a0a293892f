"""What every storage tier offers the offload copier, so it loops over tiers instead of naming them.

A tier holds chunk bytes by key (the prefix-hash chain). The worker reads a chunk with
:meth:`Tier.fetch`, writes one with :meth:`Tier.store`, carries out the planner's evictions with
:meth:`Tier.remove`, and reports :meth:`Tier.stats` (flat ``name -> number``, the names vLLM's
``kvferry:*`` series are built from). Tiers that read many chunks in one go (a peer's NIXL READ)
do it in :meth:`Tier.prefetch`, called once per load before the per-chunk fetches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class LoadRequest:
    """The chunks one load wants from a tier (a peer tier reads them at once)."""

    keys: list[bytes]
    nbytes: list[int]
    peer_id: str | None = None  # the instance the controller named for P2P chunks
    peers: Sequence = ()  # its workers (m.PeerAddr), by TP rank


@runtime_checkable
class Tier(Protocol):
    """One place a chunk can live outside vLLM's cache: cpu, disk, p2p or remote."""

    name: str

    def prefetch(self, req: LoadRequest) -> None:
        """Read `req`'s chunks ahead of the fetches when the tier reads in batches (else nothing)."""

    def fetch(self, key: bytes, tokens: int, nbytes: int) -> torch.Tensor | None:
        """The chunk's bytes, or None on a miss (the caller checks the size and recomputes)."""

    def store(self, key: bytes, data: torch.Tensor, tokens: int) -> None: ...

    def remove(self, key: bytes) -> None: ...

    def take_lost(self) -> set[bytes]:
        """Keys this tier accepted but lost since the last call (a failed write): the index forgets them."""

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...
