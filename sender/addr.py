"""Where a decoder's receiver listens: what a prefiller dials for one TP rank."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReceiverAddr:
    host: str
    init_port: int
    alloc_port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.init_port}/{self.alloc_port}"
