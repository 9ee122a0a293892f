"""`kvferry` command: `up` (a local xPyD cluster) and `make-tiny-model`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _make_tiny_model(args: argparse.Namespace) -> int:
    from kvferry.launcher import tiny_model

    out = Path(args.out) if args.out else tiny_model.default_dir()
    if tiny_model.is_current(out) and not args.force:
        print(f"tiny model already built: {out}")
        return 0
    print(f"building tiny model into {out} ...", flush=True)
    tiny_model.build(out)
    print(f"tiny model ready: {out}")
    return 0


def _up(args: argparse.Namespace) -> int:
    from kvferry.launcher.up import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-tiny-model", help="build the random-weight test model (no network)")
    p.add_argument("--out", help="output directory (default ~/.cache/kvferry/tiny-llama)")
    p.add_argument("--force", action="store_true", help="rebuild even if a current one exists")
    p.set_defaults(func=_make_tiny_model)
    p = sub.add_parser("up", help="run a local xPyD cluster (vLLM + connector + proxy)")
    from kvferry.launcher.up import add_arguments
    add_arguments(p)
    p.set_defaults(func=_up)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
