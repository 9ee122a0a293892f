"""What the vLLM connector uses of kvferry: one import surface, so the connector sees only `engine`.

The engine's internal modules may move; this list is the contract the connector is written against.
"""

from kvferry.engine.chunking import loaded_blocks
from kvferry.engine.offload.copier import OffloadCopier
from kvferry.engine.offload.ops import (
    PLAIN,
    CacheEvict,
    CacheLoad,
    CacheStore,
    PromptIdentity,
    layout_digest,
    offload_salt,
)
from kvferry.engine.offload.planner import OffloadPlanner
from kvferry.engine.offload.tier_events import ChunkStored, TierEvent
from kvferry.engine.p2p.notices import notice_addr
from kvferry.engine.p2p.service import P2PService
from kvferry.engine.pd.consumer import PDConsumer
from kvferry.engine.pd.producer import PDProducer
from kvferry.engine.pd.shared import fingerprint
from kvferry.engine.pd.slicing import Slice, feeds
from kvferry.engine.remote.backend import RemoteError
from kvferry.kernels.layout import KVLayout, detect_layout
from kvferry.kernels.paged_copy import PagedKV
from kvferry.sender.addr import ReceiverAddr

__all__ = [
    "PLAIN", "CacheEvict", "CacheLoad", "CacheStore", "ChunkStored", "TierEvent", "OffloadPlanner", "OffloadCopier",
    "P2PService",
    "KVLayout", "PDConsumer", "PDProducer", "PagedKV", "ReceiverAddr", "RemoteError", "Slice", "detect_layout",
    "feeds", "fingerprint", "layout_digest", "loaded_blocks", "notice_addr", "offload_salt",
    "PromptIdentity",
]
