"""gather/scatter throughput against a plain tensor copy of the same bytes, in the same run.

    python benchmarks/kernels_bench.py --json [--device cpu|cuda] [--layout cpu|flash_nhd] [--batch N]

Chunks have the tiny model's shape (8 layers, 8 KV heads of 64, bf16: 16 KiB per token), from
64 KiB to 64 MiB. Blocks have vLLM's default size for the device (128 tokens on CPU, 16 on GPU;
`--block-size`), capped at the chunk's token count. The paged cache is several times larger than the chunk
and the blocks are
picked at random, as in a real cache. Each timed call touches a different cold region, and so
does each memcpy: `memcpy_gbps` (cold source -> the chunk) is gather's baseline, and
`memcpy_to_cold_gbps` (the chunk -> a cold destination) is scatter's. Each figure is the median
of `--reps` timed runs.
Target: gather and scatter >= 0.8 x memcpy for chunks >= 1 MiB (CPU), >= 0.8 x device copy (GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvferry.kernels.paged_copy import PagedKV

LAYERS, HEADS, HEAD, DTYPE = 8, 8, 64, torch.bfloat16
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD * 2


def timed_interleaved(fns: dict, reps: int, device: str) -> dict[str, float]:
    """Median seconds per call of each fn; the fns take turns within every rep, so noise from
    this machine (a shared 2-core VM whose timings swing several-fold) hits them alike.
    `fn(i)` must touch different memory for each i."""
    for fn in fns.values():
        fn(reps)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps):
        for name, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn(i)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def row(chunk_bytes: int, device: str, layout: str, fmt: str, reps: int, cache_mib: int,
        block_size: int, batch: int = 1) -> dict:
    tokens = chunk_bytes // TOKEN_BYTES
    bs = min(block_size, tokens)
    nblk = tokens // bs
    # Every timed call reads (or writes) a different, cold region of a cache far larger than the
    # CPU's caches; memcpy gets the same treatment, so both pay for main memory alike.
    nb = max((reps + 1) * nblk * batch, (cache_mib << 20) // (bs * TOKEN_BYTES))
    shape = {"cpu": (nb, HEADS, bs, 2 * HEAD), "flash_nhd": (2, nb, bs, HEADS, HEAD)}[layout]
    caches = [torch.empty(shape, dtype=DTYPE, device=device).random_(0, 100) for _ in range(LAYERS)]
    kv = PagedKV(caches, layout)
    perm = torch.randperm(nb, device=device)
    # Lists, as the engine passes them (vLLM's block ids are Python ints).
    # A call moves `batch` chunks (one launch on CUDA), as the PD path does for a whole prompt.
    sets = [[perm[(i * batch + c) * nblk:(i * batch + c + 1) * nblk].tolist() for c in range(batch)]
            for i in range(reps + 1)]
    total = chunk_bytes * batch
    chunk = torch.empty(total, dtype=torch.uint8, device=device)
    views = list(chunk.view(batch, chunk_bytes))
    assert kv.chunk_nbytes(fmt, tokens) == chunk_bytes
    flat = torch.empty((reps + 1) * total + (cache_mib << 20), dtype=torch.uint8, device=device)
    flat.random_(0, 255)
    stride = flat.numel() // (reps + 1) // 4096 * 4096
    region = [flat[i * stride:i * stride + total] for i in range(reps + 1)]
    ntok = [None] * batch
    t = timed_interleaved({
        "copy": lambda i: chunk.copy_(region[i]),
        "gather": lambda i: kv.copy_batch(sets[i], views, fmt, ntok, to_chunk=True),
        "copy_out": lambda i: region[i].copy_(chunk),
        "scatter": lambda i: kv.copy_batch(sets[i], views, fmt, ntok, to_chunk=False),
    }, reps, device)
    t_copy, t_gather, t_copy_out, t_scatter = t["copy"], t["gather"], t["copy_out"], t["scatter"]
    gb = total / 1e9
    return {"chunk_bytes": chunk_bytes, "batch": batch, "tokens": tokens, "block_size": bs,
            "gather_gbps": sig3(gb / t_gather), "scatter_gbps": sig3(gb / t_scatter),
            "memcpy_gbps": sig3(gb / t_copy), "memcpy_to_cold_gbps": sig3(gb / t_copy_out),
            "gather_ratio": round(t_copy / t_gather, 3), "scatter_ratio": round(t_copy_out / t_scatter, 3)}


def sig3(x: float) -> float:
    """Three significant figures: a rate rounded to fixed decimals reads 0.0 when one slow rep on
    a loaded machine drags it under 0.005 GB/s."""
    return float(f"{x:.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layout", default=None, help="cpu (vLLM CPU) or flash_nhd; default by device")
    ap.add_argument("--format", default="block", choices=["block", "token"])
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--cache-mib", type=int, default=512, help="size of the paged cache per run")
    ap.add_argument("--block-size", type=int, default=0,
                    help="vLLM block size (default: vLLM's own, 128 on CPU, 16 on GPU; capped at the chunk)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--batch", type=int, default=1, help="chunks per call (the PD path moves a prompt's chunks in one)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = args.layout or ("cpu" if args.device == "cpu" else "flash_nhd")
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    block_size = args.block_size or (128 if layout == "cpu" else 16)
    rows = [row(s, args.device, layout, args.format, args.reps, args.cache_mib, block_size, args.batch)
            for s in sizes if s <= args.max_mib << 20]
    big = [r for r in rows if r["chunk_bytes"] >= 1 << 20]
    result = {"device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
              "layout": layout, "format": args.format, "torch_threads": torch.get_num_threads(),
              "rows": rows,
              "target_met": all(r["gather_ratio"] >= 0.8 and r["scatter_ratio"] >= 0.8 for r in big)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'chunk':>10} {'gather':>8} {'scatter':>8} {'memcpy':>8}  GB/s   ratios")
        for r in rows:
            print(f"{r['chunk_bytes']:>10} {r['gather_gbps']:>8} {r['scatter_gbps']:>8} {r['memcpy_gbps']:>8}"
                  f"        {r['gather_ratio']} {r['scatter_ratio']}")
        print("target met" if result["target_met"] else "target NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
