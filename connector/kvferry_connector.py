"""KVFerryConnector: vLLM's KVConnectorBase_V1 on top of kvferry's KV engine.

Loaded by vLLM with ``--kv-transfer-config '{"kv_connector": "KVFerryConnector",
"kv_connector_module_path": "kvferry.connector", "kv_role": "kv_both" | "kv_producer" |
"kv_consumer"}'`` and configured by the seed's YAML keys (``KVFERRY_CONFIG_FILE`` /
``LMCACHE_CONFIG_FILE``, env, or ``kv_connector_extra_config``).

Offload (kv_both, and prefillers): prompts' chunks are stored to the local CPU and disk tiers
and a later prompt with the same prefix loads them instead of computing them (engine/offload.py);
the scheduler side decides, the worker side copies, synchronously before the forward pass.

Prefiller (kv_producer): in the step that computes a prompt's last token the scheduler side
emits a save for it; the worker gathers the prompt's chunks into staging pages in
``wait_for_save`` (so vLLM may free the blocks as usual) and the send runs in the background.
``request_finished`` returns ``first_tok`` and ``transfer_id`` in ``kv_transfer_params``.

Decoder (kv_consumer): as soon as vLLM's scheduler takes a request with
``kv_transfer_params.transfer_id`` (``on_new_request``), the next step tells the workers to pin
that transfer: its KV, once arrived, waits up to ``pd_queue_seconds`` for the request to leave the
queue instead of expiring with the lease; the request's end unpins it. When scheduled, the
request reports its prompt minus the last token as externally matched, asynchronously: vLLM
parks it in WAITING_FOR_REMOTE_KVS and keeps serving others. Each step the worker loads the transfers that
arrived and reports them finished; one that does not arrive within ``pd_kv_ready_timeout``, or
that cannot be loaded, is reported through ``get_block_ids_with_load_errors`` and vLLM
recomputes it (``pd_kv_timeout_action: recompute``) or fails it (``fail``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvferry.common.config import ConfigError, KVFerryConfig, load_config
from kvferry.common.log import get_logger
from kvferry.connector.params import ParamsError, decode_transfer_id, prefill_spec
from kvferry.connector.stats import KVFerryPromMetrics, KVFerryStats, deltas
from kvferry.engine.api import (
    CacheEvict,
    CacheLoad,
    CacheStore,
    OffloadPlanner,
    OffloadWorker,
    P2PWorker,
    PagedKV,
    PDConsumer,
    PDProducer,
    ReceiverAddr,
    RemoteError,
    detect_layout,
    fingerprint,
    layout_digest,
    loaded_blocks,
    notice_addr,
    offload_salt,
)

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


# vLLM has no member for a shared remote store; EXTERNAL_UNSPECIFIED is its documented fallback.
_HIT_SOURCES = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "p2p": CacheHitSource.P2P,
                "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}


def request_amx() -> bool:
    """Ask Linux for AMX tile permission (a no-op without AMX). vLLM's bf16 CPU attention uses
    AMX without asking; a decoder whose first step loads remote KV would die of SIGILL."""
    try:
        return bool(torch.cpu._init_amx())
    except (AttributeError, RuntimeError) as e:  # old torch, or a kernel without AMX support
        logger.debug("AMX permission not requested: %s", e)
        return False


def offload_wanted(cfg: KVFerryConfig, kv_role: str) -> bool:
    """Offload tiers serve kv_both instances and prefillers (a repeated prompt is not recomputed
    there either); a decoder's KV comes from its prefiller."""
    tiers = (cfg.local_cpu and cfg.max_local_cpu_size > 0) or bool(cfg.local_disk) or bool(cfg.remote_url)
    return tiers and kv_role in ("kv_both", "kv_producer")


def connector_config(vllm_config: VllmConfig) -> tuple[KVFerryConfig, str]:
    """kvferry's config and vLLM's kv_role, checked against each other."""
    ktc = vllm_config.kv_transfer_config
    role = ktc.kv_role
    cfg = load_config(ktc.kv_connector_extra_config or {})
    if role == "kv_both":
        if cfg.enable_pd:
            raise ConfigError("kv_role kv_both offloads and shares KV; enable_pd is for a prefiller (kv_role "
                              "kv_producer) or a decoder (kv_consumer): set enable_pd: false or change kv_role")
        if not offload_wanted(cfg, role):
            raise ConfigError("kv_role kv_both has no tier to use: set local_cpu: true with max_local_cpu_size "
                              "> 0, local_disk and max_local_disk_size, or remote_url")
        return cfg, role
    want = {"kv_producer": "sender", "kv_consumer": "receiver"}.get(role or "")
    if want is None:
        raise ConfigError(f"kv_role {role!r}: KVFerryConnector takes kv_role kv_both (offload), kv_producer "
                          "(prefiller) or kv_consumer (decoder)")
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
        self.producer_side = self.kv_role in ("kv_producer", "kv_both")  # computes prompts itself
        self.pd = self.cfg.enable_pd
        self.offload = offload_wanted(self.cfg, self.kv_role)
        self._last_stats: dict[str, float] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(self)
            self._worker = None
            # vLLM reads this right after building the scheduler's connector. A failed load from an
            # offload tier is always recomputed; a decoder follows pd_kv_timeout_action.
            self._kv_transfer_config.kv_load_failure_policy = (
                "recompute" if self.producer_side else self.cfg.pd_kv_timeout_action)
        else:
            self._sched = None
            self._worker = _Worker(self)

    # ---- scheduler side ----
    def on_new_request(self, request: Request) -> None:
        self._sched.on_new(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.finished(request)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        got = self._sched.hit_sources(request.request_id) if num_external_tokens else {}
        return got or super().get_external_cache_hit_sources(request, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVFerryWorkerMeta) and self._sched.offload is not None:
            self._sched.offload.forget(meta.lost)

    # ---- both sides ----
    def get_kv_connector_stats(self) -> KVFerryStats | None:
        side = self._sched if self._sched is not None else self._worker
        now = side.stats()
        if not now:
            return None
        return KVFerryStats(data=deltas(now, self._last_stats))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFerryStats:
        return KVFerryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVFerryPromMetrics:
        return KVFerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_loads(self._get_connector_metadata())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta()

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
        if self._sched is not None and self._sched.offload is not None:
            self._sched.offload.close()


class _Scheduler:
    """Scheduler-process half: decides what each step's workers save or load."""

    def __init__(self, c: KVFerryConnector) -> None:
        self.c = c
        self.offload = _planner(c) if c.offload else None
        self._computing: dict[str, Request] = {}  # offload: admitted, prompt not complete yet
        self._prefills: dict[str, tuple[Request, Any]] = {}  # producer: waiting for their last prompt token
        self._errors: dict[str, str] = {}  # producer: requests whose params were unusable
        self._transfer_ids: dict[str, str] = {}
        self._external: dict[str, int] = {}  # consumer: req -> local tokens when matched
        self._tried: set[str] = set()  # consumer: a load was planned (a retry after failure recomputes)
        self._loads: list[LoadOp] = []
        self._pinned: dict[str, str] = {}  # consumer: req -> transfer id pinned for it
        self._pins: list[str] = []  # consumer: to tell the workers in the next step
        self._unpins: list[str] = []

    def on_new(self, request: Request) -> None:
        """A decoder's request is in vLLM's queue now: its KV must wait for it (see the module docstring)."""
        if self.c.producer_side or not self.c.pd:
            return
        try:
            tid = decode_transfer_id(request.kv_transfer_params)
        except ParamsError:
            return  # matched() logs it and computes the prompt locally
        if tid is not None:
            self._pinned[request.request_id] = tid
            self._pins.append(tid)

    def matched(self, request: Request, num_computed: int) -> tuple[int, bool]:
        if self.c.producer_side:
            if self.offload is None:
                return 0, False
            return self.offload.match(request.request_id, request.prompt_token_ids, num_computed), False
        if request.request_id in self._tried:
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
        if self.offload is not None:
            block_ids = blocks.get_block_ids()[0]
            self.offload.after_alloc(rid, request.prompt_token_ids, block_ids, num_external)
            self._computing[rid] = request
        if self.c.producer_side:
            if not self.c.pd or rid in self._prefills or rid in self._errors:
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
        meta.pins, self._pins = self._pins, []
        meta.unpins, self._unpins = self._unpins, []
        if self.offload is not None:
            for rid, n in so.num_scheduled_tokens.items():
                req = self._computing.get(rid)
                if req is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                    continue  # not admitted through us, or chunked prefill not at its last piece
                del self._computing[rid]
                self.offload.store(rid, req.prompt_token_ids, self.c._kv_cache_manager.get_block_ids(rid)[0])
            meta.cache_loads, meta.cache_saves = self.offload.take()
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

    def hit_sources(self, req_id: str) -> dict[CacheHitSource, int]:
        if self.offload is None:
            return {}
        got = self.offload.hit_sources(req_id)
        return {_HIT_SOURCES[t]: n for t, n in got.items() if t in _HIT_SOURCES}

    def stats(self) -> dict[str, float]:
        return self.offload.stats() if self.offload is not None else {}

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._tried.discard(rid)
        self._external.pop(rid, None)
        tid = self._pinned.pop(rid, None)
        if tid is not None:
            self._unpins.append(tid)
        self._computing.pop(rid, None)
        if self.offload is not None:
            self.offload.finished(rid)
        if not (self.c.producer_side and self.c.pd):
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


def _planner(c: KVFerryConnector) -> OffloadPlanner:
    """The scheduler's offload planner, sized from vLLM's KV cache config."""
    kcc = c._kv_cache_config
    if kcc is None or not kcc.kv_cache_groups:
        raise ConfigError("KVFerryConnector offload needs vLLM's KV cache config (vLLM >= 0.11)")
    if len(kcc.kv_cache_groups) != 1:
        raise ConfigError(f"this model has {len(kcc.kv_cache_groups)} KV cache groups; kvferry's offload tiers "
                          "handle one: start vLLM with --disable-hybrid-kv-cache-manager")
    group = kcc.kv_cache_groups[0]
    vc = c._vllm_config
    block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    try:
        return OffloadPlanner(c.cfg, _salt(vc, c.cfg, len(group.layer_names)), vc.cache_config.block_size,
                              block_bytes, notice_addr(vc.kv_transfer_config.engine_id) if c.cfg.enable_p2p else None)
    except (ValueError, RemoteError) as e:
        raise ConfigError(str(e)) from None


def _salt(vc: VllmConfig, cfg: KVFerryConfig, num_layers: int) -> bytes:
    """The offload keys' salt; the scheduler and the workers (which register it with the
    controller) compute the same one."""
    mc, pc = vc.model_config, vc.parallel_config
    return offload_salt(os.path.basename(str(mc.model).rstrip("/")), str(mc.dtype).removeprefix("torch."),
                        num_layers, mc.get_num_kv_heads(pc), mc.get_head_size(), vc.cache_config.block_size,
                        cfg.chunk_size, pc.tensor_parallel_size)


class _Worker:
    """Worker-process half: the pd tier and the offload tiers' data for this TP rank."""

    def __init__(self, c: KVFerryConnector) -> None:
        self.c = c
        self.vc = c._vllm_config
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
        self.offload: OffloadWorker | None = None
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
        fmt = self.c.cfg.pd_chunk_format if self.c.pd else "block"
        fp = fingerprint(kv, model, self.c.cfg.chunk_size, fmt, self.tp_size)
        if self.c.offload:
            ofp = fp if fmt == "block" else fingerprint(kv, model, self.c.cfg.chunk_size, "block", self.tp_size)
            digest = layout_digest(msgspec.msgpack.encode(ofp))
            self.offload = OffloadWorker(self.c.cfg, kv, self.tp_rank, digest)
            if self.c.cfg.enable_p2p and self.offload.cpu is not None:
                self.offload.p2p = P2PWorker(self.c.cfg, self.offload.cpu, self.tp_rank, self.tp_size,
                                             _salt(self.vc, self.c.cfg, kv.num_layers), ofp,
                                             notice_addr(self.vc.kv_transfer_config.engine_id))
        if self.c.pd and self.c.producer_side:
            sender_id = f"{socket.gethostname()}-{os.getpid()}-tp{self.tp_rank}"
            self.producer = PDProducer(self.c.cfg, kv, fp, sender_id, self.tp_rank)
        elif self.c.pd:
            self.consumer = PDConsumer(self.c.cfg, kv, fp, self.tp_rank)
        logger.info("KVFerryConnector %s ready: %d layers, layout %s, %d-token chunks of %d bytes, tp rank %d/%d",
                    self.c.kv_role, kv.num_layers, fp.kv_layout, fp.chunk_size, fp.page_bytes, self.tp_rank,
                    self.tp_size)

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
                                 op.skip_tokens)

    def saves(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, KVFerryMetadata):
            return
        if self.offload is not None:
            self.offload.save(meta.cache_saves)
        if self.producer is None:
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

    def worker_meta(self) -> KVFerryWorkerMeta | None:
        lost = self.offload.take_lost() if self.offload is not None else {}
        return KVFerryWorkerMeta(lost) if lost else None

    def stats(self) -> dict[str, float]:
        out = self.offload.stats() if self.offload is not None else {}
        if self.producer is not None:
            out.update(self.producer.counters)
        if self.consumer is not None:
            out.update(self.consumer.stats())
        return out

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
