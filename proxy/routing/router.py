"""Which instance serves a leg: picks (policy, affinity, retry elsewhere), per-instance load
gauges, and health: the periodic /health loop, and an immediate probe after a failed request
that ejects a dead instance (the loop re-admits it).

An instance that goes (`remove`: the admin API, or discovery) takes with it everything kept for
it: its metric series, KV-event stream and prefix index, /health probe, idle upstream
connections, board row, and (through `Instance.when_removed`) what other parts keep. Requests
still in flight on it finish on the objects they hold: their in-flight gauge is the one made
before the removal, no longer on /metrics, and nothing they report labels a new series."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from typing import Protocol, cast

from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.proxy.http.exchange import Request
from kvferry.proxy.instance_flags import InstanceSpec
from kvferry.proxy.metrics import ProxyMetrics, Value
from kvferry.proxy.multiproc.admin_log import Peers
from kvferry.proxy.multiproc.board import ROLES, ROWS, LoadBoard
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing import health
from kvferry.proxy.routing.cache import (
    NO_PREFILLER,
    CacheView,
    PromptKeys,
    Route,
    choose,
    effective,
    local_reason,
    served_mode,
)
from kvferry.proxy.routing.identity import prompt_root
from kvferry.proxy.routing.instances import Instance, NoInstance, Registry
from kvferry.proxy.routing.prefix_index import ROOT
from kvferry.proxy.upstream_client import UpstreamClient

logger = get_logger(__name__)
_board_full_log = RateLimitedLog(logger, 10.0)

PROBE_TIMEOUT_S = 2.0  # a /health answer slower than this counts as a failed check


class DrainThrough(Protocol):
    """What the admin API needs of discovery: drain (or undrain) a discovered instance for every proxy."""

    async def set_drain(self, inst: Instance, draining: bool) -> None: ...


class Router:
    def __init__(self, opts: ProxyOptions, metrics: ProxyMetrics, client: UpstreamClient,
                 board: LoadBoard | None = None) -> None:
        self.opts, self.metrics, self.client = opts, metrics, client
        self.registry = Registry(policy=opts.policy, board=board)
        self.metrics.live_instances = self.live_instances
        self._probes: dict[str, asyncio.Task] = {}  # instance id -> its /health probe (one at a time)
        self.cache = CacheView(opts, metrics)
        self.discovery: DrainThrough | None = None  # proxy.discovery.Discovery with --discovery
        self.peers: Peers | None = None  # --workers N: ejections shared with the other workers

    def register(self, spec: InstanceSpec, discovery_id: str | None = None) -> Instance:
        inst = self.registry.add(spec)
        inst.discovery_id = discovery_id
        if self.registry.board is not None and inst.board is None:
            self.metrics.board_full.inc()
            _board_full_log.warning("%s %s (%s) added without a row on the load board (all %d held): routed "
                                    "on each worker's own load", inst.role, inst.url, inst.id,
                                    ROWS)
        self.metrics.healthy.labels(inst.id, inst.role, inst.url).set(1)
        self.cache.add(inst)
        return inst

    def remove(self, inst: Instance) -> None:
        """Out of the registry, and everything kept for it freed (the module's docstring)."""
        self.registry.remove(inst.id)
        stream = self.cache.remove(inst)
        if stream is not None:
            stream.close()
        probe = self._probes.pop(inst.id, None)
        if probe is not None:
            probe.cancel()
        if self.client.is_open:
            self.client.pool.drop(inst.url)
            self.client.checks.drop(inst.url)
        self.metrics.forget_instance(inst.id)

    def live_instances(self) -> set[str]:
        """The instance labels /metrics shows with --workers N: the instances some worker holds
        (ids are the board's, the same on every worker), this worker's, and the proxy's own."""
        live = {i.id for i in self.registry.instances.values()}
        live.add("proxy")
        if self.registry.board is not None:
            live.update(f"{role[0]}{n}" for n in self.registry.board.live_ids() for role in ROLES)
        return live

    def route(self, request: Request, tokens: list[int] | None, ntok: int, single: bool = False,
              body: dict | None = None) -> Route:
        """Where a prompt goes: a decoder, and a prefiller or none (the decoder prefills it).
        `single`: the answer is one token, one instance serves it whole either way. `body`: the
        request's, for the identity its cached KV is predicted under (routing/identity.py)."""
        root = ROOT if body is None else prompt_root(body, self.cache.adapters)
        if root is None:  # inputs the proxy cannot hash: no prediction
            tokens, root = None, ROOT
        tracer = self.client.tracer
        t0 = time.time_ns() if tracer is not None else 0
        affinity = bool(self.opts.affinity_header and request.headers.get(self.opts.affinity_header))
        if self.opts.policy == "cache" and not affinity:
            decoders = self.registry.usable("decoder")
            prefillers = self.registry.usable("prefiller")
            if not decoders:
                raise ProxyError(503, "no healthy decoder available", "no_instance")
            r = choose(self.cache, self.opts, decoders, prefillers, tokens, ntok, root)
        else:
            d = self.pick(request, "decoder")
            held = self.cache.cached(d, PromptKeys(tokens, root))
            why = local_reason(self.opts, d, None if held is None else effective(held), tokens, ntok)
            if not why and not self.registry.usable("prefiller"):
                why = NO_PREFILLER
            r = Route(d, None, why) if why else Route(d, self.pick(request, "prefiller"),
                                                      "affinity" if affinity else self.opts.policy)
        self.metrics.routes.labels(r.reason).inc()
        self.metrics.served.labels("single" if single else served_mode(r)).inc()
        if r.reason == NO_PREFILLER:
            self.refresh_degraded()
        if tracer is not None:
            tracer.record("route", t0, {"kvferry.route.decoder": r.decoder.id, "kvferry.route.reason": r.reason,
                                        "kvferry.route.prefiller": r.prefiller.id if r.prefiller else "",
                                        "kvferry.route.mode": "single" if single else served_mode(r),
                                        "kvferry.route.predicted_cached_tokens": r.predicted,
                                        "kvferry.route.prompt_tokens": ntok, "kvferry.route.policy": self.opts.policy})
        return r

    def served_alone(self, route: Route) -> Route:
        """The prefill leg failed and no prefiller could take it: the decoder serves the request
        whole (degraded), counted as such."""
        self.metrics.routes.labels(NO_PREFILLER).inc()
        self.metrics.served.labels("degraded").inc()
        self.refresh_degraded()
        return Route(route.decoder, None, NO_PREFILLER)

    def degraded(self) -> bool:
        """No prefiller is usable while a decoder is: decoders serve whole requests."""
        return not self.registry.usable("prefiller") and bool(self.registry.usable("decoder"))

    def refresh_degraded(self) -> None:
        self.metrics.degraded.set(1 if self.degraded() else 0)

    def observed(self, inst: Instance, route: Route, answer: dict) -> None:
        """Predicted against actual cached tokens, where the engine reports them (vLLM's
        --enable-prompt-tokens-details)."""
        u = answer.get("usage") if isinstance(answer, dict) else None
        details = u.get("prompt_tokens_details") if isinstance(u, dict) else None
        actual = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = u.get("prompt_tokens") if isinstance(u, dict) else None
        if isinstance(actual, int) and isinstance(prompt, int) and 0 <= actual <= prompt and not inst.removed:
            self.metrics.actual_cached.labels(inst.id).inc(actual)
            self.metrics.predicted_cached.labels(inst.id).inc(min(route.predicted, prompt))
            self.metrics.routed_prompt.labels(inst.id).inc(prompt)

    def in_flight(self, inst: Instance) -> Value:
        """The instance's in-flight gauge, labelled once (labels() costs a lookup per call) and held
        by the instance: a request that ends after the instance went moves the gauge it started on,
        which is no longer on /metrics, rather than labelling the series again."""
        g = inst.in_flight_gauge
        if g is None:
            if inst.removed:  # routed before the removal, started after it: counted nowhere
                return _UNCOUNTED
            g = inst.in_flight_gauge = self.metrics.in_flight.labels(inst.id, inst.role)
        return g

    def pick(self, request: Request, role: str) -> Instance:
        """An instance of `role` for this request (by the client's affinity header when set); a 503
        when there is none."""
        key = request.headers.get(self.opts.affinity_header) if self.opts.affinity_header else None
        try:
            return self.registry.pick(role, key)
        except NoInstance as e:
            raise ProxyError(503, str(e), "no_instance") from None

    def elsewhere(self, role: str, tried: Sequence[Instance], why: str) -> Instance:
        """The one rule for trying a leg again after `tried` failed it (a prefill retry, a decode
        leg that moves): the usable instance of `role` not tried yet with the fewest active
        sequences and queued prompt tokens (every proxy worker's). A 503 naming `why` when none is."""
        others = [i for i in self.registry.usable(role) if i not in tried]
        if not others:
            raise ProxyError(503, f"no other healthy {role} to {why}", "no_instance")
        return min(others, key=lambda i: (i.all_active, i.all_queued))

    # ---- failures and health ----
    def upstream_failed(self, inst: Instance, leg: str, kind: str, cause: str) -> None:
        """One upstream failure (not a 4xx: that is the client's): a log line, the error counter,
        and an immediate /health probe that ejects the instance if it is dead."""
        inst.failed_one()
        if not inst.removed:  # a removed instance's series are gone: logged only
            self.metrics.errors.labels(kind, inst.id).inc()
        logger.warning("%s %s (%s) failed on the %s leg: %s: %s", inst.role, inst.url, inst.id, leg, kind,
                       " ".join(cause.split()))
        self._probe_soon(inst)

    def _probe_soon(self, inst: Instance) -> None:
        if inst.id in self._probes or not self.client.is_open or inst.removed:
            return
        task = asyncio.ensure_future(self._probe(inst))
        self._probes[inst.id] = task
        task.add_done_callback(functools.partial(self._probe_done, inst.id))

    def _probe_done(self, iid: str, task: asyncio.Task) -> None:
        if self._probes.get(iid) is task:
            del self._probes[iid]

    async def _probe(self, inst: Instance) -> None:
        good, why = await self.check(inst, PROBE_TIMEOUT_S)
        if good or inst.removed:
            return
        was = inst.healthy
        self.eject(inst)
        if self.peers is not None:  # --workers N: every worker stops sending to it now
            self.peers.publish({"op": "eject", "url": inst.url})
        if was:
            logger.warning("%s %s (%s) ejected: a request failed and %s; health checks every %gs re-admit it",
                           inst.role, inst.url, inst.id, why, self.opts.health_interval)

    def eject(self, inst: Instance) -> None:
        """Out of rotation until a health check passes (a failed request and a failed probe, here or
        on another worker)."""
        inst.eject()
        self.cache.forget(inst)
        self.metrics.healthy.labels(inst.id, inst.role, inst.url).set(0)

    async def check(self, inst: Instance, seconds: float) -> tuple[bool, str]:
        """GET /health (routing/health.py)."""
        return await health.check(self.client.checks, inst.url, seconds)

    async def scrape_load(self, seconds: float) -> None:
        """One round of /metrics scrapes: every proxy sees the same engine counts (docs/proxy.md
        "Load across proxies")."""
        insts = [i for i in self.registry.instances.values() if i.healthy]
        owns = [i.all_active for i in insts]
        results = [health.load_of(s) for s in await asyncio.gather(
            *(health.engine_series(self.client.checks, i.url, seconds) for i in insts))]
        for inst, own, (load, usage) in zip(insts, owns, results, strict=True):
            inst.engine_load, inst.own_at_scrape = load, own
            if usage is not None and inst.role == "decoder":
                inst.kv_usage = usage

    async def check_all(self) -> None:
        """One round of health checks over every instance; a change of state is logged."""
        insts = list(self.registry.instances.values())
        # Not bounded by the interval: rounds never overlap (the loop waits for one, then sleeps),
        # and a short interval must not make a busy engine's slower answer a failure.
        results = await asyncio.gather(*(self.check(i, PROBE_TIMEOUT_S) for i in insts))
        for inst, (good, why) in zip(insts, results, strict=True):
            if inst.removed:
                continue  # removed while it was checked
            was = inst.healthy
            inst.ok() if good else inst.failed()
            if not inst.healthy:
                self.cache.forget(inst)  # a dead engine's cache died with it
            stream = self.cache.streams.get(inst.id)
            if stream is not None:
                self.metrics.index_blocks.labels(inst.id).set(len(stream.index))
            if was != inst.healthy:
                if inst.healthy:
                    logger.warning("%s %s (%s) is back", inst.role, inst.url, inst.id)
                else:
                    logger.warning("%s %s (%s) is unhealthy: %s; ejected", inst.role, inst.url, inst.id, why)
            self.metrics.healthy.labels(inst.id, inst.role, inst.url).set(1 if inst.healthy else 0)
        self.refresh_degraded()
        decoders = [i for i in insts if i.role == "decoder" and i.healthy]
        pages = await asyncio.gather(*(health.engine_series(self.client.checks, i.url, PROBE_TIMEOUT_S)
                                       for i in decoders))
        for inst, series in zip(decoders, pages, strict=True):
            inst.kv_usage = health.usage_of(series)

    def probes(self) -> list[asyncio.Task]:
        return list(self._probes.values())


class _Uncounted:
    """The in-flight gauge of a request that started on an instance already removed."""

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass


_UNCOUNTED = cast(Value, _Uncounted())
