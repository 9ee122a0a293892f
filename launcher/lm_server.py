"""kvferry-server: the ``lm://`` remote KV cache (LMCache's ``lmcache_server``) on HOST:PORT.

    kvferry-server HOST PORT [cpu] [--max-bytes GB] [--max-frame MB] [--max-connections N] ...

The server, its protocol and its limits: kvferry.engine.remote.lm (docs/lm_server.md).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from kvferry.common import secret as csecret
from kvferry.common import zsock
from kvferry.common.log import configure_logging, get_logger
from kvferry.common.units import fmt_bytes
from kvferry.engine.remote.lm.conn_cap import DEFAULT_MAX_CONNECTIONS, fit_connections
from kvferry.engine.remote.lm.lm_store import LMServer

logger = get_logger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvferry-server", description="The lm:// remote KV cache server "
                                 "(LMCache's lmcache_server): chunks in host memory, LRU beyond --max-bytes.")
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("device", nargs="?", default="cpu", help="where chunks live: cpu (the only choice)")
    ap.add_argument("--max-bytes", type=float, default=4.0, help="GB (GiB) of chunks kept (default 4)")
    ap.add_argument("--max-frame", type=float, default=256, help="largest chunk accepted, MB (MiB) (default 256)")
    ap.add_argument("--frame-timeout", type=float, default=30.0,
                    help="seconds a frame may take from the first byte of its length prefix to its last payload "
                         "byte, and the answer to the cluster-secret challenge (default 30)")
    ap.add_argument("--idle-timeout", type=float, default=300.0,
                    help="seconds a connection may wait between frames before it is closed (default 300; clients "
                         "reconnect on demand)")
    ap.add_argument("--send-timeout", type=float, default=30.0,
                    help="seconds a client may take to read a reply before its connection is closed (default 30)")
    ap.add_argument("--max-connections", type=int, default=None,
                    help=f"connections open at once; the excess hears 'busy' and is closed (default "
                         f"{DEFAULT_MAX_CONNECTIONS}, lowered to fit `ulimit -n`)")
    ap.add_argument("--max-inflight-bytes", type=float, default=1.0,
                    help="GB (GiB) that frames being received may hold across all connections; a frame waits "
                         "for room (within --frame-timeout) before its buffer is allocated (default 1; at least "
                         "--max-frame)")
    ap.add_argument("--cluster-secret-file", default=None,
                    help="clients must prove this cluster secret (their cluster_secret_file) before any request; "
                         "default: $KVFERRY_CLUSTER_SECRET or $KVFERRY_CLUSTER_SECRET_FILE")
    ap.add_argument("--require-cluster-secret", action="store_true",
                    help="refuse to listen beyond loopback without a cluster secret (otherwise: a warning)")
    args = ap.parse_args(argv)
    configure_logging()
    if args.device != "cpu":
        ap.error(f"device {args.device!r}: kvferry-server keeps chunks in host memory; use cpu")
    if not 0 < args.port < 65536:
        ap.error(f"port {args.port} is outside 1-65535")
    if min(args.max_bytes, args.max_frame, args.frame_timeout, args.idle_timeout, args.send_timeout,
           args.max_inflight_bytes) <= 0:
        ap.error("--max-bytes, --max-frame, --max-inflight-bytes and the timeouts must be positive")
    if args.max_connections is not None and args.max_connections < 1:
        ap.error("--max-connections must be at least 1")
    max_frame, max_inflight = int(args.max_frame * (1 << 20)), int(args.max_inflight_bytes * (1 << 30))
    if max_inflight < max_frame:
        ap.error(f"--max-inflight-bytes {args.max_inflight_bytes:g} GB is less than --max-frame {args.max_frame:g} "
                 "MB: a chunk of --max-frame could never be received; raise --max-inflight-bytes or lower --max-frame")
    try:
        secret = csecret.from_env(args.cluster_secret_file, "kvferry-server")
        zsock.check_exposure(args.host, "kvferry-server", zsock.Trust(secret, args.require_cluster_secret),
                             fix="Start it with --cluster-secret-file (the instances' cluster_secret_file)")
    except (csecret.SecretError, zsock.ExposureError) as e:
        print(f"kvferry-server: {e}", file=sys.stderr)
        return 2
    server = LMServer(args.host, args.port, int(args.max_bytes * (1 << 30)), max_frame, args.frame_timeout, secret,
                      idle_timeout=args.idle_timeout, send_timeout=args.send_timeout,
                      max_connections=fit_connections(args.max_connections), max_inflight=max_inflight)

    async def run() -> None:
        try:
            await server.start()
        except OSError as e:
            raise SystemExit(f"kvferry-server: cannot listen on {args.host}:{args.port}: {e.strerror}") from None
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, lambda: logger.info("kvferry-server stats: %s", server.stats()))
        logger.info("kvferry-server listening on %s:%d (memory limit %s, largest chunk %s, %d connections, %s in "
                    "flight; %s)", args.host, server.port, fmt_bytes(server.store.limit), fmt_bytes(server.max_frame),
                    server.max_connections, fmt_bytes(server.budget.limit),
                    "clients must prove the cluster secret" if secret else "no cluster secret: any client")
        task = asyncio.create_task(server.serve_forever())
        await stop.wait()
        task.cancel()
        logger.info("kvferry-server stopped: %d chunks (%s) dropped; %s", len(server.store.data),
                    fmt_bytes(server.store.used), server.stats())

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
