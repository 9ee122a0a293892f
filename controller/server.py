"""`kvferry-controller`: the P2P cluster's registry, lookup service, mover and web page.

Sockets (seed 003's `--monitor-ports`):

- pull (PULL): workers' registrations, heartbeats, chunk admissions/evictions, transfer reports;
- heartbeat (PULL, optional): the same messages, for deployments that split heartbeats off;
- reply (ROUTER): the schedulers' lookups ("who holds the longest prefix of these chunks?");
- each worker's `lmcache_worker_ports` (the controller's DEALER): move, drop, clear, resync;
- `--port` (HTTP): seed 001's API (`/lookup`, `/move`, `/clear`, `/health`, ...) and the page.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from kvferry.common import messages as m
from kvferry.common.log import get_logger
from kvferry.common.netutil import zmq_host
from kvferry.controller import page
from kvferry.controller.registry import LOCATIONS, Registry, RegistryError, Worker

logger = get_logger(__name__)

RESYNC_AFTER = 3  # heartbeats whose chunk count disagrees with the index before a resync


class Controller:
    def __init__(self, host: str, port: int, monitor_ports: dict[str, int], command_timeout: float = 120.0,
                 sweep_interval: float = 0.5) -> None:
        self.host, self.port, self.ports = host, port, monitor_ports
        self.command_timeout, self.sweep_interval = command_timeout, sweep_interval
        self.registry = Registry()
        self.ctx = zmq.asyncio.Context()
        self.moves: dict[str, dict[str, Any]] = {}
        # One command at a time per worker; a socket is dropped (and made again) after a timeout, so
        # a late answer is never read as the next command's.
        self._cmd: dict[tuple[str, int, str], zmq.asyncio.Socket] = {}
        self._cmd_locks: dict[tuple[str, int, str], asyncio.Lock] = {}
        self._mismatch: dict[tuple[str, int], int] = {}
        self._tasks: list[asyncio.Task] = []
        self._socks: list[zmq.asyncio.Socket] = []
        self._runner: web.AppRunner | None = None

    # ---- lifecycle ----
    async def start(self) -> None:
        bind_host = zmq_host(self.host)
        for name in ("pull", "heartbeat"):
            if self.ports.get(name):
                s = self._bind(zmq.PULL, bind_host, self.ports[name], name)
                self._tasks.append(asyncio.create_task(self._pull_loop(s)))
        rep = self._bind(zmq.ROUTER, bind_host, self.ports["reply"], "reply")
        self._tasks.append(asyncio.create_task(self._reply_loop(rep)))
        self._tasks.append(asyncio.create_task(self._sweep_loop()))
        app = web.Application(client_max_size=64 << 20)
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
        logger.info("kvferry controller: web page and API on http://%s:%d/, pull %d, reply %d%s", self.host,
                    self.port, self.ports["pull"], self.ports["reply"],
                    f", heartbeat {self.ports['heartbeat']}" if self.ports.get("heartbeat") else "")

    def _bind(self, kind: int, host: str, port: int, name: str) -> zmq.asyncio.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)
        try:
            s.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            s.close()
            raise SystemExit(f"kvferry-controller: cannot bind the {name} port {port} on {host} ({e}): "
                             f"pick another one in --monitor-ports and in the workers' controller_{name}_url") from None
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
    async def _pull_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv()
            try:
                msg = m.decode(frame, expect=(m.RegisterWorker, m.Heartbeat, m.DeregisterWorker, m.ChunkAdmit,
                                              m.ChunkEvict, m.TransferReport))
            except m.MessageError as e:
                logger.warning("dropped a bad message on the pull port: %s", e)
                continue
            self.handle(msg)

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
            bad = self._mismatch.get(key, 0) + 1 if msg.num_chunks != len(w.chunks) else 0
            self._mismatch[key] = bad
            if (not known and msg.num_chunks) or bad >= RESYNC_AFTER:
                # A restarted controller, or reports lost: the worker sends its whole list again.
                self._mismatch[key] = 0
                self._spawn(self._command(w, m.Resync(event_id=_new_id())))
        elif isinstance(msg, m.DeregisterWorker):
            reg.deregister(msg.instance_id, msg.worker_id, msg.epoch)
        elif isinstance(msg, m.ChunkAdmit):
            reg.admit(msg)
        elif isinstance(msg, m.ChunkEvict):
            reg.evict(msg)
        elif isinstance(msg, m.TransferReport):
            reg.record_transfer(msg)

    async def _reply_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            parts = await sock.recv_multipart()
            if len(parts) < 2:
                continue
            try:
                msg = m.decode(parts[-1], expect=m.LookupRequest)
                reply: m.Msg = self.registry.lookup(msg.keys, asker=msg.instance_id)
            except m.MessageError as e:
                reply = m.ErrorReply(code="bad_message", message=str(e)[:4000])
            await sock.send_multipart([*parts[:-1], m.encode(reply)])

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval)
            self.registry.expire()
            live = {(i.id, w.info.worker_id, w.info.epoch) for i in self.registry.instances.values()
                    for w in i.workers.values()}
            for k in [k for k, lock in self._cmd_locks.items() if k not in live and not lock.locked()]:
                self._cmd_locks.pop(k)
                if k in self._cmd:
                    self._cmd.pop(k).close(linger=0)

    # ---- commands to workers ----
    async def _command(self, w: Worker, cmd: m.Msg) -> m.CommandResult:
        """Send one command to a worker and wait (bounded) for its result."""
        k = (w.info.instance_id, w.info.worker_id, w.info.epoch)
        async with self._cmd_locks.setdefault(k, asyncio.Lock()):
            sock = self._cmd.get(k)
            if sock is None:
                sock = self._cmd[k] = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{zmq_host(w.info.host)}:{w.info.worker_port}")
            await sock.send(m.encode(cmd))
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
                    return m.CommandResult(event_id=cmd.event_id, ok=False, message=f"bad answer: {e}")
                if res.event_id == cmd.event_id:
                    return res

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
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
    async def _page(self, _: web.Request) -> web.Response:
        return web.Response(text=page.render(self.registry.state()), content_type="text/html")

    async def _state(self, _: web.Request) -> web.Response:
        return web.json_response(self.registry.state())

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "instances": sorted(self.registry.instances)})

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
    args = p.parse_args(argv)
    try:
        args.monitor_ports = parse_monitor_ports(args.monitor_ports)
    except ValueError as e:
        p.error(str(e))
    return args


async def serve(args: argparse.Namespace) -> None:
    c = Controller(args.host, args.port, args.monitor_ports, args.command_timeout)
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
        asyncio.run(serve(args))
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
