"""`kvferry` command: `up` (a local xPyD cluster), `secret` (a new cluster secret) and `make-tiny-model`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _make_tiny_model(args: argparse.Namespace) -> int:
    from kvferry.launcher import tiny_model

    out = Path(args.out) if args.out else tiny_model.default_dir(args.arch)
    if tiny_model.is_current(out) and not args.force:
        print(f"tiny model already built: {out}")
        return 0
    print(f"building tiny model into {out} ...", flush=True)
    tiny_model.build(out, args.arch)
    print(f"tiny model ready: {out}")
    return 0


def _secret(args: argparse.Namespace) -> int:
    from kvferry.common import secret

    text = secret.generate()
    if not args.out:
        print(text)
        return 0
    if Path(args.out).exists() and not args.force:
        print(f"kvferry secret: {args.out} exists; --force replaces it", file=sys.stderr)
        return 2
    secret.write_file(args.out, text)
    print(f"new cluster secret in {args.out} (mode 600): set cluster_secret_file: {Path(args.out).resolve()} "
          "on every instance, and --cluster-secret-file on the proxy and controller")
    return 0


def _up(args: argparse.Namespace) -> int:
    from kvferry.launcher.up import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-tiny-model", help="build the random-weight test model (no network)")
    p.add_argument("--arch", choices=("llama", "deepseek"), default="llama",
                   help="llama: dense GQA (default); deepseek: DeepSeek-V2 MLA (docs/pd.md)")
    p.add_argument("--out", help="output directory (default ~/.cache/kvferry/tiny-<arch>)")
    p.add_argument("--force", action="store_true", help="rebuild even if a current one exists")
    p.set_defaults(func=_make_tiny_model)
    p = sub.add_parser("secret", help="make a new cluster secret (docs/security.md)")
    p.add_argument("--out", help="write it to this file, readable by its owner only (default: print it)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=_secret)
    p = sub.add_parser("up", help="run a local xPyD cluster (vLLM + connector + proxy)")
    from kvferry.launcher.up import add_arguments
    add_arguments(p)
    p.set_defaults(func=_up)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
