"""The controller: one registry, its worker links (ZMQ), its HTTP API, and what the API asks of them.

Trust (docs/security.md): with a cluster secret every ZMQ socket speaks
CurveZMQ, so a worker without the secret gets no frame through either way; with an admin key every
HTTP endpoint but /health needs it (controller/http_api.py). Without them a loopback controller serves
as LMCache's does; beyond loopback each missing one is a warning, or a one-line error under
--require-cluster-secret.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvferry.common import zsock
from kvferry.common.http.guard import Hosts
from kvferry.common.log import get_logger
from kvferry.common.wire import messages as m
from kvferry.controller.http import DEFAULT_LIMITS, HttpLimits, HttpServer
from kvferry.controller.models import MoveEvent
from kvferry.controller.registry import LOCATIONS, InstanceWorkers, RegistryError, WorkerRegistry
from kvferry.controller.request_guard import ASGIApp
from kvferry.controller.worker_links import PORTS, WorkerLinks, new_id

logger = get_logger(__name__)

MAX_MOVES = 1000  # move events kept for /move/{event_id} and /check_finish


class Controller:
    def __init__(self, host: str, port: int, monitor_ports: dict[str, int], command_timeout: float = 120.0,
                 sweep_interval: float = 0.5, trust: zsock.Trust = zsock.PLAIN, admin_key: str | None = None,
                 allowed_hosts: Sequence[str] = (), http_limits: HttpLimits = DEFAULT_LIMITS) -> None:
        self.host, self.port, self.ports = host, port, monitor_ports
        self.trust = trust
        self.admin_key = admin_key or None
        self.hosts = Hosts(host, allowed_hosts)  # the HTTP API's names without an admin key (request_guard.py)
        self.http_limits = http_limits
        self.registry = WorkerRegistry()
        # What workers and HTTP clients got wrong; shown in /health.
        self.counters = {"bad_frames": 0, "rejected_messages": 0, "bad_lookups": 0, "failed_commands": 0,
                         "unauthorized_http": 0, "dropped_connections": 0}
        self.links = WorkerLinks(self.registry, host, monitor_ports, trust, self.counters, command_timeout,
                                 sweep_interval)
        self.moves: dict[str, MoveEvent] = {}
        self._http: HttpServer | None = None

    def _dropped(self, reason: str) -> None:
        """A connection the HTTP API refused (--max-connections) or closed (--request-timeout)."""
        self.counters["dropped_connections"] += 1

    # ---- lifecycle ----
    def check_exposure(self) -> None:
        """Warn (or, with require, SystemExit in one line) for ports beyond loopback left open."""
        try:
            zsock.check_exposure(self.host, PORTS, self.trust,
                                 fix="Start it with --cluster-secret-file (the workers' cluster_secret_file)")
            zsock.warn_exposed(self.host, f"kvferry-controller's HTTP API (port {self.port})",
                               self.admin_key is not None, self.trust.require, "an admin key",
                               "anyone who reaches it can /move and /clear every instance's KV cache",
                               "Set --admin-key (or KVFERRY_ADMIN_KEY)")
        except zsock.ExposureError as e:
            raise SystemExit(f"kvferry-controller: {e}") from None

    async def start(self, app: ASGIApp) -> None:
        """Serve `app` (controller/http_api.py's build_app of this controller) and the worker links."""
        self.check_exposure()
        self.links.start()
        self._http = HttpServer(app, self.host, self.port, self.http_limits, self._dropped)
        await self._http.start()
        logger.info("kvferry controller: web page and API on http://%s:%d/ (OpenAPI at /docs), pull %d, reply %d%s; "
                    "%s, %s", self.host, self.port, self.ports["pull"], self.ports["reply"],
                    f", heartbeat {self.ports['heartbeat']}" if self.ports.get("heartbeat") else "",
                    "CurveZMQ with the cluster secret" if self.trust.secret else "plain ZMQ (no cluster secret)",
                    "admin key required" if self.admin_key else "no admin key")

    async def stop(self) -> None:
        """HTTP first (its requests may wait on worker commands), then the worker links."""
        if self._http is not None:
            await self._http.stop()
        await self.links.stop()

    # ---- what the HTTP API asks ----
    def health(self) -> tuple[bool, dict[str, Any]]:
        """(ok, body): not ok while a loop keeps failing; its loops, counters and index size."""
        ok = all(h.ok for h in self.links.health.values())
        reg = self.registry
        return ok, {
            "status": "ok" if ok else "degraded", "instances": sorted(reg.instances),
            "loops": {name: h.describe() for name, h in self.links.health.items()}, "counters": self.counters,
            "index": {"workers": reg.num_workers, "max_workers": reg.max_workers, "chunks": reg.indexed,
                      "max_chunks": reg.max_chunks, "max_chunks_per_worker": reg.max_chunks_per_worker}}

    def lookup(self, tokens: Sequence[int]) -> dict[str, Any]:
        info = self.registry.lookup_tokens(tokens)
        return {"event_id": new_id(), "layout_info": {i: ["LocalCPUBackend", n] for i, n in info.items()}}

    def move(self, old: Sequence[str], new: Sequence[str], tokens: Sequence[int], copy: bool) -> dict[str, Any]:
        """Start a move (or copy) of the prompt's prefix; RegistryError for one that cannot be."""
        src, dst, keys, num_tokens = self.registry.plan_move(old, new, tokens)
        ev = MoveEvent(event_id=new_id(), status="pending", num_tokens=num_tokens, from_=src.id, to=dst.id,
                       copy_=copy)
        self.moves[ev.event_id] = ev
        while len(self.moves) > MAX_MOVES:
            self.moves.pop(next(iter(self.moves)))
        if keys:
            self.links.spawn(self._run_move(ev, src, dst, keys, copy))
        else:
            ev.status = "done"
        return {"num_tokens": num_tokens, "event_id": ev.event_id}

    def move_event(self, event_id: str) -> MoveEvent | None:
        return self.moves.get(event_id)

    async def clear(self, instance_id: str | None, location: str) -> dict[str, Any]:
        """Clear one instance's CPU tier (all instances' without an id); RegistryError for bad input."""
        if location not in LOCATIONS:
            raise RegistryError(f"location {location!r} is not supported: use \"LocalCPUBackend\"")
        reg = self.registry
        insts = [reg.instance(instance_id, "instance_id")] if instance_id else list(reg.instances.values())
        event_id = new_id()
        results = await asyncio.gather(*[self.links.command(w, m.ClearChunks(event_id=event_id))
                                         for i in insts for w in i.ranks()])
        failed = [r.message for r in results if not r.ok]
        for i in insts:
            reg.event("clear", i.id, "CPU tier cleared" if not failed else "; ".join(failed))
        return {"event_id": event_id, "status": "failed" if failed else "done",
                "num_chunks": sum(r.num_chunks for r in results), **({"error": "; ".join(failed)} if failed else {})}

    # ---- moves ----
    async def _run_move(self, ev: MoveEvent, src: InstanceWorkers, dst: InstanceWorkers, keys: list[bytes],
                        copy: bool) -> None:
        try:
            await self._move_chunks(ev, src, dst, keys, copy)
        except Exception as e:  # noqa: BLE001 - the event must end, whatever broke
            logger.exception("move %s failed", ev.event_id)
            ev.status, ev.error = "failed", f"{type(e).__name__}: {e}"

    async def _move_chunks(self, ev: MoveEvent, src: InstanceWorkers, dst: InstanceWorkers, keys: list[bytes],
                           copy: bool) -> None:
        ev.status = "running"
        pairs = list(zip(src.ranks(), dst.ranks(), strict=True))
        pulls = await asyncio.gather(*[
            self.links.command(d, m.PullChunks(event_id=ev.event_id, source_id=src.id, source=s.peer, keys=keys))
            for s, d in pairs])
        failed = [r.message for r in pulls if not r.ok]
        ev.nbytes = sum(r.nbytes for r in pulls)
        if not failed and not copy:
            drops = await asyncio.gather(*[self.links.command(s, m.DropChunks(event_id=ev.event_id, keys=keys))
                                           for s, _ in pairs])
            failed = [f"copied, but the source kept it: {r.message}" for r in drops if not r.ok]
        ev.status = "failed" if failed else "done"
        if failed:
            ev.error = "; ".join(failed)
        self.registry.event("move", dst.id, f"{ev.num_tokens} tokens from {src.id} ({'copy' if copy else 'move'})"
                             f": {ev.status}" + (f" ({ev.error})" if failed else ""))
        logger.info("move %s: %d tokens %s -> %s (%s): %s", ev.event_id, ev.num_tokens, src.id, dst.id,
                    "copy" if copy else "move", ev.status + (f" ({ev.error})" if failed else ""))
