"""Remote tier put/get throughput, kvferry vs the raw redis-py client, in one run.

    python benchmarks/remote_bench.py --json [--chunk-mib 1,2,4,8,16,32] [--mib-per-point 256] [--serde naive]

Starts a redis-server and a kvferry-server (lm://) on free ports. For each chunk size, rounds
alternate between: raw redis-py SET/GET of the chunk's bytes; kvferry's remote tier on Redis
(serde header + checksum, MSET/MGET of header and payload, the chunk decoded back into a tensor);
kvferry's remote tier on lm://. Puts are timed until the tier's put thread has finished them
(flush). Reports GB/s (1e9 bytes/s) per backend and size:
``{"rows": [{"backend", "chunk_bytes", "put_gbps", "get_gbps", "raw_put_gbps", "raw_get_gbps"}]}``
with the raw client's numbers from the same run. Targets: redis put/get >= 0.8 x raw, lm >= redis.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
import torch

from kvferry.engine.remote_serde import ChunkShape, Serde
from kvferry.engine.remote_store import RemoteTier
from kvferry.launcher.stores import start_lm_server, start_redis

# Llama-3-8B's KV per token: 32 layers x K,V x 8 heads x 128 x bf16 = 128 KiB.
SHAPE = ChunkShape(torch.bfloat16, num_layers=32, num_kv_heads=8, head_size=128, layout_digest=b"b" * 16)
TOKEN_BYTES = 32 * 2 * 8 * 128 * 2


def timed(fn, n: int) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return time.perf_counter() - t0


def point(rds: redis.Redis, tiers: dict[str, RemoteTier], size: int, count: int, rounds: int) -> dict[str, float]:
    tokens = size // TOKEN_BYTES
    chunks = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(min(count, 4))]
    raw = [bytes(c.numpy()) for c in chunks]
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for r in range(rounds):
        pre = f"raw{size}-{r}-"
        add("raw_put", timed(lambda i, pre=pre: rds.set(f"{pre}{i}", raw[i % len(raw)]), count))
        add("raw_get", timed(lambda i, pre=pre: rds.get(f"{pre}{i}"), count))
        for name, t in tiers.items():
            pre = f"{name}{size}-{r}-"

            def put(i: int, t: RemoteTier = t, pre: str = pre) -> None:
                assert t.put(f"{pre}{i}".encode(), chunks[i % len(chunks)], tokens)
            t0 = time.perf_counter()
            timed(put, count)
            assert t.flush(120), f"{name}: puts did not finish"
            add(f"{name}_put", time.perf_counter() - t0)

            def get(i: int, t: RemoteTier = t, pre: str = pre) -> None:
                got = t.get(f"{pre}{i}".encode(), tokens, size)
                assert got is not None and got.numel() == size, f"{pre}{i} missing"
            add(f"{name}_get", timed(get, count))
        rds.flushall()
    return {k: size * count / statistics.median(v) / 1e9 for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--chunk-mib", default="1,2,4,8,16,32")
    ap.add_argument("--mib-per-point", type=int, default=256, help="bytes moved per round and size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serde", default="naive", choices=["naive", "zstd"])
    args = ap.parse_args()
    sizes = [int(float(x) * (1 << 20)) for x in args.chunk_mib.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvferry-remote-bench-") as work:
        procs = [start_redis(Path(work), maxmemory_mb=2048), start_lm_server(Path(work))]
        try:
            rds = redis.Redis(port=procs[0].port, socket_timeout=60)
            serde = Serde(args.serde, SHAPE)
            tiers = {name: RemoteTier(f"{name}://{p.url_hostport}", 60, serde, max_queued_bytes=4 << 30)
                     for name, p in zip(("redis", "lm"), procs, strict=True)}
            rows = []
            for size in sizes:
                count = max(2, (args.mib_per_point << 20) // size)
                g = point(rds, tiers, size, count, args.rounds)
                for backend in tiers:
                    rows.append({"backend": backend, "chunk_bytes": size, "put_gbps": round(g[f"{backend}_put"], 3),
                                 "get_gbps": round(g[f"{backend}_get"], 3), "raw_put_gbps": round(g["raw_put"], 3),
                                 "raw_get_gbps": round(g["raw_get"], 3)})
                if not args.json:
                    print(rows[-2], rows[-1], file=sys.stderr)
            for t in tiers.values():
                t.close()
        finally:
            for p in procs:
                p.stop()
    red = [r for r in rows if r["backend"] == "redis"]
    lm = [r for r in rows if r["backend"] == "lm"]
    result = {"rows": rows, "serde": args.serde,
              "redis_vs_raw_min": round(min(min(r["put_gbps"] / r["raw_put_gbps"], r["get_gbps"] / r["raw_get_gbps"])
                                            for r in red), 3),
              "lm_vs_redis_min": round(min(min(a["put_gbps"] / b["put_gbps"], a["get_gbps"] / b["get_gbps"])
                                           for a, b in zip(lm, red, strict=True)), 3)}
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
