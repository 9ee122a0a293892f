"""KVFerryConnector: vLLM's KVConnectorBase_V1 on top of kvferry's pd tier.

Loaded by vLLM with ``--kv-transfer-config '{"kv_connector": "KVFerryConnector",
"kv_connector_module_path": "kvferry.connector", "kv_role": "kv_producer" | "kv_consumer"}'`` and
configured by the seed's YAML keys (``KVFERRY_CONFIG_FILE`` / ``LMCACHE_CONFIG_FILE``, env, or
``kv_connector_extra_config``).

Prefiller (kv_producer): in the step that computes a prompt's last token the scheduler side
emits a save for it; the worker gathers the prompt's chunks into staging pages in
``wait_for_save`` (so vLLM may free the blocks as usual) and the send runs in the background.
``request_finished`` returns ``first_tok`` and ``transfer_id`` in ``kv_transfer_params``.

Decoder (kv_consumer): a request with ``kv_transfer_params.transfer_id`` reports its prompt
minus the last token as externally matched, asynchronously: vLLM parks it in
WAITING_FOR_REMOTE_KVS and keeps serving others. Each step the worker loads the transfers that
arrived and reports them finished; one that does not arrive within ``pd_kv_ready_timeout``, or
that cannot be loaded, is reported through ``get_block_ids_with_load_errors`` and vLLM
recomputes it (``pd_kv_timeout_action: recompute``) or fails it (``fail``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvferry.common.config import ConfigError, KVFerryConfig, load_config
from kvferry.common.log import get_logger
from kvferry.connector.params import ParamsError, decode_transfer_id, prefill_spec
from kvferry.engine.pd import PDConsumer, PDProducer, fingerprint
from kvferry.kernels.layout import detect_layout
from kvferry.kernels.paged_copy import PagedKV
from kvferry.sender.client import ReceiverAddr

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = get_logger(__name__)

IDLE_WAIT_S = 0.003  # an engine step with nothing to run waits this long for an arrival


@dataclass
class SaveOp:
    req_id: str
    transfer_id: str
    host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]
    token_ids: list[int]
    block_ids: list[int]
    num_tokens: int


@dataclass
class LoadOp:
    req_id: str
    transfer_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_tokens: int
    skip_tokens: int


@dataclass
class KVFerryMetadata(KVConnectorMetadata):
    saves: list[SaveOp] = field(default_factory=list)
    loads: list[LoadOp] = field(default_factory=list)
    idle: bool = False  # nothing scheduled this step


def request_amx() -> bool:
    """Ask Linux for AMX tile permission (a no-op without AMX). vLLM's bf16 CPU attention uses
    AMX without asking; a decoder whose first step loads remote KV would die of SIGILL."""
    try:
        return bool(torch.cpu._init_amx())
    except (AttributeError, RuntimeError) as e:  # old torch, or a kernel without AMX support
        logger.debug("AMX permission not requested: %s", e)
        return False


def connector_config(vllm_config: VllmConfig) -> tuple[KVFerryConfig, str]:
    """kvferry's config and vLLM's kv_role, checked against each other."""
    ktc = vllm_config.kv_transfer_config
    role = ktc.kv_role
    cfg = load_config(ktc.kv_connector_extra_config or {})
    want = {"kv_producer": "sender", "kv_consumer": "receiver"}.get(role or "")
    if want is None:
        raise ConfigError(f"kv_role {role!r}: KVFerryConnector does prefill/decode disaggregation with "
                          "kv_role kv_producer (prefiller) or kv_consumer (decoder)")
    if not cfg.enable_pd:
        raise ConfigError(f"kv_role {role} needs enable_pd: true and pd_role: {want} in the kvferry config "
                          "(KVFERRY_CONFIG_FILE / LMCACHE_CONFIG_FILE or kv_connector_extra_config)")
    if cfg.pd_role != want:
        raise ConfigError(f"kv_role {role} does not match pd_role {cfg.pd_role!r}: set pd_role: {want}")
    return cfg, role


class KVFerryConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg, self.kv_role = connector_config(vllm_config)
        self.producer_side = self.kv_role == "kv_producer"
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(self)
            self._worker = None
            # vLLM reads this right after building the scheduler's connector.
            self._kv_transfer_config.kv_load_failure_policy = self.cfg.pd_kv_timeout_action
        else:
            self._sched = None
            self._worker = _Worker(self)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.finished(request)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_loads(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.saves(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        return self._worker.results(finished_req_ids, isinstance(meta, KVFerryMetadata) and meta.idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


class _Scheduler:
    """Scheduler-process half: decides what each step's workers save or load."""

    def __init__(self, c: KVFerryConnector) -> None:
        self.c = c
        self._prefills: dict[str, tuple[Request, Any]] = {}  # producer: waiting for their last prompt token
        self._errors: dict[str, str] = {}  # producer: requests whose params were unusable
        self._transfer_ids: dict[str, str] = {}
        self._external: dict[str, int] = {}  # consumer: req -> local tokens when matched
        self._tried: set[str] = set()  # consumer: a load was planned (a retry after failure recomputes)
        self._loads: list[LoadOp] = []

    def matched(self, request: Request, num_computed: int) -> tuple[int, bool]:
        if self.c.producer_side or request.request_id in self._tried:
            return 0, False
        try:
            tid = decode_transfer_id(request.kv_transfer_params)
        except ParamsError as e:
            logger.error("request %s: %s; computing its prompt locally", request.request_id, e)
            self._tried.add(request.request_id)
            return 0, False
        if tid is None:
            return 0, False
        count = request.num_prompt_tokens - 1 - num_computed
        if count <= 0:
            return 0, False
        self._external[request.request_id] = num_computed
        return count, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        rid = request.request_id
        if self.c.producer_side:
            if rid in self._prefills or rid in self._errors:
                return
            try:
                spec = prefill_spec(request.kv_transfer_params)
            except ParamsError as e:
                logger.error("request %s: %s; its KV is not sent", rid, e)
                self._errors[rid] = str(e)
                return
            if spec is not None:
                self._prefills[rid] = (request, spec)
                self._transfer_ids[rid] = spec.transfer_id
            return
        local = self._external.pop(rid, None)
        if local is None or num_external <= 0:
            return
        self._tried.add(rid)
        tid = decode_transfer_id(request.kv_transfer_params)
        # The full prompt: the transfer may cover one token more than is loaded (see PDConsumer).
        self._loads.append(LoadOp(rid, tid, list(request.prompt_token_ids), list(blocks.get_block_ids()[0]),
                                  local + num_external, local))

    def build(self, so: SchedulerOutput) -> KVFerryMetadata:
        meta = KVFerryMetadata(idle=so.total_num_scheduled_tokens == 0)
        meta.loads, self._loads = self._loads, []
        for rid, n in so.num_scheduled_tokens.items():
            entry = self._prefills.get(rid)
            if entry is None:
                continue
            req, spec = entry
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # chunked prefill: not the last piece yet
            del self._prefills[rid]
            blocks = self.c._kv_cache_manager.get_block_ids(rid)[0]
            meta.saves.append(SaveOp(rid, spec.transfer_id, spec.host, spec.init_ports, spec.alloc_ports,
                                     list(req.prompt_token_ids), list(blocks), req.num_prompt_tokens))
        return meta

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._tried.discard(rid)
        self._external.pop(rid, None)
        if not self.c.producer_side:
            return False, None
        self._prefills.pop(rid, None)
        err = self._errors.pop(rid, None)
        tid = self._transfer_ids.pop(rid, None)
        if err is not None:
            return False, {"error": err}
        if tid is None:
            return False, None
        out: dict[str, Any] = {"transfer_id": tid, "num_tokens": request.num_prompt_tokens}
        if request.output_token_ids:
            out["first_tok"] = request.output_token_ids[0]
        # The staging copy was made in the step that finished the prompt: vLLM may free the blocks.
        return False, out


class _Worker:
    """Worker-process half: the pd tier for this TP rank."""

    def __init__(self, c: KVFerryConnector) -> None:
        self.c = c
        self.vc = c._vllm_config
        if not c.producer_side:
            request_amx()
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.producer: PDProducer | None = None
        self.consumer: PDConsumer | None = None
        self._load_blocks: dict[str, list[int]] = {}  # req -> blocks it loads into (reported on failure)
        self._errors: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mc, pc = self.vc.model_config, self.vc.parallel_config
        tensors = list(kv_caches.values())
        if not tensors:
            raise RuntimeError("vLLM registered no KV cache tensors")
        layout = detect_layout(tensors[0], self.vc.cache_config.block_size, mc.get_num_kv_heads(pc),
                               mc.get_head_size())
        kv = PagedKV(tensors, layout)
        model = os.path.basename(str(mc.model).rstrip("/"))
        fp = fingerprint(kv, model, self.c.cfg.chunk_size, self.c.cfg.pd_chunk_format, self.tp_size)
        if self.c.producer_side:
            sender_id = f"{socket.gethostname()}-{os.getpid()}-tp{self.tp_rank}"
            self.producer = PDProducer(self.c.cfg, kv, fp, sender_id, self.tp_rank)
        else:
            self.consumer = PDConsumer(self.c.cfg, kv, fp, self.tp_rank)
        logger.info("KVFerryConnector %s ready: %d layers, layout %s, %d-token chunks of %d bytes, tp rank %d/%d",
                    self.c.kv_role, kv.num_layers, fp.kv_layout, fp.chunk_size, fp.page_bytes, self.tp_rank,
                    self.tp_size)

    def start_loads(self, meta: KVConnectorMetadata) -> None:
        if self.consumer is None or not isinstance(meta, KVFerryMetadata):
            return
        for op in meta.loads:
            self._load_blocks[op.req_id] = op.block_ids[op.skip_tokens // self.consumer.kv.layout.block_size:
                                                        -(-op.num_tokens // self.consumer.kv.layout.block_size)]
            self.consumer.expect(op.req_id, op.transfer_id, op.token_ids, op.block_ids, op.num_tokens,
                                 op.skip_tokens)

    def saves(self, meta: KVConnectorMetadata) -> None:
        if self.producer is None or not isinstance(meta, KVFerryMetadata):
            return
        for op in meta.saves:
            if self.tp_rank >= len(op.init_ports):
                logger.error("transfer %s: the decoder lists %d receiver ports, this prefiller has TP rank %d: "
                             "decoder and prefiller need the same tensor-parallel size", op.transfer_id,
                             len(op.init_ports), self.tp_rank)
                continue
            addr = ReceiverAddr(op.host, op.init_ports[self.tp_rank], op.alloc_ports[self.tp_rank])
            try:
                self.producer.submit(op.transfer_id, addr, op.token_ids, op.block_ids, op.num_tokens)
            except (ValueError, RuntimeError) as e:
                logger.error("transfer %s: not sent: %s", op.transfer_id, e)

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

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
