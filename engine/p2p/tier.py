"""The P2P tier: chunks another instance's CPU tier lends, read over NIXL (the rest of engine/p2p/ does the work).

Peers are read, never written: a chunk reaches a peer only by that peer storing it itself, or by
the controller's move (which the peer pulls)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvferry.engine.tiers.interface import LoadRequest

if TYPE_CHECKING:
    from kvferry.engine.p2p.service import P2PService


class P2PTier:
    """One load's chunks from one peer, in one lease and one NIXL READ (see :meth:`prefetch`)."""

    name = "p2p"

    def __init__(self, service: P2PService) -> None:
        self.service = service
        self._got: dict[bytes, torch.Tensor] = {}

    def prefetch(self, req: LoadRequest) -> None:
        """Read every chunk of `req` from the peer the controller named; on failure none (recompute)."""
        self._got = {}
        w = self.service
        if not req.keys or w.rank >= len(req.peers):
            return
        got = w.fetch(req.peer_id, req.peers[w.rank], req.keys, req.nbytes)
        if got is not None:
            self._got = dict(zip(req.keys, got, strict=True))

    def fetch(self, key: bytes, tokens: int, nbytes: int) -> torch.Tensor | None:
        return self._got.pop(key, None)

    def store(self, key: bytes, data: torch.Tensor, tokens: int) -> None:
        pass

    def remove(self, key: bytes) -> None:
        pass

    def take_lost(self) -> set[bytes]:
        return set()

    def stats(self) -> dict[str, float]:
        return self.service.stats()

    def close(self) -> None:
        self._got = {}
        self.service.close()
