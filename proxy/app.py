"""The proxy: its parts wired together, its routes, the guard every request passes (keys,
--max-in-flight, errors as OpenAI JSON), /v1/models, and the supervised background loops."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from multidict import CIMultiDict

from kvferry.common import secret as cluster_secret
from kvferry.common import trace_context, zsock
from kvferry.common.errors import ConfigurationError
from kvferry.common.http import guard as http_guard
from kvferry.common.log import REQUEST_ID, get_logger
from kvferry.common.netutil import is_loopback
from kvferry.common.supervise import LoopHealth, supervise
from kvferry.proxy.admin import Admin
from kvferry.proxy.flows.chat import Chat
from kvferry.proxy.flows.completions import Completions
from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.kv_transfers import Transfers, notify_host
from kvferry.proxy.flows.upstream import Upstream
from kvferry.proxy.http import limits
from kvferry.proxy.http.exchange import Request, Response, error_body, json_response
from kvferry.proxy.http.routes import Routes
from kvferry.proxy.http.sse import Answer
from kvferry.proxy.instance_flags import OptionError
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.multiproc.admin_log import Peers
from kvferry.proxy.multiproc.board import LoadBoard
from kvferry.proxy.openai.body import BodyReader
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing.instances import Instance
from kvferry.proxy.routing.membership import Discovery
from kvferry.proxy.routing.router import Router
from kvferry.proxy.routing.tokens import PromptTokens
from kvferry.proxy.upstream_client import UpstreamClient

if TYPE_CHECKING:
    from kvferry.proxy.tracing import ProxyTracer

logger = get_logger(__name__)

PROBE_S = 2.0  # one /metrics scrape at most


class Proxy:
    def __init__(self, opts: ProxyOptions, board: LoadBoard | None = None, peers: Peers | None = None) -> None:
        """`board` and `peers`: a worker of `--workers N` (proxy/multiproc/supervisor.py): load and admin changes
        shared with the other workers."""
        self.opts = opts
        self.peers = peers
        self.metrics = ProxyMetrics()
        self.client = UpstreamClient(opts)
        self.tracer: ProxyTracer | None = None
        if opts.otlp_traces_endpoint:  # imported only then: a proxy without tracing needs no OpenTelemetry
            from kvferry.proxy.tracing import ProxyTracer
            try:
                self.client.tracer = self.tracer = ProxyTracer(opts)
            except ConfigurationError as e:
                raise OptionError(f"--otlp-traces-endpoint: {e}") from None
        self.router = Router(opts, self.metrics, self.client, board)
        self.router.peers = peers
        try:
            self.trust = zsock.Trust(cluster_secret.from_env(opts.cluster_secret_file), opts.require_cluster_secret)
        except cluster_secret.SecretError as e:
            raise OptionError(str(e)) from None
        self.router.cache.trust = self.trust  # before the streams: tcp:// KV events speak CurveZMQ with it
        for spec in [*opts.prefillers, *opts.decoders]:
            try:
                self.router.register(spec)
            except ValueError as e:
                raise OptionError(f"--{spec.role}: {e}") from None
        self.hosts = http_guard.Hosts(opts.host, opts.allowed_host)  # the admin API's names without --admin-key
        self._streams: dict[str, asyncio.Task] = {}  # discovered instance id -> its KV-event loop
        self.discovery = None if opts.discovery is None else Discovery(
            opts, self.router, self.metrics, self.trust.secret, self._attach, self._detach)
        self.router.discovery = self.discovery
        self._check_exposure()
        self.transfers = Transfers(opts, self.trust, self.metrics)
        self._tasks: list[asyncio.Task] = []
        self.loops = {"health_checks": LoopHealth("proxy health checks")}
        if opts.proxy_port:
            self.loops["notifications"] = LoopHealth("proxy notifications (--proxy-port)")
        self.gate = limits.Gate(opts.max_in_flight, board)
        if self.discovery is not None:
            self.loops["discovery"] = LoopHealth(f"discovery ({self.discovery.target})")
        self.load_interval = opts.load_interval if opts.load_interval is not None else \
            0.5 if opts.discovery else 0.0
        if self.load_interval:
            self.loops["load_scrape"] = LoopHealth("engine load scrapes (/metrics)")
        for iid in self.router.cache.streams:
            self.loops[f"kv_events_{iid}"] = LoopHealth(f"KV events of {iid}")
        try:
            tokens = PromptTokens(opts.tokenizer)
        except (OSError, ValueError, ImportError) as e:
            raise OptionError(f"--tokenizer {opts.tokenizer}: cannot load it ({type(e).__name__}: {e}); give the "
                              "model's path or name, or leave it unset (text prompts are then routed by "
                              "load)") from None
        ctx = Context(opts, self.metrics, self.router, self.transfers, BodyReader(opts), tokens, peers)
        self.completions, self.chat = Completions(ctx), Chat(ctx)
        self.admin = Admin(ctx, self.loops)
        self.routes = self._route_table()

    @property
    def notify_host(self) -> str:
        return notify_host(self.opts)

    def _check_exposure(self) -> None:
        """The admin API beyond loopback without an admin key: an error. Other unprotected
        surfaces beyond loopback: a warning, or (--require-cluster-secret) an error."""
        o = self.opts
        if o.admin and not o.admin_key and not is_loopback(o.host):
            raise OptionError(f"the admin API (/admin/*) would listen on {o.host or '*'}, beyond loopback, without an "
                              "admin key: anyone who reaches it could add, drain and remove instances, and so choose "
                              "where prompts and their KV go. Set --admin-key (or KVFERRY_ADMIN_KEY; `kvferry "
                              "secret` makes one), or --no-admin, or listen on 127.0.0.1")
        try:
            if self.discovery is not None and self.trust.secret is None and not o.insecure_discovery:
                beyond = [h for h in (o.host, self.discovery.target.host) if h and not is_loopback(h)]
                if beyond:
                    raise OptionError(f"--discovery with {beyond[0]} beyond loopback needs the cluster secret: "
                                      "entries are trusted only when signed with it. Set --cluster-secret-file "
                                      "(or KVFERRY_CLUSTER_SECRET_FILE), or --insecure-discovery")
            if o.proxy_port:
                zsock.check_exposure(self.notify_host, "--proxy-port", self.trust,
                                     fix="Set --cluster-secret-file (or KVFERRY_CLUSTER_SECRET_FILE)")
            for url, eps in o.kv_events.items():
                for ep in eps:
                    if ep and ep.startswith("tcp://"):
                        zsock.warn_exposed(
                            urlsplit(ep).hostname or "", f"the KV event publisher of {url} (--kv-events {ep})",
                            self.trust.secret is not None, o.require_cluster_secret, "a cluster secret",
                            "prompts' token ids cross the network in the clear, and anyone can feed this proxy's "
                            "routing", "Relay them with the instance's kv_events_relay_port and set the cluster "
                            "secret on both sides (docs/deploy.md \"Network\")")
        except zsock.ExposureError as e:
            raise OptionError(str(e)) from None

    def _route_table(self) -> Routes:
        routes = Routes()
        routes.add("POST", "/v1/completions", self.completions.handle)
        routes.add("POST", "/v1/chat/completions", self.chat.handle)
        routes.add("GET", "/v1/models", self.models)
        self.admin.routes(routes)
        return routes

    async def start(self) -> None:
        """The background loops (before the first request is served)."""
        if self.opts.proxy_port:
            self.transfers.bind()  # now, so a port in use is a start-up error, not a loop's
        self.client.start()
        self._tasks.append(asyncio.ensure_future(supervise(self.loops["health_checks"], self._health_loop)))
        if self.opts.proxy_port:
            self._tasks.append(asyncio.ensure_future(supervise(self.loops["notifications"], self._notifications)))
        if self.discovery is not None:
            self._tasks.append(asyncio.ensure_future(supervise(self.loops["discovery"], self._discovery_loop)))
        if self.load_interval:
            self._tasks.append(asyncio.ensure_future(supervise(self.loops["load_scrape"], self._load_loop)))
        probe = max(0.2, self.opts.kv_events_stale_after / 4)
        for iid, stream in list(self.router.cache.streams.items()):
            if iid in self._streams:
                continue
            self._streams[iid] = asyncio.ensure_future(
                supervise(self.loops[f"kv_events_{iid}"], functools.partial(stream.run, probe)))
            inst = self.router.registry.instances.get(iid)
            if inst is not None:  # removed through the admin API: its loop and /health entry go too
                inst.when_removed(functools.partial(self._detach, inst))

    def _attach(self, inst: Instance) -> None:
        """A discovered instance joined: follow its KV events (once the app runs)."""
        stream = self.router.cache.streams.get(inst.id)
        if stream is None:
            return
        health = self.loops[f"kv_events_{inst.id}"] = LoopHealth(f"KV events of {inst.id}")
        probe = max(0.2, self.opts.kv_events_stale_after / 4)
        self._streams[inst.id] = asyncio.ensure_future(supervise(health, functools.partial(stream.run, probe)))

    def _detach(self, inst: Instance) -> None:
        """An instance left: its KV-event loop stops (the router drops stream and index)."""
        self.loops.pop(f"kv_events_{inst.id}", None)
        task = self._streams.pop(inst.id, None)
        if task is not None:
            task.cancel()

    async def _discovery_loop(self) -> None:
        assert self.discovery is not None
        await self.discovery.run(self.loops["discovery"])

    async def _load_loop(self) -> None:
        health = self.loops["load_scrape"]
        while True:
            await self.router.scrape_load(min(PROBE_S, self.load_interval * 2))
            health.recovered()
            await asyncio.sleep(self.load_interval)

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._streams.values(), *self.router.probes()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()
        if self.discovery is not None:
            await self.discovery.close()
        self.transfers.close()
        for stream in self.router.cache.streams.values():
            stream.close()
        if self.tracer is not None:  # the spans still batched go out now
            await asyncio.to_thread(self.tracer.shutdown)

    # ---- background (each under supervise(): a loop that raises is logged and started again) ----
    async def _health_loop(self) -> None:
        health = self.loops["health_checks"]
        while True:
            await self.router.check_all()
            health.recovered()
            await asyncio.sleep(self.opts.health_interval)

    async def _notifications(self) -> None:
        await self.transfers.notifications(self.loops["notifications"])

    def refusal(self, method: str, path: str, headers: CIMultiDict[str]) -> Response | None:
        """The answer to a request its head alone refuses, or None. /v1/*: the API key. /admin/*:
        the admin key, and only it (a client's --api-key never opens it: with --api-key and no
        --admin-key the admin API is closed); without keys (loopback only: _check_exposure) a
        Host that is not one of this proxy's names (a request with two Host lines names none); with
        or without, a state change a browser marks as cross-site (common/http/guard.py).

        An admin POST body is read as JSON whatever its Content-Type says, as the controller's is
        (`curl -d` sends a form type): a Content-Type rule would not stop a cross-site drain, whose
        POST has no body, so the Origin rule, which every browser's non-GET request meets, is the
        one that does (a text/plain POST from another site included)."""
        if path in ("/health", "/metrics"):
            return None
        o = self.opts
        if self.opts.admin and (path == "/admin" or path.startswith("/admin/")):
            if o.admin_key:
                if not cluster_secret.authorized(headers.get("Authorization"), o.admin_key):
                    return json_response(error_body(401, "missing or wrong admin key (Authorization: Bearer ...)",
                                                    "unauthorized"), 401)
            elif o.api_key:
                return json_response(error_body(
                    403, "the admin API is closed: this proxy has a client --api-key and no admin key, and a client "
                         "key never opens it. Start it with --admin-key KEY (or env KVFERRY_ADMIN_KEY) and send "
                         "'Authorization: Bearer KEY'", "admin_closed"), 403)
            host = http_guard.one_host(headers.getall("Host", ()))  # the front door answered two with 400
            why = http_guard.refusal(method, host, headers.get("Origin"), headers.get("Sec-Fetch-Site"),
                                     None if o.admin_key else self.hosts)
            if why is not None:
                return json_response(error_body(403, why, "forbidden"), 403)
            return None
        if o.api_key and not cluster_secret.authorized(headers.get("Authorization"), o.api_key):
            return json_response(error_body(401, "missing or wrong API key (Authorization: Bearer ...)",
                                            "unauthorized"), 401)
        return None

    def refuse_head(self, method: str, path: str, headers: CIMultiDict[str]) -> Response | None:
        """The answer to a request whose body is still to come that its head refuses, counted:
        refusal()'s, then no route or no such method on it (404, 405). The server then closes the
        connection, the body unread; an `Expect: 100-continue` client never sends it."""
        refused = self.refusal(method, path, headers)
        if refused is None:
            refused = self._unrouted(method, path)
        if refused is not None:
            self.metrics.requests.labels(path if path.startswith("/v1/") else "other", str(refused.status)).inc()
        return refused

    def _unrouted(self, method: str, path: str) -> Response | None:
        """404 for a path no route serves, 405 (with Allow) for a method it does not take, else None."""
        handler, _, allowed = self.routes.match(method, path)
        if handler is not None:
            return None
        if allowed:
            return json_response(error_body(405, f"{method} is not allowed on {path}", "bad_method"), 405,
                                 {"Allow": ", ".join(allowed)})
        return json_response(error_body(404, f"no route {path}", "not_found"), 404)

    async def handle(self, request: Request) -> Answer:
        """Every request: its X-Request-Id (the client's, checked, or a fresh one: on its log lines,
        its legs and its answer), its span when tracing is on, then `guarded`."""
        rid = request.rid = trace_context.request_id(request.headers.get("X-Request-Id"))
        REQUEST_ID.set(rid)  # this request's task's own copy: its log lines name it
        tracer = self.tracer  # the API's requests are traced, not /health, /metrics, /admin
        if tracer is not None and request.path.startswith("/v1/"):
            resp = await tracer.request(request, rid, self.guarded)
        else:
            resp = await self.guarded(request)
        if isinstance(resp, Response):
            resp.headers = {**resp.headers, "X-Request-Id": rid} if resp.headers else {"X-Request-Id": rid}
        return resp

    async def guarded(self, request: Request) -> Answer:
        """Keys and browser rules (refusal), its route, --max-in-flight, and no traceback ever
        reaches a client."""
        if self.peers is not None:  # --workers N: the other workers' admin changes first
            self.peers.sync(self.admin.apply)
        path = request.path
        endpoint = path if path.startswith("/v1/") else "other"
        refused = None if request.checked else self.refusal(request.method, path, request.headers)
        if refused is not None:
            self.metrics.requests.labels(endpoint, str(refused.status)).inc()
            return refused
        handler, request.match_info, _ = self.routes.match(request.method, path)
        if handler is None:
            unrouted = self._unrouted(request.method, path)
            assert unrouted is not None
            self.metrics.requests.labels(endpoint, str(unrouted.status)).inc()
            return unrouted
        gated = endpoint != "other"
        if gated and not self.gate.enter():
            self.metrics.requests.labels(endpoint, "503").inc()
            self.metrics.errors.labels("overloaded", "proxy").inc()
            return json_response(error_body(503, f"the proxy is handling {self.gate.limit} requests "
                                                 "(--max-in-flight); retry shortly", "overloaded"), 503,
                                 {"Retry-After": str(limits.RETRY_AFTER_S)})
        try:
            resp = await handler(request)
        except ProxyError as e:
            resp = e.response()
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.requests.labels(endpoint, "499").inc()
            raise
        except Exception as e:  # noqa: BLE001 - the client gets a JSON error, the log the traceback
            logger.exception("proxy error on %s", request.path)
            resp = json_response(error_body(500, f"internal proxy error: {type(e).__name__}", "internal"), 500)
        finally:
            if gated:
                self.gate.leave()
        self.metrics.requests.labels(endpoint, str(resp.status)).inc()
        return resp

    async def models(self, request: Request) -> Response:
        """The first usable instance's /v1/models, decoders first."""
        for role in ("decoder", "prefiller"):
            for inst in self.router.registry.of(role):
                if inst.usable:
                    with Upstream(self.router, inst, leg="models") as up:
                        status, body = await up.get("/v1/models")
                    return Response(body, status)
        raise ProxyError(503, "no healthy instance to list models from", "no_instance")
