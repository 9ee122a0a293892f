"""`kvferry` command: `up` (a local xPyD cluster), `join` (one instance joined through discovery), `secret`
(a new cluster secret), `kv-events-relay` (vLLM's KV events onto an authenticated port) and `make-tiny-model`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _make_tiny_model(args: argparse.Namespace) -> int:
    from kvferry.launcher import tiny_model

    kv_heads = tiny_model.KV_HEADS if args.kv_heads is None else args.kv_heads
    try:
        default = tiny_model.default_dir(args.arch, kv_heads)  # checks --arch with --kv-heads
    except ValueError as e:
        print(f"kvferry make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default
    if tiny_model.is_current(out, kv_heads if args.arch == "llama" else None) and not args.force:
        print(f"tiny model already built: {out}")
        return 0
    trained = " (trained here: about 2.5 minutes on one core)" if args.arch in tiny_model.COPY_RECIPES else ""
    print(f"building tiny model into {out}{trained} ...", flush=True)
    tiny_model.build(out, args.arch, kv_heads)
    print(f"tiny model ready: {out}")
    return 0


def _secret(args: argparse.Namespace) -> int:
    from kvferry.common import secret

    text = secret.generate()
    if not args.out:
        print(text)
        return 0
    try:
        secret.write_file(args.out, text, replace=args.force)
    except FileExistsError:
        print(f"kvferry secret: {args.out} exists; --force replaces it", file=sys.stderr)
        return 2
    print(f"new cluster secret in {args.out} (mode 600): set cluster_secret_file: {Path(args.out).resolve()} "
          "on every instance, and --cluster-secret-file on the proxy and controller")
    return 0


def _relay(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvferry.common import secret, zsock
    from kvferry.common.kv_events_relay import KVEventsRelay, RelaySpec, dialable

    try:
        trust = zsock.Trust(secret.from_env(args.cluster_secret_file), args.require_cluster_secret)
        relay = KVEventsRelay(RelaySpec(dialable(args.upstream), dialable(args.upstream_replay)
                                        if args.upstream_replay else None, args.host, args.port, args.replay_port),
                              trust).start()
    except (secret.SecretError, zsock.BindError, zsock.ExposureError) as e:
        print(f"kvferry kv-events-relay: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"relaying {args.upstream} on {zsock.tcp(args.host, args.port)}", flush=True)
    stop.wait()
    relay.close()
    return 0


def _up(args: argparse.Namespace) -> int:
    from kvferry.launcher.up import run

    return run(args)


def _join(args: argparse.Namespace) -> int:
    from kvferry.launcher.join import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    from kvferry.launcher import tiny_model  # stdlib only: cheap for every command

    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-tiny-model", help="build the random-weight test model (no network)")
    p.add_argument("--arch", choices=tiny_model.ARCHES, default="llama",
                   help="llama: dense GQA (default); deepseek: DeepSeek-V2 MLA (docs/pd.md); llama-copy, "
                        "deepseek-copy: small GQA and MLA models trained here to continue a repeated pattern "
                        "(docs/testing.md; they judge cachegen's lossy KV)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="llama only: KV heads, dividing its 8 attention heads (default 8; fewer than a TP size "
                        "replicates them, docs/pd.md); another value builds into tiny-llama-kv<N>")
    p.add_argument("--out", help="output directory (default ~/.cache/kvferry/tiny-<arch>, or "
                                 "tiny-llama-kv<N> with --kv-heads N other than 8)")
    p.add_argument("--force", action="store_true", help="rebuild even if a current one exists")
    p.set_defaults(func=_make_tiny_model)
    p = sub.add_parser("secret", help="make a new cluster secret (docs/security.md)")
    p.add_argument("--out", help="write it to this file, readable by its owner only (default: print it)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=_secret)
    p = sub.add_parser("kv-events-relay", help="relay one vLLM's KV events onto ports with the cluster secret "
                                               "(docs/deploy.md \"Network\")")
    p.add_argument("--from", dest="upstream", required=True,
                   help="vLLM's --kv-events-config endpoint (ipc://PATH or tcp://127.0.0.1:PORT)")
    p.add_argument("--replay-from", dest="upstream_replay", default=None, help="vLLM's replay_endpoint")
    p.add_argument("--host", default="127.0.0.1", help="where the relay binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="the relay's event port (the proxy's --kv-events)")
    p.add_argument("--replay-port", type=int, default=None, help="the relay's replay port")
    p.add_argument("--cluster-secret-file", default=None, help="else env KVFERRY_CLUSTER_SECRET[_FILE]")
    p.add_argument("--require-cluster-secret", action="store_true",
                   help="refuse to listen beyond loopback without a cluster secret")
    p.set_defaults(func=_relay)
    p = sub.add_parser("up", help="run a local xPyD cluster (vLLM + connector + proxy)")
    from kvferry.launcher.up import add_arguments
    add_arguments(p)
    p.set_defaults(func=_up)
    p = sub.add_parser("join", help="start one vLLM instance with the connector and join it to a cluster through "
                                    "discovery (docs/deploy.md)")
    from kvferry.launcher.join import add_arguments as join_arguments
    join_arguments(p)
    p.set_defaults(func=_join)
    args = parser.parse_args(argv)
    if args.func in (_relay, _up, _join):  # the commands that run services log; the others print
        from kvferry.common.log import configure_logging
        configure_logging()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
