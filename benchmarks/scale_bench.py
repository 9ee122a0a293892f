"""How kvferry's costs grow with the cluster: one driver over the scale curves, each measured by its
own module (`measure(quick) -> {"method", "points", ...}`), merged into one JSON line and a PNG plot
per curve (docs/benchmarks.md "Scale").

    python benchmarks/scale_bench.py --json                       # every curve, plots into docs/
    python benchmarks/scale_bench.py --quick --json               # CI: shapes only, no plots

Curves: routing (scale_routing.py), index (scale_index.py), discovery (scale_discovery.py),
transfer (scale_transfer.py); `--only` picks some. `--quick` measures fewer and smaller points
and checks each curve's SHAPE (ratios within bounds with slack, never absolute times); a failed
check exits 1 naming it.
A module may add its own checks: "checks": [{"name": ..., "ok": bool, "detail": ...}].
`--plots DIR` writes DIR/scale_<curve>.png (default docs/; none with --quick unless given).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

CURVES = {"routing": "scale_routing", "index": "scale_index", "discovery": "scale_discovery",
          "transfer": "scale_transfer"}

# (curve, key, "max" or "min", bound for a full run, bound with --quick or None): the value must not
# pass the bound. Quick runs measure smaller points, so their bounds have slack, and a key a quick run
# does not measure (1,000 instances x 10 proxies) is checked in full runs only.
SHAPES = [
    ("routing", "routing_p99_ratio_1024_vs_16", "max", 2.0, 3.0),
    ("routing", "proxy_cpu_ratio_1024_vs_2", "max", 1.5, 2.25),
    ("index", "index_bytes_per_block_spread", "max", 1.2, 1.5),
    ("index", "bounded_rss_ratio_last_vs_first", "max", 1.3, 1.6),
    ("discovery", "join_to_routed_p50_s_1000", "max", 2.0, None),
    ("transfer", "transfer_ratio_64_vs_8", "min", 0.9, 0.6),
]


def checks(name: str, result: dict, quick: bool) -> list[dict]:
    out = []
    for curve, key, way, full, fast in SHAPES:
        bound = fast if quick else full
        if curve != name or bound is None:
            continue
        if key not in result:
            out.append({"name": f"{curve}.{key}", "ok": False, "detail": f"{key} was not measured"})
            continue
        v = result[key]
        ok = v <= bound if way == "max" else v >= bound
        out.append({"name": f"{curve}.{key}", "ok": ok, "value": v,
                    "detail": f"{key} = {v} (at {'most' if way == 'max' else 'least'} {bound})"})
    for c in result.get("checks", []):
        out.append({"name": f"{name}.{c['name']}", "ok": bool(c["ok"]), "detail": c.get("detail", "")})
    return out


def plot_routing(plt, r: dict):
    pts = r["points"]
    xs = [p["instances"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [p["decision_p50_us"] for p in pts], marker="o", label="decision p50")
    a.plot(xs, [p["decision_p99_us"] for p in pts], marker="o", label="decision p99")
    a.set_ylabel("CPU per routing decision (us)")
    b.plot(xs, [p["proxy_cpu_us_per_request"] for p in pts], marker="o", label="simulated (in process)")
    e2e = r.get("end_to_end")
    if isinstance(e2e, list) and e2e:
        b.plot([p["instances"] for p in e2e], [p["proxy_cpu_us_per_request"] for p in e2e], marker="s",
               label="end to end (stub engines)")
    b.set_ylabel("proxy CPU per request (us)")
    _axes((a, b), "instances", base=2)
    fig.suptitle("Routing cost against cluster size")
    return fig


def plot_index(plt, r: dict):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for pts, label in ((r["points"], "unbounded"),
                       (r["bounded_points"], f"--prefix-index-max-blocks {r['bound_blocks']:,}")):
        xs = [p["stored_blocks"] for p in pts]
        a.plot(xs, [p["rss_bytes"] / 2**20 for p in pts], marker="o", label=label)
        b.plot(xs, [p["blocks_per_s_per_core"] for p in pts], marker="o", label=label)
    xs = [p["stored_blocks"] for p in r["points"]]
    a2 = a.twinx()
    a2.plot(xs, [p["bytes_per_block"] for p in r["points"]], color="grey", linestyle="--", label="bytes/block")
    a2.set_ylabel("bytes per indexed block (dashed)")
    a2.set_ylim(bottom=0)
    a.set_ylabel("index memory, RSS growth (MiB)")
    b.set_ylabel("stored blocks ingested per CPU second")
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_yscale("log" if ax is a else "linear")
        ax.set_xlabel("blocks stored")
        ax.legend(fontsize=8, loc="lower right")
    b.set_ylim(bottom=0)
    fig.suptitle("Prefix index against its size (one instance)")
    return fig


def _series(pts: list[dict], by: str, x: str):
    """(series value, its points sorted by `x`) for each value of `by`, in order."""
    for v in sorted({p[by] for p in pts}):
        yield v, sorted((p for p in pts if p[by] == v), key=lambda p: p[x])


def _axes(axes, xlabel: str, base: int = 10) -> None:
    for ax in axes:
        ax.set_xscale("log", base=base)
        ax.set_xlabel(xlabel)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)


def plot_discovery(plt, r: dict):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for n, mine in _series([p for p in r["points"] if "error" not in p], "proxies", "instances"):
        xs = [p["instances"] for p in mine]
        a.plot(xs, [p["join_to_routed_p50_s"] for p in mine], marker="o", label=f"p50, {n} proxies")
        a.plot(xs, [p["join_to_routed_p99_s"] for p in mine], marker="o", linestyle="--", label=f"p99, {n} proxies")
        b.plot(xs, [p["proxy_cpu_cores_mean"] * 100 for p in mine], marker="o", label=f"{n} proxies")
    a.set_ylabel("join to routed by every proxy (s)")
    b.set_ylabel("CPU of each proxy, idle cluster (% of a core)")
    _axes((a, b), "registered instances")
    fig.suptitle("Discovery through etcd against registered instances")
    return fig


def plot_transfer(plt, r: dict):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for fan, mine in _series(r["points"], "decoders", "in_flight"):
        xs = [p["in_flight"] for p in mine]
        label = f"{fan} decoder{'s' if fan > 1 else ''}"
        a.plot(xs, [p["aggregate_gbps"] for p in mine], marker="o", label=label)
        b.plot(xs, [p["p99_ms"] for p in mine], marker="o", label=label)
    a.set_ylabel("aggregate throughput (GB/s)")
    b.set_ylabel("per-transfer p99 (ms)")
    _axes((a, b), "transfers in flight (one prefiller)", base=2)
    fig.suptitle(f"Transfers in flight, {r['chunks_per_transfer']} x {r['chunk_bytes'] >> 10} KiB each (real NIXL)")
    return fig


PLOTS = {"routing": plot_routing, "index": plot_index, "discovery": plot_discovery, "transfer": plot_transfer}


def draw(results: dict, folder: Path) -> list[str]:
    """PNG per curve; the note when they cannot be drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install 'kvferry[bench]')"]
    folder.mkdir(parents=True, exist_ok=True)
    for name, r in results.items():
        fig = PLOTS[name](plt, r)
        fig.tight_layout()
        fig.savefig(folder / f"scale_{name}.png", dpi=90)
        plt.close(fig)
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--quick", action="store_true", help="small points, shape checks (CI)")
    ap.add_argument("--plots", default=None, help="folder for the PNG plots (default docs/; none with --quick)")
    ap.add_argument("--only", default=",".join(CURVES), help=f"curves to run, of {','.join(CURVES)}")
    a = ap.parse_args()
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CURVES]
    if unknown:
        ap.error(f"unknown curve {', '.join(unknown)}: --only takes {','.join(CURVES)}")
    out: dict = {"quick": a.quick, "curves": {}, "checks": [], "notes": []}
    for name in names:
        mod = importlib.import_module(CURVES[name])
        t = time.monotonic()
        r = mod.measure(a.quick)
        r["seconds"] = round(time.monotonic() - t, 1)
        out["curves"][name] = r
        for k, v in r.items():  # the curve's summary numbers, at the top level too
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds":
                out[k] = v
        out["checks"] += checks(name, r, a.quick)
        if not a.json:
            print(f"{name}: {json.dumps({k: v for k, v in r.items() if k not in ('points', 'method')})}",
                  flush=True)
    plots = a.plots if a.plots is not None else (None if a.quick else "docs")
    if plots is not None and out["curves"]:
        out["notes"] += draw(out["curves"], Path(plots))
    failed = [c for c in out["checks"] if not c["ok"]]
    out["ok"] = not failed
    print(json.dumps(out))
    for c in failed:
        print(f"shape check failed: {c['name']}: {c['detail']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
