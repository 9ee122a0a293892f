"""The connector's scheduler-process half: decides what each step's workers save or load.

It sees a request's KV blocks only through vLLM's public connector API: the blocks handed to
``update_state_after_alloc`` and each step's scheduler output (connector/block_table.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvferry.common.config import ConfigError
from kvferry.common.errors import KVFerryError
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.wire.transfer_params import (
    ParamsError,
    PrefillParams,
    answer,
    decode_params,
    error_answer,
    prefill_params,
)
from kvferry.connector.block_table import BlockTable
from kvferry.connector.metadata import KVFerryMetadata, LoadOp, OpenOp, PieceOp, SaveOp
from kvferry.connector.request_identity import IdentityReader, Unkeyable
from kvferry.connector.roles import Roles, engine_id, salt
from kvferry.connector.vllm_kv_events import start_relay, to_vllm
from kvferry.engine.api import OffloadPlanner, PromptIdentity, notice_addr

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = get_logger(__name__)

# vLLM has no member for a shared remote store; EXTERNAL_UNSPECIFIED is its documented fallback.
_HIT_SOURCES = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "p2p": CacheHitSource.P2P,
                "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}


class SchedulerSide:
    def __init__(self, roles: Roles, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        self.roles = roles
        self.offload = planner(roles, vllm_config, kv_cache_config) if roles.offload else None
        # Block ids are followed only where a step's metadata needs them: prompts stored or sent.
        self._blocks = BlockTable() if self.offload is not None or (roles.pd and roles.producer_side) else None
        self._computing: dict[str, Request] = {}  # offload: admitted, prompt not complete yet
        self._identities = IdentityReader(roles.cfg.chunk_size)
        self._identity: dict[str, PromptIdentity | None] = {}  # offload: None for a request that cannot be keyed
        self._prefills: dict[str, tuple[Request, PrefillParams]] = {}  # producer: waiting for their last prompt token
        self._opened: set[str] = set()  # producer: prompts whose pages were asked for
        self._cancels: list[str] = []  # producer: opened transfers whose requests ended unfinished
        self._errors: dict[str, str] = {}  # producer: requests whose params were unusable
        self._transfer_ids: dict[str, str] = {}
        self._external: dict[str, int] = {}  # consumer: req -> local tokens when matched
        self._tried: set[str] = set()  # consumer: a load was planned (a retry after failure recomputes)
        self._loads: list[LoadOp] = []
        self._pinned: dict[str, str] = {}  # consumer: req -> transfer id pinned for it
        self._pins: list[str] = []  # consumer: to tell the workers in the next step
        self._unpins: list[str] = []
        self._events_failed = RateLimitedLog(logger, 60.0)
        # vLLM's KV events onto a port with the cluster secret (config keys kv_events_relay_*)
        self.relay = start_relay(roles.cfg, vllm_config)

    def on_new(self, request: Request) -> None:
        """A decoder's request is in vLLM's queue now: its KV must wait for it (see the module docstring)."""
        if self.roles.producer_side or not self.roles.pd:
            return
        try:
            tid = _decode_tid(request.kv_transfer_params)
        except ParamsError:
            return  # matched() logs it and computes the prompt locally
        if tid is not None:
            self._pinned[request.request_id] = tid
            self._pins.append(tid)

    def matched(self, request: Request, num_computed: int) -> tuple[int, bool]:
        if self.roles.producer_side:
            if self.offload is None:
                return 0, False
            identity = self._keyed(request)
            if identity is None:
                return 0, False
            return self.offload.match(request.request_id, _offload_tokens(request), num_computed,
                                      identity=identity), False
        if request.request_id in self._tried:
            return 0, False
        try:
            tid = _decode_tid(request.kv_transfer_params)
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
        if self.offload is not None and self._keyed(request) is not None:
            self.offload.after_alloc(rid, _offload_tokens(request), blocks.get_block_ids()[0], num_external)
            self._computing[rid] = request
        if self.roles.producer_side:
            if not self.roles.pd or rid in self._prefills or rid in self._errors:
                return
            try:
                spec = prefill_params(request.kv_transfer_params)
            except ParamsError as e:
                logger.error("request %s: %s; its KV is not sent", rid, e)
                self._errors[rid] = str(e)
                return
            if spec is not None:
                self._prefills[rid] = (request, spec)
                self._transfer_ids[rid] = spec.tid
            return
        local = self._external.pop(rid, None)
        if local is None or num_external <= 0:
            return
        self._tried.add(rid)
        p = decode_params(request.kv_transfer_params)
        assert p is not None  # matched() counted external tokens only for a request with one
        # The full prompt: the transfer may cover one token more than is loaded (see PDConsumer).
        self._loads.append(LoadOp(rid, p.transfer_id, _prompt(request), list(blocks.get_block_ids()[0]),
                                  local + num_external, local, p.traceparent))

    def build(self, so: SchedulerOutput) -> KVFerryMetadata:
        meta = KVFerryMetadata(idle=so.total_num_scheduled_tokens == 0)
        meta.loads, self._loads = self._loads, []
        meta.pins, self._pins = self._pins, []
        meta.unpins, self._unpins = self._unpins, []
        meta.cancels, self._cancels = self._cancels, []
        if self._blocks is not None:
            self._blocks.update(so)
        if self.offload is not None:
            for rid, n in so.num_scheduled_tokens.items():
                req = self._computing.get(rid)
                if req is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                    continue  # not admitted through us, or chunked prefill not at its last piece
                del self._computing[rid]
                assert self._blocks is not None  # kept whenever offload is on
                identity = self._identity.get(rid)
                if identity is not None:
                    self.offload.store(rid, _offload_tokens(req), self._blocks.get(rid), identity)
            meta.cache_loads, meta.cache_saves = self.offload.take()
        for rid, n in so.num_scheduled_tokens.items():
            entry = self._prefills.get(rid)
            if entry is None:
                continue
            assert self._blocks is not None  # kept on every prefiller
            req, spec = entry
            if rid not in self._opened:  # first scheduled: the decoder's pages are asked for before the compute
                self._opened.add(rid)
                meta.opens.append(OpenOp(rid, spec.tid, spec.host, spec.init_ports, spec.alloc_ports,
                                         _prompt(req), req.num_prompt_tokens, spec.traceparent))
            if req.num_computed_tokens + n < req.num_prompt_tokens:  # chunked prefill: not the last piece yet
                meta.pieces.append(PieceOp(rid, spec.tid, self._blocks.get(rid), req.num_computed_tokens + n))
                continue
            del self._prefills[rid]
            meta.saves.append(SaveOp(rid, spec.tid, spec.host, spec.init_ports, spec.alloc_ports,
                                     _prompt(req), self._blocks.get(rid), req.num_prompt_tokens, spec.traceparent))
        return meta

    def _keyed(self, request: Request) -> PromptIdentity | None:
        """The request's KV identity for the offload tiers, read once; None when it cannot be keyed
        (counted and logged: it is neither looked up nor stored)."""
        rid = request.request_id
        if rid in self._identity:
            return self._identity[rid]
        assert self.offload is not None  # asked only where offload is on
        try:
            identity: PromptIdentity | None = self._identities.read(request)
        except Unkeyable as e:
            identity = None
            self.offload.unkeyable()
            self._identities.tell_once(rid, str(e))
        self._identity[rid] = identity
        return identity

    def hit_sources(self, req_id: str) -> dict[CacheHitSource, int]:
        if self.offload is None:
            return {}
        got = self.offload.hit_sources(req_id)
        return {_HIT_SOURCES[t]: n for t, n in got.items() if t in _HIT_SOURCES}

    def take_events(self) -> list[KVCacheEvent]:
        """The offload tiers' changes since the last step, as vLLM KV events (never raises: an
        event lost only costs a router's accuracy)."""
        if self.offload is None:
            return []
        try:
            return to_vllm(self.offload.take_events(), self.offload.chunk_size)
        except Exception as e:  # noqa: BLE001 - inside vLLM's scheduler step
            self._events_failed.warning("offload tier KV events lost: %s", e)
            return []

    def stats(self) -> dict[str, float]:
        return self.offload.stats() if self.offload is not None else {}

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._tried.discard(rid)
        self._external.pop(rid, None)
        if self._blocks is not None:
            self._blocks.forget(rid)
        tid = self._pinned.pop(rid, None)
        if tid is not None:
            self._unpins.append(tid)
        self._computing.pop(rid, None)
        self._identity.pop(rid, None)
        if self.offload is not None:
            self.offload.finished(rid)
        if not (self.roles.producer_side and self.roles.pd):
            return False, None
        if self._prefills.pop(rid, None) is not None:  # ended before its last piece (vLLM's abort: the client left)
            logger.info("request %s ended after %d of its %d prompt tokens were computed: transfer %s is not sent",
                        rid, request.num_computed_tokens, request.num_prompt_tokens, self._transfer_ids.get(rid))
            if rid in self._opened:
                self._cancels.append(self._transfer_ids[rid])  # its pages go back
        self._opened.discard(rid)
        err = self._errors.pop(rid, None)
        tid = self._transfer_ids.pop(rid, None)
        if err is not None:
            return False, error_answer(err)
        if tid is None:
            return False, None
        first = request.output_token_ids[0] if request.output_token_ids else None
        # The staging copy was made in the step that finished the prompt: vLLM may free the blocks.
        return False, answer(tid, request.num_prompt_tokens, first)

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        if self.relay is not None:
            self.relay.close()


def _decode_tid(params: Any) -> str | None:
    p = decode_params(params)
    return p.transfer_id if p is not None else None


def planner(roles: Roles, vc: VllmConfig, kcc: KVCacheConfig | None) -> OffloadPlanner:
    """The scheduler's offload planner, sized from vLLM's KV cache config."""
    if kcc is None or not kcc.kv_cache_groups:
        raise ConfigError("KVFerryConnector offload needs vLLM's KV cache config (vLLM >= 0.11)")
    if len(kcc.kv_cache_groups) != 1:
        raise ConfigError(f"this model has {len(kcc.kv_cache_groups)} KV cache groups; kvferry's offload tiers "
                          "handle one: start vLLM with --disable-hybrid-kv-cache-manager")
    group = kcc.kv_cache_groups[0]
    block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    cfg = roles.cfg
    try:
        return OffloadPlanner(cfg, salt(vc, cfg, len(group.layer_names)), vc.cache_config.block_size, block_bytes,
                              notice_addr(engine_id(vc)) if cfg.enable_p2p else None,
                              tier_events=kv_events_enabled(vc))
    except KVFerryError as e:  # a chunk_size or serde the planner refuses, or a remote store it cannot reach
        raise ConfigError(str(e)) from None


def kv_events_enabled(vc: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (then the tiers' changes are recorded for it)."""
    ev = getattr(vc, "kv_events_config", None)
    return bool(ev is not None and ev.enable_kv_cache_events)


def _prompt(req: Request) -> list[int]:
    """The prompt's token ids (none for a prompt given as embeddings alone)."""
    return list(req.prompt_token_ids or ())


def _offload_tokens(req: Request) -> list[int]:
    """The token ids the offload keys chain: a prompt given as embeddings alone has none, and
    stands as placeholders (zeros, as vLLM's own token list has them) beside its embeddings'
    digests, which its identity carries."""
    return list(req.prompt_token_ids) if req.prompt_token_ids is not None else [0] * req.num_prompt_tokens
