"""`kvferry-controller`: the P2P cluster's registry, lookup service, mover and web page.

Sockets (seed 003's `--monitor-ports`):

- pull (PULL): workers' registrations, heartbeats, chunk admissions/evictions, transfer reports;
- heartbeat (PULL, optional): the same messages, for deployments that split heartbeats off;
- reply (ROUTER): the schedulers' lookups ("who holds the longest prefix of these chunks?");
- each worker's `lmcache_worker_ports` (the controller's DEALER): move, drop, clear, resync;
- `--port` (HTTP): seed 001's API (`/lookup`, `/move`, `/clear`, `/health`, ...) and the page.

Trust (DESIGN.md "Trust", docs/security.md): with a cluster secret (`--cluster-secret-file`, or
KVFERRY_CLUSTER_SECRET / KVFERRY_CLUSTER_SECRET_FILE) every ZMQ socket speaks CurveZMQ, so a
worker without the secret gets no frame through either way. With an admin key (`--admin-key` or
KVFERRY_ADMIN_KEY) every HTTP endpoint but `/health` needs it (Bearer, or Basic with the key as
the password). Without them a loopback controller serves as LMCache's does; beyond loopback each
missing one is a warning, or a one-line error under `--require-cluster-secret`.

Nothing a worker sends can stop the controller: a frame that does not decode, or a message that
cannot be applied, is logged (rate-limited) and counted; every loop runs under a supervisor and
shows its state in `/health`; the registry is bounded (controller/registry.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from kvferry.common import messages as m
from kvferry.common import secret as csecret
from kvferry.common import zsock
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.supervise import LoopHealth, supervise
from kvferry.controller import page
from kvferry.controller.registry import LOCATIONS, Registry, RegistryError, Worker

logger = get_logger(__name__)

RESYNC_AFTER = 3  # heartbeats whose chunk count disagrees with the index before a resync
REALM = "kvferry-controller"
PORTS = "kvferry-controller (--monitor-ports)"  # one exposure warning for all of them
WORKER_MSGS = (m.RegisterWorker, m.Heartbeat, m.DeregisterWorker, m.ChunkAdmit, m.ChunkEvict, m.TransferReport)


class Controller:
    def __init__(self, host: str, port: int, monitor_ports: dict[str, int], command_timeout: float = 120.0,
                 sweep_interval: float = 0.5, trust: zsock.Trust = zsock.PLAIN, admin_key: str | None = None) -> None:
        self.host, self.port, self.ports = host, port, monitor_ports
        self.command_timeout, self.sweep_interval = command_timeout, sweep_interval
        self.trust = trust
        self._admin_key = admin_key or None
        self.registry = Registry()
        self.ctx = zmq.asyncio.Context()
        # What workers and HTTP clients got wrong; shown in /health.
        self.counters = {"bad_frames": 0, "rejected_messages": 0, "bad_lookups": 0, "failed_commands": 0,
                         "unauthorized_http": 0}
        self.health: dict[str, LoopHealth] = {}
        self._bad_frame_log, self._apply_log = RateLimitedLog(logger), RateLimitedLog(logger)
        self._command_log = RateLimitedLog(logger)
        self.moves: dict[str, dict[str, Any]] = {}
        # One command at a time per worker; a socket is dropped (and made again) after a timeout, so
        # a late answer is never read as the next command's.
        self._cmd: dict[tuple[str, int, str], zmq.asyncio.Socket] = {}
        self._cmd_locks: dict[tuple[str, int, str], asyncio.Lock] = {}
        self._mismatch: dict[tuple[str, int], int] = {}
        self._resyncing: set[tuple[str, int, str]] = set()  # one Resync in flight per worker at most
        self._tasks: list[asyncio.Task] = []
        self._socks: list[zmq.asyncio.Socket] = []
        self._runner: web.AppRunner | None = None

    # ---- lifecycle ----
    def check_exposure(self) -> None:
        """Warn (or, with require, SystemExit in one line) for ports beyond loopback left open."""
        try:
            zsock.check_exposure(self.host, PORTS, self.trust,
                                 fix="Start it with --cluster-secret-file (the workers' cluster_secret_file)")
            zsock.warn_exposed(self.host, f"kvferry-controller's HTTP API (port {self.port})",
                               self._admin_key is not None, self.trust.require, "an admin key",
                               "anyone who reaches it can /move and /clear every instance's KV cache",
                               "Set --admin-key (or KVFERRY_ADMIN_KEY)")
        except zsock.ExposureError as e:
            raise SystemExit(f"kvferry-controller: {e}") from None

    async def start(self) -> None:
        self.check_exposure()
        for name in ("pull", "heartbeat"):
            if self.ports.get(name):
                s = self._bind(zmq.PULL, self.ports[name], name)
                self._loop(name, lambda s=s, name=name: self._pull_loop(s, name))
        rep = self._bind(zmq.ROUTER, self.ports["reply"], "reply")
        self._loop("reply", lambda: self._reply_loop(rep))
        self._loop("sweep", self._sweep_loop)
        app = web.Application(client_max_size=64 << 20, middlewares=[self._auth])
        app.add_routes([
            web.get("/", self._page), web.get("/api/state", self._state), web.get("/health", self._health),
            web.post("/lookup", self._lookup), web.post("/move", self._move), web.get("/move/{event_id}", self._status),
            web.post("/check_finish", self._check_finish), web.post("/clear", self._clear),
        ])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError as e:
            raise SystemExit(f"kvferry-controller: cannot serve HTTP on {self.host}:{self.port} ({e}): "
                             "pick a free --port") from None
        logger.info("kvferry controller: web page and API on http://%s:%d/, pull %d, reply %d%s; %s, %s", self.host,
                    self.port, self.ports["pull"], self.ports["reply"],
                    f", heartbeat {self.ports['heartbeat']}" if self.ports.get("heartbeat") else "",
                    "CurveZMQ with the cluster secret" if self.trust.secret else "plain ZMQ (no cluster secret)",
                    "admin key required" if self._admin_key else "no admin key")

    def _loop(self, name: str, fn) -> None:  # noqa: ANN001 - a coroutine function
        health = self.health[name] = LoopHealth(f"kvferry-controller {name} loop")
        self._tasks.append(asyncio.create_task(supervise(health, fn)))

    def _bind(self, kind: int, port: int, name: str) -> zmq.asyncio.Socket:
        try:
            # check_exposure() already judged the host (one warning for all ports, with the fix).
            s = zsock.listen(self.ctx, kind, self.trust, self.host, port, PORTS)
        except zsock.BindError as e:
            raise SystemExit(f"kvferry-controller: the {name} port: {e} (in --monitor-ports, and the workers' "
                             f"controller_{name}_url)") from None
        self._socks.append(s)
        return s

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._runner is not None:
            await self._runner.cleanup()
        for s in self._cmd.values():
            s.close(linger=0)
        for s in self._socks:
            s.close(linger=0)
        self.ctx.term()

    # ---- worker messages ----
    async def _pull_loop(self, sock: zmq.asyncio.Socket, name: str) -> None:
        health = self.health[name]
        while True:
            frame = await sock.recv()
            health.recovered()
            try:
                msg = m.decode(frame, expect=WORKER_MSGS)
            except m.MessageError as e:
                self.counters["bad_frames"] += 1
                self._bad_frame_log.warning("dropped a bad message on the %s port: %s", name, e)
                continue
            try:
                self.handle(msg)
            except Exception as e:  # noqa: BLE001 - one worker's message must not stop the controller
                self.counters["rejected_messages"] += 1
                self._apply_log.warning("dropped a %s from instance %s on the %s port: %s%s", type(msg).__name__,
                                        _sender(msg), name, e if isinstance(e, RegistryError) else
                                        f"{type(e).__name__}: {e}", "" if isinstance(e, RegistryError) else
                                        " (a controller bug: please report it)")

    def handle(self, msg: m.Msg) -> None:
        reg = self.registry
        if isinstance(msg, m.RegisterWorker):
            reg.register(msg.worker)
        elif isinstance(msg, m.Heartbeat):
            info = msg.worker
            known = reg.worker(info.instance_id, info.worker_id, info.epoch) is not None
            w = reg.heartbeat(msg)
            if w is None:
                return
            key = (info.instance_id, info.worker_id)
            # A worker with keys left out of the index (a bound) disagrees for good: no resync storm.
            bad = self._mismatch.get(key, 0) + 1 if msg.num_chunks != len(w.chunks) and not w.capped else 0
            self._mismatch[key] = bad
            if (not known and msg.num_chunks) or bad >= RESYNC_AFTER:
                # A restarted controller, or reports lost: the worker sends its whole list again.
                self._mismatch[key] = 0
                self._resync(w)
        elif isinstance(msg, m.DeregisterWorker):
            reg.deregister(msg.instance_id, msg.worker_id, msg.epoch)
        elif isinstance(msg, m.ChunkAdmit):
            reg.admit(msg)
        elif isinstance(msg, m.ChunkEvict):
            reg.evict(msg)
        elif isinstance(msg, m.TransferReport):
            reg.record_transfer(msg)

    def _resync(self, w: Worker) -> None:
        k = (w.info.instance_id, w.info.worker_id, w.info.epoch)
        if k in self._resyncing:
            return  # one is on its way (or waiting out --command-timeout): do not pile them up
        self._resyncing.add(k)

        async def run() -> None:
            try:
                res = await self._command(w, m.Resync(event_id=_new_id()))
                if not res.ok:
                    self._command_log.warning("resync of instance %s worker %d failed: %s", w.info.instance_id,
                                              w.info.worker_id, res.message)
            finally:
                self._resyncing.discard(k)

        self._spawn(run())

    async def _reply_loop(self, sock: zmq.asyncio.Socket) -> None:
        health = self.health["reply"]
        while True:
            parts = await sock.recv_multipart()
            health.recovered()
            if len(parts) < 2:
                continue
            try:
                msg = m.decode(parts[-1], expect=m.LookupRequest)
                reply: m.Msg = self.registry.lookup(msg.keys, asker=msg.instance_id)
            except m.MessageError as e:
                self.counters["bad_lookups"] += 1
                self._bad_frame_log.warning("answered a bad message on the reply port with an error: %s", e)
                reply = m.ErrorReply(code="bad_message", message=str(e)[:4000])
            except Exception as e:  # noqa: BLE001 - one lookup must not stop the controller
                self.counters["bad_lookups"] += 1
                self._apply_log.warning("a lookup failed: %s: %s (a controller bug: please report it)",
                                        type(e).__name__, e)
                reply = m.ErrorReply(code="internal", message=f"the controller failed on this lookup: {e}"[:4000])
            await sock.send_multipart([*parts[:-1], m.encode(reply)])

    async def _sweep_loop(self) -> None:
        health = self.health["sweep"]
        while True:
            await asyncio.sleep(self.sweep_interval)
            self.registry.expire()
            live = {(i.id, w.info.worker_id, w.info.epoch) for i in self.registry.instances.values()
                    for w in i.workers.values()}
            for k in [k for k, lock in self._cmd_locks.items() if k not in live and not lock.locked()]:
                self._cmd_locks.pop(k)
                if k in self._cmd:
                    self._cmd.pop(k).close(linger=0)
            ranks = {(i, r) for i, r, _ in live}
            for k in [k for k in self._mismatch if k not in ranks]:
                del self._mismatch[k]
            health.recovered()

    # ---- commands to workers ----
    async def _command(self, w: Worker, cmd: m.Msg) -> m.CommandResult:
        """Send one command to a worker and wait (bounded) for its result; never raises."""
        try:
            return await self._command_once(w, cmd)
        except Exception as e:  # noqa: BLE001 - e.g. a host ZMQ cannot connect to: a failed command
            self.counters["failed_commands"] += 1
            return m.CommandResult(event_id=cmd.event_id, ok=False, message=(
                f"instance {w.info.instance_id} worker {w.info.worker_id} at {w.info.host}:{w.info.worker_port}: "
                f"{type(e).__name__}: {e}")[:4000])

    async def _command_once(self, w: Worker, cmd: m.Msg) -> m.CommandResult:
        k = (w.info.instance_id, w.info.worker_id, w.info.epoch)
        async with self._cmd_locks.setdefault(k, asyncio.Lock()):
            sock = self._cmd.get(k)
            if sock is None:
                # The worker names its host: resolve it off the event loop (a slow DNS answer must
                # not stall every other worker's messages).
                url = await asyncio.to_thread(zsock.tcp, w.info.host, w.info.worker_port)
                sock = zsock.connect(self.ctx, zmq.DEALER, self.trust, url)
                self._cmd[k] = sock
            try:  # bounded too: a worker gone (or refusing our secret) takes no frames
                await asyncio.wait_for(sock.send(m.encode(cmd)), self.command_timeout)
            except TimeoutError:
                self._cmd.pop(k, None)
                sock.close(linger=0)
                raise
            while True:  # skip results of commands that timed out earlier
                if not await sock.poll(int(self.command_timeout * 1000), zmq.POLLIN):
                    self._cmd.pop(k, None)
                    sock.close(linger=0)
                    return m.CommandResult(event_id=cmd.event_id, ok=False, message=(
                        f"instance {w.info.instance_id} worker {w.info.worker_id} did not answer within "
                        f"{self.command_timeout:g}s (--command-timeout)"))
                try:
                    res = m.decode(await sock.recv(), expect=m.CommandResult)
                except m.MessageError as e:
                    self.counters["failed_commands"] += 1
                    return m.CommandResult(event_id=cmd.event_id, ok=False, message=f"bad answer: {e}")
                if res.event_id == cmd.event_id:
                    return res

    def _spawn(self, coro) -> None:  # noqa: ANN001 - a coroutine
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a background command must never fail unobserved
                self.counters["failed_commands"] += 1
                self._command_log.warning("a background command failed: %s: %s", type(e).__name__, e)

        t = asyncio.create_task(guarded())
        self._tasks.append(t)
        t.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _run_move(self, ev: dict[str, Any], src, dst, keys: list[bytes], copy: bool) -> None:
        try:
            await self._move_chunks(ev, src, dst, keys, copy)
        except Exception as e:  # noqa: BLE001 - the event must end, whatever broke
            logger.exception("move %s failed", ev["event_id"])
            ev.update(status="failed", error=f"{type(e).__name__}: {e}")

    async def _move_chunks(self, ev: dict[str, Any], src, dst, keys: list[bytes], copy: bool) -> None:
        ev["status"] = "running"
        pairs = list(zip(src.ranks(), dst.ranks(), strict=True))
        pulls = await asyncio.gather(*[
            self._command(d, m.PullChunks(event_id=ev["event_id"], source_id=src.id, source=s.peer, keys=keys))
            for s, d in pairs])
        failed = [r.message for r in pulls if not r.ok]
        ev["nbytes"] = sum(r.nbytes for r in pulls)
        if not failed and not copy:
            drops = await asyncio.gather(*[self._command(s, m.DropChunks(event_id=ev["event_id"], keys=keys))
                                           for s, _ in pairs])
            failed = [f"copied, but the source kept it: {r.message}" for r in drops if not r.ok]
        ev["status"] = "failed" if failed else "done"
        if failed:
            ev["error"] = "; ".join(failed)
        self.registry.event("move", dst.id, f"{ev['num_tokens']} tokens from {src.id} ({'copy' if copy else 'move'})"
                             f": {ev['status']}" + (f" ({ev['error']})" if failed else ""))
        logger.info("move %s: %d tokens %s -> %s (%s): %s", ev["event_id"], ev["num_tokens"], src.id, dst.id,
                    "copy" if copy else "move", ev["status"] + (f" ({ev['error']})" if failed else ""))

    # ---- HTTP ----
    @web.middleware
    async def _auth(self, req: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001
        """With an admin key, everything but /health needs it: Bearer, or Basic with it as the password."""
        if self._admin_key is None or req.path == "/health" or \
                csecret.authorized(req.headers.get("Authorization"), self._admin_key):
            return await handler(req)
        self.counters["unauthorized_http"] += 1
        return web.json_response(
            {"error": "this kvferry-controller needs its admin key: send 'Authorization: Bearer <key>' (or HTTP "
                      "Basic auth with the key as the password); the key is its --admin-key / KVFERRY_ADMIN_KEY"},
            status=401, headers={"WWW-Authenticate": f'Basic realm="{REALM}"'})

    async def _page(self, _: web.Request) -> web.Response:
        return web.Response(text=page.render(self.registry.state()), content_type="text/html")

    async def _state(self, _: web.Request) -> web.Response:
        return web.json_response(self.registry.state())

    async def _health(self, _: web.Request) -> web.Response:
        """200 "ok", or 503 "degraded" while a loop keeps failing; its loops, counters and index size."""
        ok = all(h.ok for h in self.health.values())
        reg = self.registry
        return web.json_response({
            "status": "ok" if ok else "degraded", "instances": sorted(reg.instances),
            "loops": {name: h.describe() for name, h in self.health.items()}, "counters": self.counters,
            "index": {"workers": reg.num_workers, "max_workers": reg.max_workers, "chunks": reg.indexed,
                      "max_chunks": reg.max_chunks, "max_chunks_per_worker": reg.max_chunks_per_worker}},
            status=200 if ok else 503)

    async def _lookup(self, req: web.Request) -> web.Response:
        body = await _json(req)
        tokens = _tokens(body)
        info = self.registry.lookup_tokens(tokens)
        return web.json_response({"event_id": _new_id(),
                                  "layout_info": {i: ["LocalCPUBackend", n] for i, n in info.items()}})

    async def _move(self, req: web.Request) -> web.Response:
        body = await _json(req)
        tokens = _tokens(body)
        copy = body.get("copy", False)
        if not isinstance(copy, bool):
            raise _bad(f"copy must be true or false, got {copy!r}")
        try:
            src, dst, keys, num_tokens = self.registry.plan_move(body.get("old_position") or [],
                                                                 body.get("new_position") or [], tokens)
        except RegistryError as e:
            raise _bad(str(e)) from None
        ev = {"event_id": _new_id(), "status": "pending", "num_tokens": num_tokens, "from": src.id, "to": dst.id,
              "copy": copy}
        self.moves[ev["event_id"]] = ev
        while len(self.moves) > 1000:
            self.moves.pop(next(iter(self.moves)))
        if keys:
            self._spawn(self._run_move(ev, src, dst, keys, copy))
        else:
            ev["status"] = "done"
        return web.json_response({"num_tokens": num_tokens, "event_id": ev["event_id"]})

    def _event_status(self, event_id: str) -> web.Response:
        ev = self.moves.get(event_id)
        if ev is None:
            return web.json_response({"error": f"no move with event_id {event_id!r} (the controller keeps the "
                                               "last 1000)"}, status=404)
        return web.json_response(ev)

    async def _status(self, req: web.Request) -> web.Response:
        return self._event_status(req.match_info["event_id"])

    async def _check_finish(self, req: web.Request) -> web.Response:
        body = await _json(req)
        return self._event_status(str(body.get("event_id", "")))

    async def _clear(self, req: web.Request) -> web.Response:
        body = await _json(req)
        loc = body.get("location", "LocalCPUBackend")
        if loc not in LOCATIONS:
            raise _bad(f"location {loc!r} is not supported: use \"LocalCPUBackend\"")
        iid = body.get("instance_id")
        try:
            insts = [self.registry.instance(iid, "instance_id")] if iid else list(self.registry.instances.values())
        except RegistryError as e:
            raise _bad(str(e)) from None
        event_id = _new_id()
        results = await asyncio.gather(*[self._command(w, m.ClearChunks(event_id=event_id))
                                         for i in insts for w in i.ranks()])
        failed = [r.message for r in results if not r.ok]
        for i in insts:
            self.registry.event("clear", i.id, "CPU tier cleared" if not failed else "; ".join(failed))
        return web.json_response({"event_id": event_id, "status": "failed" if failed else "done",
                                  "num_chunks": sum(r.num_chunks for r in results),
                                  **({"error": "; ".join(failed)} if failed else {})},
                                 status=502 if failed else 200)


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


def _sender(msg: m.Msg) -> str:
    info = getattr(msg, "worker", None)
    iid = info.instance_id if info is not None else getattr(msg, "instance_id", "?")
    return repr(iid[:64])


def _bad(msg: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": msg}), content_type="application/json")


async def _json(req: web.Request) -> dict[str, Any]:
    try:
        body = await req.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _bad("the body is not JSON") from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    return body


def _tokens(body: dict[str, Any]) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31
                                               for t in tokens):
        raise _bad("tokens must be a list of token ids (POST /tokenize on the vLLM server gives them)")
    return tokens


def parse_monitor_ports(text: str) -> dict[str, int]:
    try:
        ports = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--monitor-ports is not JSON ({e}): e.g. '{{\"pull\": 8300, \"reply\": 8400}}'") from None
    if not isinstance(ports, dict):
        raise ValueError("--monitor-ports must be a JSON object such as '{\"pull\": 8300, \"reply\": 8400}'")
    unknown = set(ports) - {"pull", "reply", "heartbeat"}
    if unknown:
        raise ValueError(f"--monitor-ports: unknown key(s) {sorted(unknown)}; the keys are pull, reply, heartbeat")
    for k in ("pull", "reply"):
        if k not in ports:
            raise ValueError(f"--monitor-ports needs a {k!r} port (the workers' controller_{k}_url)")
    for k, v in ports.items():
        if not isinstance(v, int) or not 0 < v < 65536:
            raise ValueError(f"--monitor-ports {k}: {v!r} is not a port number")
    return ports


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvferry-controller", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="localhost", help="address for the HTTP API and the monitor ports")
    p.add_argument("--port", type=int, default=9000, help="HTTP port: the API and the web page")
    p.add_argument("--monitor-ports", default='{"pull": 8300, "reply": 8400}',
                   help='JSON: {"pull": P, "reply": R, "heartbeat": H}; the workers\' controller_pull_url and '
                        "controller_reply_url point at pull and reply")
    p.add_argument("--command-timeout", type=float, default=120.0,
                   help="seconds a worker may take to carry out one move/clear command")
    p.add_argument("--cluster-secret-file", default=None,
                   help="the cluster secret (the workers' cluster_secret_file): CurveZMQ on every monitor and "
                        "worker port; default: $KVFERRY_CLUSTER_SECRET or $KVFERRY_CLUSTER_SECRET_FILE")
    p.add_argument("--require-cluster-secret", action="store_true",
                   help="refuse to start on a --host beyond loopback without a cluster secret and an admin key "
                        "(otherwise: a warning)")
    p.add_argument("--admin-key", default=None,
                   help="key the HTTP API (all but /health) and the page need: 'Authorization: Bearer KEY' or "
                        "Basic auth with KEY as the password; default $KVFERRY_ADMIN_KEY (which, unlike this flag, "
                        "`ps` does not show)")
    args = p.parse_args(argv)
    try:
        args.monitor_ports = parse_monitor_ports(args.monitor_ports)
    except ValueError as e:
        p.error(str(e))
    if args.admin_key is None:
        args.admin_key = os.environ.get("KVFERRY_ADMIN_KEY") or None
    if args.admin_key is not None and not args.admin_key.strip():
        p.error("--admin-key is empty: give a key (e.g. `kvferry secret`), or leave the flag out")
    if not 0 < args.command_timeout <= 86400:
        p.error(f"--command-timeout {args.command_timeout}: give seconds in (0, 86400]")
    return args


async def serve(args: argparse.Namespace, trust: zsock.Trust = zsock.PLAIN) -> None:
    c = Controller(args.host, args.port, args.monitor_ports, args.command_timeout, trust=trust,
                   admin_key=args.admin_key)
    await c.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("kvferry controller: shutting down")
    await c.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        trust = zsock.Trust(csecret.from_env(args.cluster_secret_file, "kvferry-controller"),
                            args.require_cluster_secret)
    except csecret.SecretError as e:
        print(f"kvferry-controller: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args, trust))
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
