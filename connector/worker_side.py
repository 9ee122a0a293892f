"""The connector's worker-process half: the pd tier and the offload tiers' data for one TP rank."""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import sys
from typing import TYPE_CHECKING

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
)

from kvferry.common.config import ConfigError
from kvferry.common.errors import KVFerryError
from kvferry.common.live_gauges import LiveGauges, gauge_path
from kvferry.common.log import get_logger
from kvferry.connector.cpu_isa import attention_isa
from kvferry.connector.metadata import KVFerryMetadata, KVFerryWorkerMeta, OpenOp, SaveOp
from kvferry.connector.roles import Roles, engine_id, model_name, salt
from kvferry.engine.api import (
    OffloadCopier,
    P2PService,
    PagedKV,
    PDConsumer,
    PDProducer,
    ReceiverAddr,
    Slice,
    detect_layout,
    feeds,
    fingerprint,
    layout_digest,
    loaded_blocks,
    notice_addr,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)

IDLE_WAIT_S = 0.003  # an engine step with nothing to run waits this long for an arrival


_SYS_ARCH_PRCTL = 158  # x86-64 Linux's syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx() -> bool:
    """Ask Linux for AMX tile permission (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), as torch does
    before its own AMX kernels; False without AMX, on another CPU or OS). vLLM's bf16 CPU
    attention uses AMX without asking; a decoder whose first step loads remote KV would die of
    SIGILL."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError) as e:
        logger.debug("AMX permission not requested: %s", e)
        return False
    if not ok:  # EINVAL or EOPNOTSUPP: no AMX here (a kernel older than 5.16 or a CPU without it)
        logger.debug("AMX permission not granted: %s", os.strerror(ctypes.get_errno()))
    return ok


class WorkerSide:
    def __init__(self, roles: Roles, vllm_config: VllmConfig) -> None:
        self.roles, self.cfg, self.vc = roles, roles.cfg, vllm_config
        # Any role may load KV before its first full prefill (a decoder, or an offload hit after a
        # restart): ask for AMX first.
        request_amx()
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.producer: PDProducer | None = None
        self.consumer: PDConsumer | None = None
        self.offload: OffloadCopier | None = None
        self.live: LiveGauges | None = None
        self._load_blocks: dict[str, list[int]] = {}  # req -> blocks it loads into (reported on failure)
        self._errors: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mc, pc, cfg, roles = self.vc.model_config, self.vc.parallel_config, self.cfg, self.roles
        tensors = list(kv_caches.values())
        if not tensors:
            raise ConfigError("vLLM registered no KV cache tensors: KVFerryConnector needs a model with attention "
                              "layers")
        layout = detect_layout(tensors[0], self.vc.cache_config.block_size, mc.get_num_kv_heads(pc),
                               mc.get_head_size())
        kv = PagedKV(tensors, layout)
        model = model_name(self.vc)
        fmt = cfg.pd_chunk_format if roles.pd else "block"
        isa = attention_isa(layout, self.vc.cache_config.cache_dtype)
        fp = fingerprint(kv, model, cfg.chunk_size, fmt, self.tp_size, mc.get_total_num_kv_heads(), isa=isa)
        if roles.offload:
            ofp = fp if fmt == "block" else fingerprint(kv, model, cfg.chunk_size, "block", self.tp_size, isa=isa)
            digest = layout_digest(msgspec.msgpack.encode(ofp))
            self.offload = OffloadCopier(cfg, kv, self.tp_rank, digest, isa)
            if cfg.enable_p2p and self.offload.cpu is not None:
                self.offload.p2p = P2PService(cfg, self.offload.cpu, self.tp_rank, self.tp_size,
                                             salt(self.vc, cfg, kv.num_layers), ofp,
                                             notice_addr(engine_id(self.vc)))
        if roles.pd and roles.producer_side:
            sender_id = f"{socket.gethostname()}-{os.getpid()}-tp{self.tp_rank}"
            self.producer = PDProducer(cfg, kv, fp, sender_id, self.tp_rank)
        elif roles.pd:
            self.consumer = PDConsumer(cfg, kv, fp, self.tp_rank)
        if roles.pd:
            # vLLM's /metrics (its API server) reads these between engine steps: connector/stats.py.
            self.live = LiveGauges(gauge_path(engine_id(self.vc), self.tp_rank))
            side = self.producer or self.consumer
            assert side is not None  # made just above for either PD role
            side.publish(self.live)
        logger.info("KVFerryConnector %s ready: %d layers, layout %s, %d-token chunks of %d bytes, tp rank %d/%d",
                    roles.kv_role, kv.num_layers, fp.kv_layout, fp.chunk_size, fp.page_bytes, self.tp_rank,
                    self.tp_size)

    def opens(self, meta: KVConnectorMetadata) -> None:
        """Before the step's forward: give back what prompts that ended unfinished held (their
        staging pages are then free for this step's prompts), and ask decoders for the pages of
        prompts it starts computing."""
        if not isinstance(meta, KVFerryMetadata) or self.producer is None:
            return
        for tid in meta.cancels:
            self.producer.cancel(tid)
        for op in meta.opens:
            for addr, share in self._receivers(op):
                self.producer.open(op.transfer_id, addr, op.token_ids, op.num_tokens, share, op.traceparent, op.req_id)

    def start_loads(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, KVFerryMetadata):
            return
        if self.offload is not None:
            for cop in meta.cache_loads:
                self._errors.update(self.offload.load(cop))
        if self.consumer is None:
            return
        for tid in meta.pins:
            self.consumer.pin(tid)
        for tid in meta.unpins:
            self.consumer.unpin(tid)
        for op in meta.loads:
            self._load_blocks[op.req_id] = loaded_blocks(op.block_ids, op.skip_tokens, op.num_tokens,
                                                         self.consumer.kv.layout.block_size)
            self.consumer.expect(op.req_id, op.transfer_id, op.token_ids, op.block_ids, op.num_tokens,
                                 op.skip_tokens, op.traceparent)

    def saves(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, KVFerryMetadata):
            return
        if self.offload is not None:
            self.offload.save(meta.cache_saves)
        if self.producer is None:
            return
        for piece in meta.pieces:
            try:
                self.producer.progress(piece.transfer_id, piece.block_ids, piece.computed_tokens)
            except KVFerryError as e:
                logger.error("transfer %s: a piece not sent (the rest goes with the last one): %s",
                             piece.transfer_id, e)
        for op in meta.saves:
            for addr, share in self._receivers(op):
                try:
                    self.producer.submit(op.transfer_id, addr, op.token_ids, op.block_ids, op.num_tokens, share,
                                         op.traceparent, op.req_id)
                except KVFerryError as e:
                    logger.error("transfer %s: not sent to %s: %s", op.transfer_id, addr, e)

    def _receivers(self, op: OpenOp | SaveOp) -> list[tuple[ReceiverAddr, Slice | None]]:
        """The decoder ranks' receivers this TP rank sends to, each with its slice (engine/pd/slicing.py
        `feeds`): the rank of the same index for the same TP size; for an MLA model every decoder rank
        d with d % tp_size == tp_rank; for K/V heads and another TP size every decoder rank this
        rank holds heads of, writing only those (docs/pd.md, "Different TP")."""
        ports = list(zip(op.init_ports, op.alloc_ports, strict=True))
        if self.producer is None:
            return []
        try:
            ranks = feeds(self.producer.fp, self.tp_rank, len(ports))
        except ValueError as e:  # heads that do not split over the decoder's TP size, or no slicing
            logger.error("transfer %s: the decoder lists %d receiver ports (its TP size), this prefiller has TP "
                         "size %d: %s", op.transfer_id, len(ports), self.tp_size, e)
            return []
        return [(ReceiverAddr(op.host, *ports[d]), share) for d, share in ranks]

    def results(self, finished: set[str], idle: bool) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.consumer is None:  # a prefiller's blocks were freed by vLLM already: nothing to report
            return out
        for rid in finished:
            if self.consumer.cancel(rid):
                self._load_blocks.pop(rid, None)
                out.finished_recving.add(rid)  # vLLM frees an aborted request's blocks on this
        loaded, failed = self.consumer.poll(IDLE_WAIT_S if idle else 0.0)
        for rid in loaded:
            self._load_blocks.pop(rid, None)
        for rid in failed:
            self._errors.update(self._load_blocks.pop(rid, []))
        out.finished_recving |= loaded | failed
        return out

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def worker_meta(self) -> KVFerryWorkerMeta | None:
        lost = self.offload.take_lost() if self.offload is not None else {}
        return KVFerryWorkerMeta(lost) if lost else None

    def stats(self) -> dict[str, float]:
        out = self.offload.stats() if self.offload is not None else {}
        if self.producer is not None:
            out.update(self.producer.stats())
        if self.consumer is not None:
            out.update(self.consumer.stats())
        return out

    def samples(self) -> dict[str, list[float]]:
        """Histogram observations since the last call (connector/stats.py HISTOGRAMS)."""
        side = self.producer or self.consumer
        return side.samples.take() if side is not None else {}

    def unregister(self) -> None:
        """vLLM sleep mode, before the KV cache and the pd_buffer / staging pages (allocated in vLLM's
        memory pool) are unmapped: transfers in flight drained, NIXL registrations dropped. The
        offload tiers' memory is host memory vLLM does not touch."""
        if self.producer is not None:
            self.producer.suspend()
        if self.consumer is not None:
            self.consumer.suspend()

    def restore(self) -> None:
        """After vLLM remapped the memory at the same addresses: registered again."""
        if self.producer is not None:
            self.producer.resume()
        if self.consumer is not None:
            self.consumer.resume()

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        if self.live is not None:
            self.live.close()
