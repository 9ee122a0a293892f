"""Prefillers and decoders of different TP sizes for a K/V-head (GQA) model, without vLLM: one
PDProducer per prefiller rank and one PDConsumer per decoder rank, in this process, over real
NIXL (UCX) and ZMQ. Each rank's paged cache holds exactly its heads (vLLM's split,
kernels/head_map.py `rank_heads`) of one "truth" cache of all heads, so a test can check that every
(prefiller rank, decoder rank, layer, token, head) landed where the decoder's cache expects it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import torch

from kvferry.common import messages as m
from kvferry.common.config import load_config
from kvferry.common.netutil import free_port
from kvferry.engine.api import PagedKV, PDConsumer, PDProducer, ReceiverAddr, fingerprint
from kvferry.engine.pd.slicing import Slice, feeds
from kvferry.kernels.head_map import rank_heads
from kvferry.kernels.layout import KVLayout
from kvferry.sender.kv_sender import KVSender, SenderConfig
from tests.kv_caches import make_caches

BS, CHUNK, LAYERS, HEAD = 16, 32, 2, 64
NBLOCKS = 24
DTYPE = torch.bfloat16


def rank_caches(truth: list[torch.Tensor], layout: str, total: int, tp: int, rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s cache: its heads of every layer of `truth` (a copy, in the same layout)."""
    heads = rank_heads(total, tp, rank)
    dim = {"cpu": 1, "flash_nhd": 3, "flash_hnd": 2}[layout]
    return [t.index_select(dim, torch.tensor(heads)).contiguous() for t in truth]


def kv_rows(caches: list[torch.Tensor], layout: str, heads: int, blocks: list[int], n: int
            ) -> dict[tuple[int, int, int, int], bytes]:
    """(K or V, layer, token, local head) -> its head vector's bytes, for the first `n` tokens."""
    lay = KVLayout(layout, caches[0].shape[{"cpu": 0}.get(layout, 1)], BS, heads, HEAD, DTYPE)
    out = {}
    for layer, t in enumerate(caches):
        for kv, view in enumerate(lay.kv_views(t)):
            for i in range(n):
                for h in range(heads):
                    row = view[blocks[i // BS], i % BS, h]
                    out[kv, layer, i, h] = bytes(row.contiguous().view(torch.uint8).numpy())
    return out


@dataclass
class Hetero:
    """A prompt's way from `src_tp` prefiller ranks to `dst_tp` decoder ranks of a model with `total`
    KV heads, all ranks of one side sharing one block table (as vLLM's TP ranks do)."""

    producers: list[PDProducer]
    consumers: list[PDConsumer]
    addrs: list[ReceiverAddr]
    truth: list[torch.Tensor]
    dsts: list[list[torch.Tensor]]
    layout: str
    total: int
    src_tp: int
    dst_tp: int

    def feeds(self, rank: int) -> list[tuple[ReceiverAddr, Slice | None]]:
        """Where prefiller rank `rank` writes (what the connector's worker side computes)."""
        return [(self.addrs[d], s) for d, s in feeds(self.producers[rank].fp, rank, self.dst_tp)]

    def landed(self, src_blocks: list[int], dst_blocks: list[int], n: int) -> int:
        """Assert every decoder rank's cache holds exactly its heads of the truth for `n` tokens;
        returns how many head vectors were checked."""
        want = kv_rows(self.truth, self.layout, self.total, src_blocks, n)
        checked = 0
        for d, caches in enumerate(self.dsts):
            heads = rank_heads(self.total, self.dst_tp, d)
            got = kv_rows(caches, self.layout, len(heads), dst_blocks, n)
            for (kv, layer, i, h), row in got.items():
                assert row == want[kv, layer, i, heads[h]], \
                    f"decoder rank {d}: {'KV'[kv]} of layer {layer}, token {i}, head {heads[h]} differs"
                checked += 1
        return checked

    def all_free(self) -> bool:
        return all(p.staging.fully_free() for p in self.producers) and \
            all(c.buffer.fully_free() for c in self.consumers)


@contextlib.contextmanager
def hetero(src_tp: int, dst_tp: int, total: int, layout: str = "cpu", lease: float = 2.0,
           ready: float = 5.0) -> Iterator[Hetero]:
    ports = [(free_port(), free_port()) for _ in range(dst_tp)]
    cfg = load_config({"chunk_size": CHUNK, "pd_buffer_size": 64 * 16384, "pd_peer_host": "127.0.0.1",
                       "pd_peer_init_port": [i for i, _ in ports], "pd_peer_alloc_port": [a for _, a in ports],
                       "pd_lease_seconds": lease, "pd_kv_ready_timeout": ready})
    truth = make_caches(layout, LAYERS, NBLOCKS, BS, total, HEAD, DTYPE, seed=1)
    dsts = [rank_caches(make_caches(layout, LAYERS, NBLOCKS, BS, total, HEAD, DTYPE, seed=2), layout, total,
                        dst_tp, d) for d in range(dst_tp)]
    producers: list[PDProducer] = []
    consumers: list[PDConsumer] = []
    try:
        for d in range(dst_tp):
            kv = PagedKV(dsts[d], layout)
            consumers.append(PDConsumer(cfg, kv, fingerprint(kv, "hetero", CHUNK, "block", dst_tp, total), d))
        for r in range(src_tp):
            kv = PagedKV(rank_caches(truth, layout, total, src_tp, r), layout)
            producers.append(PDProducer(cfg, kv, fingerprint(kv, "hetero", CHUNK, "block", src_tp, total),
                                        f"hetero-p{r}", r))
        yield Hetero(producers, consumers, [ReceiverAddr("127.0.0.1", i, a) for i, a in ports], truth, dsts,
                     layout, total, src_tp, dst_tp)
    finally:
        for p in producers:
            p.close()
        for c in consumers:
            c.close()


def dying_writer_main(conn, addr: tuple, fp: bytes, transfer_id: str, chunks: int, num_tokens: int,
                      share: tuple[int, int]) -> None:
    """A prefiller rank in its own process: reserves its share of `transfer_id`'s pages on the
    receiver at `addr`, says so, and dies without a word when told (its worker crashed)."""
    sender = KVSender(SenderConfig(f"dying-p{share[1]}", tp_rank=share[1]), msgspec.msgpack.decode(
        fp, type=m.LayoutFingerprint))
    keys = [os.urandom(16) for _ in range(chunks)]
    sender.reserve(transfer_id, ReceiverAddr(*addr), keys, num_tokens, share=share).result(20)
    conn.send("reserved")
    conn.recv()
    os._exit(1)
