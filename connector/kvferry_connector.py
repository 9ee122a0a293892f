"""KVFerryConnector: vLLM's KVConnectorBase_V1 on top of kvferry's KV engine.

Loaded by vLLM with ``--kv-transfer-config '{"kv_connector": "KVFerryConnector",
"kv_connector_module_path": "kvferry.connector", "kv_role": "kv_both" | "kv_producer" |
"kv_consumer"}'`` and configured by LMCache's YAML keys (``KVFERRY_CONFIG_FILE`` /
``LMCACHE_CONFIG_FILE``, env, or ``kv_connector_extra_config``).

Offload (kv_both, and prefillers): prompts' chunks are stored to the local CPU and disk tiers
and a later prompt with the same prefix loads them instead of computing them (engine/offload/);
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

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvferry.common.log import configure_in_vllm
from kvferry.connector.metadata import KVFerryMetadata, KVFerryWorkerMeta
from kvferry.connector.roles import roles
from kvferry.connector.scheduler_side import SchedulerSide
from kvferry.connector.stats import KVFerryPromMetrics, KVFerryStats, deltas
from kvferry.connector.vllm_version import check_vllm_version, installed_vllm_version, warn_cpu_mla_rotary
from kvferry.connector.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVFerryConnector(KVConnectorBase_V1):
    """vLLM's entry point: routes each call to the scheduler side or the worker side."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # kvferry's log lines follow vLLM's logging settings (common/log.py), set up here, not at import.
        configure_in_vllm(getattr(vllm_config, "logging_config", None))
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]  # vLLM passes None too
        self.roles = roles(vllm_config)
        check_vllm_version(installed_vllm_version(), self.roles.cfg.allow_unsupported_vllm)
        self._last_stats: dict[str, float] = {}
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            warn_cpu_mla_rotary(vllm_config)
            self._sched = SchedulerSide(self.roles, vllm_config, kv_cache_config)
            # vLLM reads this right after building the scheduler's connector. A failed load from an
            # offload tier is always recomputed; a decoder follows pd_kv_timeout_action.
            self._kv_transfer_config.kv_load_failure_policy = (
                "recompute" if self.roles.producer_side
                else self.roles.cfg.pd_kv_timeout_action)  # type: ignore[assignment]  # config.py checks it
        else:
            self._worker = WorkerSide(self.roles, vllm_config)

    @property
    def _s(self) -> SchedulerSide:
        assert self._sched is not None, "vLLM called a scheduler-side method on a worker-role connector"
        return self._sched

    @property
    def _w(self) -> WorkerSide:
        assert self._worker is not None, "vLLM called a worker-side method on a scheduler-role connector"
        return self._worker

    # ---- scheduler side ----
    def on_new_request(self, request: Request) -> None:
        self._s.on_new(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._s.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s.build(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s.finished(request)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        got = self._s.hit_sources(request.request_id) if num_external_tokens else {}
        return got or super().get_external_cache_hit_sources(request, num_external_tokens)

    def take_events(self) -> list[KVCacheEvent]:
        return self._s.take_events()

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVFerryWorkerMeta) and self._s.offload is not None:
            self._s.offload.forget(meta.lost)

    # ---- both sides ----
    def get_kv_connector_stats(self) -> KVFerryStats | None:
        now = (self._sched or self._w).stats()
        # A histogram's observations travel as lists (each TP rank's, joined by KVFerryStats.aggregate).
        samples = self._worker.samples() if self._worker is not None else {}
        if not now and not samples:
            return None
        return KVFerryStats(data={**deltas(now, self._last_stats), **samples})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFerryStats:
        return KVFerryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVFerryPromMetrics:
        configure_in_vllm(getattr(vllm_config, "logging_config", None))  # the API server's process: no connector
        return KVFerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w.register(kv_caches)

    # vLLM sleep mode (vLLM >= 0.33; docs/compatibility.md): the worker drains its transfers and
    # drops its NIXL registrations before the memory goes, and registers again after.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._w.unregister()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._w.restore()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the forward pass on every device: vLLM calls start_load_kv after the forward
        # when no load feeds it, which on a CPU is after the compute.
        self._w.opens(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._w.start_loads(self._get_connector_metadata())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._w.worker_meta()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._w.saves(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        return self._w.results(finished_req_ids, isinstance(meta, KVFerryMetadata) and meta.idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._w.close()
        if self._sched is not None:
            self._s.close()
