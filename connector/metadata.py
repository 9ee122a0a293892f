"""What the scheduler side tells the workers each step, and what the workers tell it back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvferry.engine.api import CacheEvict, CacheLoad, CacheStore


@dataclass
class _ToDecoder:
    """A prompt whose KV goes to a decoder: the request, its transfer and the decoder's receiver."""

    req_id: str
    transfer_id: str
    host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]
    token_ids: list[int]


@dataclass
class SaveOp(_ToDecoder):
    """The step that computed the prompt's last token: write what is left, with the notification."""

    block_ids: list[int]
    num_tokens: int
    traceparent: str | None = None  # the prefill leg's (kv_transfer_params): the KV spans go under it


@dataclass
class OpenOp(_ToDecoder):
    """A prompt whose KV goes to a decoder is scheduled for the first time: reserve its pages now."""

    num_tokens: int
    traceparent: str | None = None


@dataclass
class PieceOp:
    """A step of a chunked prefill: after it, the prompt is computed up to `computed_tokens`."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    computed_tokens: int


@dataclass
class LoadOp:
    req_id: str
    transfer_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_tokens: int
    skip_tokens: int
    traceparent: str | None = None  # the decode leg's (kv_transfer_params)


@dataclass
class KVFerryMetadata(KVConnectorMetadata):
    opens: list[OpenOp] = field(default_factory=list)  # prefiller: before the forward
    pieces: list[PieceOp] = field(default_factory=list)  # prefiller: after it
    saves: list[SaveOp] = field(default_factory=list)  # prefiller: after it, a prompt's last piece
    cancels: list[str] = field(default_factory=list)  # prefiller, before the forward: requests ended unfinished
    loads: list[LoadOp] = field(default_factory=list)
    cache_loads: list[CacheLoad] = field(default_factory=list)  # offload tiers -> blocks, before the forward
    cache_saves: list[CacheStore | CacheEvict] = field(default_factory=list)  # after it, in order
    pins: list[str] = field(default_factory=list)  # decoder: transfers whose requests the scheduler took
    unpins: list[str] = field(default_factory=list)  # decoder: transfers whose requests ended
    idle: bool = False  # nothing scheduled this step


@dataclass
class KVFerryWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: chunks a tier turned out not to hold (missing, corrupt, unwritten)."""

    lost: dict[str, set[bytes]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVFerryWorkerMeta):
            for tier, keys in other.lost.items():
                self.lost.setdefault(tier, set()).update(keys)
        return self
