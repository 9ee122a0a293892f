"""`kvferry-controller`: the P2P cluster's registry, lookup service, mover and web page.

Ports: `--monitor-ports` (ZMQ; workers report to pull/heartbeat, schedulers look up on reply,
controller/worker_links.py) and `--port` (HTTP: LMCache's controller API, the page and /docs, controller/http_api.py).
With `--cluster-secret-file` every ZMQ port speaks CurveZMQ; with `--admin-key` (or
KVFERRY_ADMIN_KEY) the HTTP API needs the key (controller/cluster.py says how exposure is judged).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence

from kvferry.common import secret as csecret
from kvferry.common import zsock
from kvferry.common.errors import ConfigurationError
from kvferry.common.log import configure_logging, get_logger
from kvferry.controller.cluster import Controller
from kvferry.controller.http import HttpLimits
from kvferry.controller.http_api import build_app

logger = get_logger(__name__)


class MonitorPortsError(ConfigurationError, ValueError):
    """--monitor-ports that cannot be used; the message shows a good one."""


def parse_monitor_ports(text: str) -> dict[str, int]:
    try:
        ports = json.loads(text)
    except json.JSONDecodeError as e:
        raise MonitorPortsError(f"--monitor-ports is not JSON ({e}): e.g. "
                                f"'{{\"pull\": 8300, \"reply\": 8400}}'") from None
    if not isinstance(ports, dict):
        raise MonitorPortsError("--monitor-ports must be a JSON object such as '{\"pull\": 8300, \"reply\": 8400}'")
    unknown = set(ports) - {"pull", "reply", "heartbeat"}
    if unknown:
        raise MonitorPortsError(f"--monitor-ports: unknown key(s) {sorted(unknown)}; the keys are pull, reply, "
                                "heartbeat")
    for k in ("pull", "reply"):
        if k not in ports:
            raise MonitorPortsError(f"--monitor-ports needs a {k!r} port (the workers' controller_{k}_url)")
    for k, v in ports.items():
        if not isinstance(v, int) or not 0 < v < 65536:
            raise MonitorPortsError(f"--monitor-ports {k}: {v!r} is not a port number")
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
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a name the HTTP API answers to without an admin key, besides localhost, loopback addresses "
                        "and --host; repeatable (a request with another Host header is refused: DNS rebinding)")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a request's head and body may take to arrive (a new connection's first request: "
                        "from its opening); then the connection is closed (default 30)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="HTTP connections open at once; one more is answered 503 with Retry-After and closed "
                        "(default: half of `ulimit -n` beyond 64, after raising it toward the hard limit)")
    args = p.parse_args(argv)
    try:
        args.monitor_ports = parse_monitor_ports(args.monitor_ports)
    except MonitorPortsError as e:
        p.error(str(e))
    if args.admin_key is None:
        args.admin_key = os.environ.get("KVFERRY_ADMIN_KEY") or None
    if args.admin_key is not None and not args.admin_key.strip():
        p.error("--admin-key is empty: give a key (e.g. `kvferry secret`), or leave the flag out")
    if not 0 < args.command_timeout <= 86400:
        p.error(f"--command-timeout {args.command_timeout}: give seconds in (0, 86400]")
    if not 0 < args.request_timeout <= 3600:
        p.error(f"--request-timeout {args.request_timeout}: give seconds in (0, 3600]")
    if args.max_connections is not None and args.max_connections < 1:
        p.error(f"--max-connections {args.max_connections}: give at least 1")
    for name in args.allowed_host:
        if not name.strip() or any(c in name for c in "/@ ,"):
            p.error(f"--allowed-host {name!r}: give a host name or address (e.g. controller.internal)")
    return args


async def serve(args: argparse.Namespace, trust: zsock.Trust = zsock.PLAIN) -> None:
    c = Controller(args.host, args.port, args.monitor_ports, args.command_timeout, trust=trust,
                   admin_key=args.admin_key, allowed_hosts=args.allowed_host,
                   http_limits=HttpLimits(args.request_timeout, args.max_connections))
    try:
        await c.start(build_app(c))
    except SystemExit:
        await c.stop()  # what did start (loops, sockets) ends before the one-line error
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("kvferry controller: shutting down")
    await c.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    configure_logging()  # after the flags parse: a bad flag, or --help, needs no logging
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
