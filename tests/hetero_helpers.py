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

from kvferry.common.config import load_config
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.engine.api import PagedKV, PDConsumer, PDProducer, ReceiverAddr, fingerprint
from kvferry.engine.pd.slicing import Slice, feeds
from kvferry.kernels.head_map import rank_heads
from kvferry.kernels.layout import KVLayout
from kvferry.sender.kv_sender import KVSender, SenderConfig
from tests.kv_caches import make_caches
from tests.polling import until

BS, CHUNK, LAYERS, HEAD = 16, 32, 2, 64
NBLOCKS = 24
DTYPE = torch.bfloat16


def rank_caches(truth: list[torch.Tensor], layout: str, total: int, tp: int, rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s cache: its heads of every layer of `truth` (a copy, in the same layout)."""
    heads = rank_heads(total, tp, rank)
    dim = {"cpu": 1, "flash_nhd": 3, "flash_hnd": 2}[layout]
    return [t.index_select(dim, torch.tensor(heads)).contiguous() for t in truth]


def kv_rows(caches: list[torch.Tensor], layout: str, heads: int, blocks: list[int], n: int, bs: int = BS
            ) -> dict[tuple[int, int, int, int], bytes]:
    """(K or V, layer, token, local head) -> its head vector's bytes, for the first `n` tokens of a
    cache of block size `bs`."""
    lay = KVLayout(layout, caches[0].shape[{"cpu": 0}.get(layout, 1)], bs, heads, HEAD, DTYPE)
    out = {}
    for layer, t in enumerate(caches):
        for kv, view in enumerate(lay.kv_views(t)):
            for i in range(n):
                for h in range(heads):
                    row = view[blocks[i // bs], i % bs, h]
                    out[kv, layer, i, h] = bytes(row.contiguous().view(torch.uint8).numpy())
    return out


@dataclass
class Hetero:
    """A prompt's way from `src_tp` prefiller ranks to `dst_tp` decoder ranks of a model with `total`
    KV heads, all ranks of one side sharing one block table (as vLLM's TP ranks do), each side's
    paged cache in its own block size (`bs_src`, `bs_dst`)."""

    producers: list[PDProducer]
    consumers: list[PDConsumer]
    addrs: list[ReceiverAddr]
    truth: list[torch.Tensor]
    dsts: list[list[torch.Tensor]]
    layout: str
    total: int
    src_tp: int
    dst_tp: int
    bs_src: int = BS
    bs_dst: int = BS

    def feeds(self, rank: int) -> list[tuple[ReceiverAddr, Slice | None]]:
        """Where prefiller rank `rank` writes (what the connector's worker side computes)."""
        return [(self.addrs[d], s) for d, s in feeds(self.producers[rank].fp, rank, self.dst_tp)]

    def landed(self, src_blocks: list[int], dst_blocks: list[int], n: int) -> int:
        """Assert every decoder rank's cache holds exactly its heads of the truth for `n` tokens;
        returns how many head vectors were checked."""
        want = kv_rows(self.truth, self.layout, self.total, src_blocks, n, self.bs_src)
        checked = 0
        for d, caches in enumerate(self.dsts):
            heads = rank_heads(self.total, self.dst_tp, d)
            got = kv_rows(caches, self.layout, len(heads), dst_blocks, n, self.bs_dst)
            for (kv, layer, i, h), row in got.items():
                assert row == want[kv, layer, i, heads[h]], \
                    f"decoder rank {d}: {'KV'[kv]} of layer {layer}, token {i}, head {heads[h]} differs"
                checked += 1
        return checked

    def all_free(self) -> bool:
        return all(p.staging.fully_free() for p in self.producers) and \
            all(c.buffer.fully_free() for c in self.consumers)


def blocks(seed: int, n: int) -> list[int]:
    return torch.randperm(NBLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def run_prompt(h: Hetero, tid: str, n: int, pieces: bool = True, early: bool = True
               ) -> tuple[list[int], list[int]]:
    """One prompt of `n` tokens through every prefiller rank (early grant, a piece while it
    computes, the last write with the notification) into every decoder rank; returns the block
    tables (prefiller side, decoder side). `early=False`: no early grant (the staging pages were
    short when the prompt began), the pages are reserved and written when it ends."""
    tokens = list(range(1000, 1000 + n))
    src_blocks, dst_blocks = blocks(11, -(-n // h.bs_src)), blocks(12, -(-n // h.bs_dst))
    for d, c in enumerate(h.consumers):
        c.expect(f"req{d}", tid, tokens, dst_blocks, n - 1)  # the decoder computes the last token
    for r, p in enumerate(h.producers):
        for addr, s in h.feeds(r):
            if early:
                p.open(tid, addr, tokens, n, s)
    if pieces and early:
        for r, p in enumerate(h.producers):
            want = len(h.feeds(r))
            until(lambda p=p, want=want: p.progress(tid, src_blocks[:4], 64) or p.counters.pieces >= want, 60,
                  f"prefiller rank {r}'s first piece")
    results = [p.submit(tid, addr, tokens, src_blocks, n, s)
               for r, p in enumerate(h.producers) for addr, s in h.feeds(r)]
    for f in results:
        assert f.result(60).sent_chunks == -(-n // CHUNK)
    for d, c in enumerate(h.consumers):
        assert until(lambda c=c: c.poll(0.05)[0], 60, f"decoder rank {d} loaded") == {f"req{d}"}
    return src_blocks, dst_blocks


@contextlib.contextmanager
def hetero(src_tp: int, dst_tp: int, total: int, layout: str = "cpu", lease: float = 60.0,
           ready: float = 60.0, bs_src: int = BS, bs_dst: int = BS) -> Iterator[Hetero]:
    """`bs_src`, `bs_dst`: the two sides' block sizes (each cache has NBLOCKS blocks)."""
    ports = [(free_port(), free_port()) for _ in range(dst_tp)]
    cfg = load_config({"chunk_size": CHUNK, "pd_buffer_size": 64 * 16384, "pd_peer_host": "127.0.0.1",
                       "pd_peer_init_port": [i for i, _ in ports], "pd_peer_alloc_port": [a for _, a in ports],
                       "pd_lease_seconds": lease, "pd_kv_ready_timeout": ready})
    truth = make_caches(layout, LAYERS, NBLOCKS, bs_src, total, HEAD, DTYPE, seed=1)
    dsts = [rank_caches(make_caches(layout, LAYERS, NBLOCKS, bs_dst, total, HEAD, DTYPE, seed=2), layout, total,
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
                     layout, total, src_tp, dst_tp, bs_src, bs_dst)
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
