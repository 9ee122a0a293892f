"""kvferry's OpenAI-facing disaggregation proxy: `serve` and `main`.

Per request: pick a prefiller and a decoder (routing/), run the prompt on the prefiller with
max_tokens=1 and kv_transfer_params naming the decoder's receiver (flows/prefill.py,
openai/legs.py), send the first token to the client at once, then stream the decoder's
continuation as one well-formed OpenAI stream (flows/). docs/architecture.md names the file of
each step.

No client `kv_transfer_params` ever reaches an engine: the proxy alone chooses where KV goes (a
client's would point a prefiller's sender at any host). An upstream failure is logged (role, URL,
leg, cause), counted, and answered by an immediate /health probe of that instance, which ejects it
when the probe fails too; the health loop re-admits it. The background loops run supervised
(shown on /health). The proxy imports neither torch nor vLLM.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
import sys
from collections.abc import Callable

from kvferry.common import netutil as net
from kvferry.common import zsock
from kvferry.common.http import connections as http_conns
from kvferry.common.log import configure_logging, get_logger
from kvferry.proxy.app import Proxy
from kvferry.proxy.http.exchange import error_body
from kvferry.proxy.http.front_door import Bounds, FrontDoor, close_idle
from kvferry.proxy.instance_flags import OptionError
from kvferry.proxy.multiproc.admin_log import Peers
from kvferry.proxy.multiproc.board import LoadBoard
from kvferry.proxy.multiproc.supervisor import Supervisor
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.options import ProxyOptions, parse

__all__ = ["Proxy", "ProxyError", "main", "serve"]

logger = get_logger(__name__)

GC_THRESHOLD = 20_000  # young objects between collections (Python's default: 700)


async def serve(opts: ProxyOptions, board: LoadBoard | None = None, peers: Peers | None = None,
                worker: int | None = None, ready: Callable[[], None] | None = None) -> None:
    """Run the proxy on --host/--port until SIGINT or SIGTERM; `worker`: one of --workers N
    (proxy/multiproc/supervisor.py), which binds the port with SO_REUSEPORT beside its peers."""
    proxy = Proxy(opts, board, peers)
    await proxy.start()
    loop = asyncio.get_running_loop()
    doors: set[FrontDoor] = set()

    limit = opts.max_connections or http_conns.default_max_connections()
    busy = http_conns.busy_answer(error_body(503, f"the proxy has {limit} connections open (--max-connections); "
                                                  "retry shortly", "too_many_connections"))
    conns = http_conns.Conns(opts.request_timeout, limit, busy, "kvferry-proxy",
                             lambda reason: proxy.metrics.dropped_connections.labels(reason).inc())
    bounds = Bounds(conns, proxy.refuse_head)

    def door() -> FrontDoor:
        return FrontDoor(proxy.handle, opts.max_body_bytes, doors, bounds)
    try:
        server = await loop.create_server(door, net.unbracket(opts.host), opts.port, reuse_address=True,
                                          reuse_port=worker is not None, backlog=128)
    except OSError as e:
        await proxy.stop()
        raise OptionError(f"--host/--port: cannot listen on {net.hostport(opts.host, opts.port)}: "
                          f"{zsock.bind_cause(e.errno, opts.host, opts.port)}") from None
    _calm_gc()
    sweep = loop.create_task(close_idle(doors, opts.stall_timeout, conns, opts.keep_alive_timeout))
    if ready is not None:
        ready()
    if worker is None or worker == 0:
        logger.info("kvferry proxy on %s: %d prefillers, %d decoders, policy %s, admin API %s, ZMQ %s, %d "
                    "connections at most%s", "http://" + net.hostport(opts.host, opts.port), len(opts.prefillers),
                    len(opts.decoders), opts.policy, "off" if not opts.admin else "behind --admin-key"
                    if opts.admin_key else "closed (--api-key, no --admin-key)" if opts.api_key else
                    "open to loopback callers (no --admin-key)", "with the cluster secret (CurveZMQ)"
                    if proxy.trust.secret is not None else "without a cluster secret", limit,
                    " per worker" if worker is not None else "")
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        sweep.cancel()
        tasks = [d.task for d in doors if d.task is not None]
        for d in list(doors):
            d.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await proxy.stop()


def _calm_gc() -> None:
    """What start-up made lives as long as the proxy: the collector stops scanning it (gc.freeze),
    and it runs less often (a request's short-lived dicts and lists set it off, and every
    collection costs CPU on the hot path)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 20, 20)


def _use_uvloop() -> None:
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


def _worker(opts: ProxyOptions, board: LoadBoard, peers: Peers, index: int, ready: Callable[[], None]) -> int:
    """One worker of --workers N, in its own process: its exit status."""
    _use_uvloop()
    try:
        asyncio.run(serve(opts, board, peers, index, ready))
    except OptionError as e:
        print(f"kvferry-proxy: error: {e}", file=sys.stderr)
        return 2
    return 0


def _port_free(opts: ProxyOptions) -> None:
    """Is --port free? (SO_REUSEPORT alone would let the workers join another server on it.)"""
    host = net.unbracket(opts.host)
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, opts.port))
    except OSError as e:
        raise OptionError(f"--host/--port: cannot listen on {net.hostport(opts.host, opts.port)}: "
                          f"{zsock.bind_cause(e.errno, opts.host, opts.port)}") from None
    finally:
        s.close()


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse(argv)
        configure_logging()
        if opts.workers > 1:
            _port_free(opts)
            return Supervisor(opts, opts.workers, _worker).run()
        _use_uvloop()
        asyncio.run(serve(opts))
    except OptionError as e:
        print(f"kvferry-proxy: error: {e}", file=sys.stderr)
        return 2
    return 0
