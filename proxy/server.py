"""kvferry's OpenAI-facing disaggregation proxy (DESIGN.md steps 1-3, 5-7): `serve` and `main`.

Per request: pick a prefiller and a decoder (routing.py), run the prompt on the prefiller with
max_tokens=1 and kv_transfer_params naming the decoder's receiver (prefill.py, legs.py), send the
first token to the client at once, then stream the decoder's continuation as one well-formed
OpenAI stream (streaming.py). completions.py and chat.py hold each endpoint's flow; admin.py the
proxy's own pages; transfers.py aborts and arrival notifications; upstream.py the requests to the
engines and their failures; app.py wires the parts into one aiohttp application.

No client `kv_transfer_params` ever reaches an engine: the proxy alone chooses where KV goes
(DESIGN.md "Trust"). An upstream failure is logged (role, URL, leg, cause), counted, and answered
by an immediate /health probe of that instance, which ejects it when the probe fails too; the
health loop re-admits it. The health loop and the notification reader run supervised (shown on
/health).

aiohttp on both sides (its client costs a fraction of httpx's CPU per request); imports neither
torch nor vLLM.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from aiohttp import web

from kvferry.common import netutil as net
from kvferry.common import zsock
from kvferry.common.log import get_logger
from kvferry.proxy.app import Proxy
from kvferry.proxy.errors import ProxyError
from kvferry.proxy.options import OptionError, ProxyOptions, parse

__all__ = ["Proxy", "ProxyError", "main", "serve"]

logger = get_logger(__name__)


async def serve(opts: ProxyOptions) -> None:
    """Run the proxy on --host/--port until SIGINT or SIGTERM."""
    proxy = Proxy(opts)
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, net.unbracket(opts.host), opts.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OptionError(f"--host/--port: cannot listen on {net.hostport(opts.host, opts.port)}: "
                          f"{zsock.bind_cause(e.errno, opts.host, opts.port)}") from None
    logger.info("kvferry proxy on %s: %d prefillers, %d decoders, policy %s, admin API %s, ZMQ %s",
                "http://" + net.hostport(opts.host, opts.port), len(opts.prefillers), len(opts.decoders), opts.policy,
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
