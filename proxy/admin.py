"""The proxy's own pages: /health, /metrics, and the admin API (/admin/instances: list, add,
drain, undrain, remove) behind the admin key."""

from __future__ import annotations

from kvferry.common import secret as cluster_secret
from kvferry.common.log import get_logger
from kvferry.common.supervise import LoopHealth
from kvferry.proxy.flows.context import Context
from kvferry.proxy.http.exchange import Request, Response, json_response
from kvferry.proxy.http.routes import Routes
from kvferry.proxy.instance_flags import InstanceSpec, OptionError, decoder_from, parse_url
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.routing.instances import Instance

logger = get_logger(__name__)


class Admin:
    def __init__(self, ctx: Context, loops: dict[str, LoopHealth]) -> None:
        self.ctx, self.loops = ctx, loops

    def routes(self, routes: Routes) -> None:
        """/health and /metrics always; /admin/* unless --no-admin."""
        routes.add("GET", "/health", self.health)
        routes.add("GET", "/metrics", self.metrics_page)
        if self.ctx.opts.admin:
            routes.add("GET", "/admin/instances", self.list)
            routes.add("POST", "/admin/instances", self.add)
            routes.add("POST", "/admin/instances/{iid}/drain", self.drain)
            routes.add("POST", "/admin/instances/{iid}/undrain", self.undrain)
            routes.add("DELETE", "/admin/instances/{iid}", self.remove)

    def trusted(self, request: Request) -> bool:
        """May this caller see internal ports (receiver init/alloc ports, ZMQ errors naming
        addresses)? Only with the admin key, and only when one is set."""
        key = self.ctx.opts.admin_key
        if not key:  # none set (or empty): nobody is trusted
            return False
        return cluster_secret.authorized(request.headers.get("Authorization"), key)

    async def health(self, request: Request) -> Response:
        registry = self.ctx.router.registry
        ok = registry.ready()
        # No usable prefiller: decoders serve whole requests, so the proxy still serves (200).
        status = "ok" if ok else "degraded" if self.ctx.router.degraded() else "unavailable"
        full = self.trusted(request)
        background = {k: h.describe() for k, h in self.loops.items()}
        if not full:
            for d in background.values():
                if d.get("last_error"):
                    d["last_error"] = "see the proxy's log"
        insts = []
        for i in registry.instances.values():
            d = i.describe(ports=full)
            ev = self.ctx.router.cache.describe(i)
            if ev is not None:
                if not full:
                    ev.pop("endpoint")
                d["kv_events"] = ev
            insts.append(d)
        return json_response({"status": status, "instances": insts, "background": background},
                             503 if status == "unavailable" else 200)

    async def metrics_page(self, request: Request) -> Response:
        self.ctx.router.refresh_degraded()  # true when read, not only as of the last health round
        return Response(self.ctx.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    async def list(self, request: Request) -> Response:
        return json_response({"instances": [i.describe() for i in self.ctx.router.registry.instances.values()]})

    async def add(self, request: Request) -> Response:
        body = await self.ctx.bodies.read(request)
        role, url = body.get("role"), body.get("url")
        try:
            if role == "prefiller":
                spec = InstanceSpec("prefiller", parse_url("url", str(url)))
            elif role == "decoder":
                raw = f"{url},{body.get('init_port')},{body.get('alloc_port')}"
                spec = decoder_from("url", raw)
            else:
                raise OptionError(f"role must be 'prefiller' or 'decoder', got {role!r}")
            inst = self.ctx.router.register(spec)
        except (OptionError, ValueError) as e:
            raise ProxyError(400, str(e), "bad_instance") from None
        logger.info("admin: added %s %s as %s", role, inst.url, inst.id)
        self._publish({"op": "add", "role": role, "url": inst.url, "init_port": body.get("init_port"),
                       "alloc_port": body.get("alloc_port")})
        return json_response(inst.describe(), 201)

    def _publish(self, change: dict) -> None:
        """--workers N: the other workers make the same change (proxy/multiproc/admin_log.py)."""
        if self.ctx.peers is not None:
            self.ctx.peers.publish(change)

    def apply(self, change: dict) -> None:
        """A change another worker made through the admin API, made here too."""
        router = self.ctx.router
        op, url = change.get("op"), change.get("url")
        if op == "add":
            raw = str(url) if change["role"] == "prefiller" else f"{url},{change['init_port']},{change['alloc_port']}"
            spec = InstanceSpec("prefiller", parse_url("url", raw)) if change["role"] == "prefiller" \
                else decoder_from("url", raw)
            try:
                router.register(spec)
            except ValueError:  # already here (this worker saw it another way)
                pass
            return
        inst = next((i for i in router.registry.instances.values() if i.url == url), None)
        if inst is None:
            return
        if op in ("drain", "undrain"):
            inst.draining = op == "drain"
        elif op == "eject":
            router.eject(inst)
        elif op == "remove":
            router.remove(inst)

    def _inst(self, request: Request) -> Instance:
        inst = self.ctx.router.registry.instances.get(request.match_info["iid"])
        if inst is None:
            raise ProxyError(404, f"no instance {request.match_info['iid']!r}", "not_found")
        return inst

    async def drain(self, request: Request) -> Response:
        return await self._set_drain(self._inst(request), True)

    async def undrain(self, request: Request) -> Response:
        return await self._set_drain(self._inst(request), False)

    async def _set_drain(self, inst: Instance, draining: bool) -> Response:
        """A discovered instance is drained through discovery (etcd or the file), so every proxy
        drains it; a static one on this proxy only; a Kubernetes pod by its annotation (409 says
        the command)."""
        disc = self.ctx.router.discovery
        if inst.discovery_id is not None and disc is not None:
            from kvferry.common.discovery.etcd import EtcdError
            from kvferry.common.discovery.sources import DiscoveryError, ReadOnlyDiscovery
            try:
                await disc.set_drain(inst, draining)
            except ReadOnlyDiscovery as e:  # the proxy only reads pods: the error says what to run
                raise ProxyError(409, str(e), "managed_by_kubernetes") from None
            except (EtcdError, DiscoveryError, OSError) as e:
                raise ProxyError(503, f"cannot {'drain' if draining else 'undrain'} {inst.id} through "
                                      f"discovery: {e}", "discovery_unavailable") from None
        inst.draining = draining
        self._publish({"op": "drain" if draining else "undrain", "url": inst.url})
        return json_response(inst.describe())

    async def remove(self, request: Request) -> Response:
        inst = self._inst(request)
        if inst.discovery_id is not None:
            raise ProxyError(409, f"{inst.id} is {inst.discovery_id!r} in discovery: drain it (every proxy), or "
                                  "withdraw it there (stop its kvferry join)", "discovered_instance")
        self.ctx.router.remove(inst)
        self._publish({"op": "remove", "url": inst.url})
        return json_response(inst.describe())
