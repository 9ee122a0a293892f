"""The proxy's side of discovery: what etcd, the Kubernetes API or a watched file says, applied to
the Router.

A new record becomes an instance (and its KV-event subscription) at once; a record that goes
(withdrawn, or its lease ended) takes its instance, event stream and prefix index with it; a drain
mark drains it on every proxy. Records that do not match this proxy's model and layout
fingerprint, or that point beyond loopback in a cluster without a secret, are not used (logged
once, counted). Static --prefiller/--decoder instances are left alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

from kvferry.common.discovery import sources as disc
from kvferry.common.discovery.etcd import EtcdError
from kvferry.common.log import get_logger
from kvferry.common.netutil import is_loopback
from kvferry.common.secret import ClusterSecret
from kvferry.common.supervise import LoopHealth
from kvferry.common.wire import messages as m
from kvferry.proxy.instance_flags import InstanceSpec, OptionError, parse_url
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing.instances import Instance
from kvferry.proxy.routing.router import Router

logger = get_logger(__name__)

RETRY_S = 1.0  # after an etcd error or a bad discovery file
MAX_LOGGED = 4096  # records remembered as logged (once each); past it the oldest is forgotten


def spec_of(rec: m.InstanceRecord) -> tuple[InstanceSpec, tuple[str, str | None] | None]:
    """The routing spec and KV-event endpoints a record describes (OptionError when it cannot be)."""
    url = parse_url(f"discovery record {rec.instance_id}", rec.url)
    if rec.role == "decoder":
        if not rec.init_ports or len(rec.init_ports) != len(rec.alloc_ports):
            raise OptionError(f"discovery record {rec.instance_id}: a decoder needs as many init_ports as "
                              "alloc_ports (one per TP rank)")
        # The receiver's advertised host is where prefillers dial; it defaults to the URL's host.
        spec = InstanceSpec("decoder", url, rec.init_ports[0], rec.alloc_ports[0], tuple(rec.init_ports),
                            tuple(rec.alloc_ports), receiver_host=rec.receiver_host or None)
    else:
        spec = InstanceSpec("prefiller", url)
    ev = None
    if rec.kv_events:
        if not all(e.startswith(("tcp://", "ipc://")) for e in rec.kv_events):
            raise OptionError(f"discovery record {rec.instance_id}: kv_events {rec.kv_events!r} are not tcp:// or "
                              "ipc:// endpoints")
        ev = (rec.kv_events[0], rec.kv_events[1] if len(rec.kv_events) > 1 else None)
    return spec, ev


class Discovery:
    """Watches one --discovery target for one proxy."""

    def __init__(self, opts: ProxyOptions, router: Router, metrics: ProxyMetrics, secret: ClusterSecret | None,
                 on_added: Callable[[Instance], None], on_removed: Callable[[Instance], None]) -> None:
        self.opts, self.router, self.metrics, self.secret = opts, router, metrics, secret
        self.target = disc.parse_target(opts.discovery or "")
        self.on_added, self.on_removed = on_added, on_removed
        self.model, self.fingerprint = opts.discovery_model, opts.discovery_fingerprint
        self.active: dict[str, tuple[Instance, m.InstanceRecord]] = {}  # discovery id -> (instance, record)
        # (instance id, reason) of records not used, logged and counted once while they stay; insertion
        # ordered (a dict), forgotten when the record goes and past MAX_LOGGED.
        self._logged: dict[tuple[str, str], None] = {}
        # What each usable record parsed to, kept while it is unchanged: a change to one record (a
        # join, a leave) parses that record, not all of them (with 1,000 instances that was most of
        # a join's time on every proxy).
        self._parsed: dict[str, tuple[m.InstanceRecord, InstanceSpec, tuple | None]] = {}
        self.changes = 0
        self.source: disc.EtcdWatch | disc.FileWatch | disc.KubeWatch
        if self.target.scheme == "etcd":
            self.source = disc.EtcdWatch(self.target, secret, self.apply, self._rejected)
        elif self.target.scheme == "k8s":
            self.source = disc.KubeWatch(self.target, self.apply, self._rejected)
        else:
            self.source = disc.FileWatch(self.target, self.apply)

    def _rejected(self, reason: str) -> None:
        self.metrics.discovery_rejected.labels(reason).inc()

    def _skip(self, rec: m.InstanceRecord, reason: str, why: str) -> None:
        if (rec.instance_id, reason) not in self._logged:
            self._logged[(rec.instance_id, reason)] = None
            if len(self._logged) > MAX_LOGGED:
                del self._logged[next(iter(self._logged))]
            self.metrics.discovery_rejected.labels(reason).inc()
            logger.warning("discovery: not using %s %s (%s): %s", rec.role, rec.instance_id, rec.url, why)

    def _usable(self, rec: m.InstanceRecord) -> bool:
        if self.model is None:
            self.model = rec.model
            logger.info("discovery: serving model %r (the first instance's; --discovery-model sets it)", rec.model)
        if self.fingerprint is None and rec.fingerprint:
            self.fingerprint = rec.fingerprint
        if rec.model != self.model:
            self._skip(rec, "model", f"it serves {rec.model!r}, this proxy {self.model!r}")
            return False
        if rec.fingerprint and self.fingerprint and rec.fingerprint != self.fingerprint:
            self._skip(rec, "fingerprint", f"KV layout fingerprint {rec.fingerprint}, this proxy's "
                                           f"{self.fingerprint}: another model, dtype or layout")
            return False
        if self.secret is None and not self.opts.insecure_discovery:
            hosts = [urlsplit(rec.url).hostname or "", rec.receiver_host]
            if not all(is_loopback(h) for h in hosts if h):
                self._skip(rec, "insecure", "it is beyond loopback and this cluster has no secret: set "
                                            "--cluster-secret-file (or --insecure-discovery)")
                return False
        return True

    def apply(self, snap: disc.Snapshot) -> None:
        """Make the router's discovered instances what `snap` says."""
        self.changes += 1
        if self._logged:
            for key in [k for k in self._logged if k[0] not in snap.records]:
                del self._logged[key]  # withdrawn: logged again should it come back
        wanted: dict[str, tuple[m.InstanceRecord, InstanceSpec, tuple | None]] = {}
        for iid, rec in snap.records.items():
            known = self._parsed.get(iid)
            if known is not None and known[0] == rec:  # usable and parsed before; model and fingerprint stay once set
                wanted[iid] = known
                continue
            if not self._usable(rec):
                continue
            try:
                spec, ev = spec_of(rec)
            except OptionError as e:
                self._skip(rec, "malformed", str(e))
                continue
            wanted[iid] = (rec, spec, ev)
        self._parsed = wanted
        for iid, (inst, _rec) in list(self.active.items()):
            w = wanted.get(iid)
            present = self.router.registry.instances.get(inst.id) is inst
            if present and w is not None and w[1] == inst.spec and self.opts.kv_events.get(inst.url) == w[2]:
                continue
            del self.active[iid]
            self.on_removed(inst)
            if present:
                self.router.remove(inst)
            self.opts.kv_events.pop(inst.url, None)
            logger.info("discovery: %s %s (%s) %s", inst.role, iid, inst.url, "changed" if w else "left")
        by_url: dict[str, Instance] | None = None  # made once per apply that adds (not a scan per new record)
        for iid, (rec, spec, ev) in wanted.items():
            if iid in self.active:
                self.active[iid] = (self.active[iid][0], rec)
                continue
            if by_url is None:
                by_url = {}
                for i in self.router.registry.instances.values():
                    by_url.setdefault(i.url, i)
            other = by_url.get(spec.url)
            if other is not None:
                self._skip(rec, "duplicate", f"{spec.url} is already {other.id}")
                continue
            if ev is not None:
                self.opts.kv_events[spec.url] = ev
            inst = self.router.register(spec, discovery_id=iid)
            by_url[inst.url] = inst
            self.active[iid] = (inst, rec)
            self.on_added(inst)
            logger.info("discovery: %s %s joined as %s (%s)", rec.role, iid, inst.id, rec.url)
        for inst, _ in self.active.values():
            inst.draining = inst.discovery_id in snap.drained
        for role in ("prefiller", "decoder"):
            self.metrics.discovery_instances.labels(role).set(sum(1 for i, _ in self.active.values()
                                                                  if i.role == role))

    async def run(self, health: LoopHealth) -> None:
        """Forever; an unreachable etcd or a bad file is logged (rate-limited), shown on /health and
        /metrics (kvferry_proxy_discovery_healthy 0, kvferry_proxy_discovery_errors_total), and tried
        again every RETRY_S (the last good view stays in use meanwhile)."""
        up = self.metrics.discovery_healthy.labels(self.target.scheme)

        def recovered() -> None:
            health.recovered()
            up.set(1)
        while True:
            try:
                await self.source.run(recovered)
            except (EtcdError, disc.DiscoveryError) as e:
                if health.ok:
                    logger.warning("discovery %s: %s; keeping the %d instances known, trying again every %gs",
                                   self.target, e, len(self.active), RETRY_S)
                health.failed(e)
                up.set(0)
                self.metrics.discovery_errors.labels(self.target.scheme).inc()
                await asyncio.sleep(RETRY_S)

    async def close(self) -> None:
        await self.source.close()

    async def set_drain(self, inst: Instance, draining: bool) -> None:
        """Drain (undrain) a discovered instance on every proxy."""
        assert inst.discovery_id is not None
        await disc.set_drain(self.target, self.secret, inst.discovery_id, draining, by="proxy admin API")
