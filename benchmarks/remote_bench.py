"""Remote tier put/get throughput, kvferry vs the raw redis-py client, with and without the
cluster secret's chunk MAC, on Redis, lm:// and a Mooncake store, in one run.

    python benchmarks/remote_bench.py --json [--chunk-mib 1,2,4,8,16,32] [--mib-per-point 256] [--serde naive]

Starts a redis-server, two kvferry-servers (lm://, one with a cluster secret) and a mooncake_master
(mooncakestore://, over TCP; this process lends the store its segment) on free ports.
For each chunk size, rounds alternate between: raw redis-py SET/GET of the chunk's bytes;
kvferry's remote tier on Redis (serde header + checksum, MSET of header and payload, GETRANGE
bounded by the chunk size, the chunk decoded back into a tensor); kvferry's remote tier on
lm://; on Mooncake (one object per chunk, copied through a registered buffer); and Redis and lm:// again with
the cluster secret (``+mac``: every chunk tagged with keyed BLAKE3 on
put and checked on get). Puts are timed until the tier's put thread has finished them (flush),
the tiers' order rotating each round; gets (and the in-memory decodes) are interleaved call by
call across backends, so the shared machine's noise falls on all of them alike.
Reports GB/s (1e9 bytes/s) per backend and size:
``{"rows": [{"backend", "mac", "chunk_bytes", "put_gbps", "get_gbps", "raw_put_gbps", "raw_get_gbps"}],
"mac_cost": [{"backend", "chunk_bytes", "get_ratio", "put_ratio", "decode_ratio"}]}``, where a
ratio is with-MAC over without-MAC throughput from the same run (``decode_ratio``: the serde's
decode alone, in memory, so the store's noise is out of it). Targets: redis put/get >= 0.8 x
raw, lm >= redis, MAC get ratio >= 0.9 at 4 MiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch

from kvferry.common import secret
from kvferry.common.config import load_config
from kvferry.engine.remote import mooncake_backend, mooncake_settings
from kvferry.engine.remote.mooncake_backend import MooncakeClient
from kvferry.engine.remote.serde import ChunkShape, Serde
from kvferry.engine.tiers.remote import RemoteTier
from kvferry.launcher.services import MooncakeMaster
from kvferry.testing.store_servers import start_lm_server, start_redis

# Llama-3-8B's KV per token: 32 layers x K,V x 8 heads x 128 x bf16 = 128 KiB.
SHAPE = ChunkShape(torch.bfloat16, num_layers=32, num_kv_heads=8, head_size=128, layout_digest=b"b" * 16)
TOKEN_BYTES = 32 * 2 * 8 * 128 * 2


def timed(fn, n: int) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return time.perf_counter() - t0


def point(rds: redis.Redis, tiers: dict[str, RemoteTier], size: int, count: int, rounds: int,
          clear: Callable[[], None] = lambda: None) -> dict[str, float]:
    """GB/s per operation: puts timed per tier until flushed (the order rotating each round);
    gets and in-memory decodes interleaved call by call across tiers, so a noisy neighbour
    slows every tier alike."""
    tokens = size // TOKEN_BYTES
    chunks = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(min(count, 4))]
    raw = [bytes(c.numpy()) for c in chunks]
    times: dict[str, list[float]] = {}
    mac = next(t for name, t in tiers.items() if name.endswith("+mac")).mac
    serde = next(iter(tiers.values())).serde
    encoded = [(serde.encode(c, tokens), serde.encode(c, tokens, mac, b"k%d" % i)) for i, c in enumerate(chunks)]

    def decode(i: int, tagged: bool) -> None:
        head, payload = encoded[i % len(encoded)][tagged]
        serde.decode(head, payload, tokens, size, mac if tagged else None, b"k%d" % (i % len(encoded)))

    for r in range(rounds):
        names = ["raw", *tiers]
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            pre = f"{name}{size}-{r}-"
            if name == "raw":
                times.setdefault("raw_put", []).append(
                    timed(lambda i, pre=pre: rds.set(f"{pre}{i}", raw[i % len(raw)]), count))
                continue
            t = tiers[name]

            def put(i: int, t: RemoteTier = t, pre: str = pre) -> None:
                assert t.put(f"{pre}{i}".encode(), chunks[i % len(chunks)], tokens)
            t0 = time.perf_counter()
            timed(put, count)
            assert t.flush(120), f"{name}: puts did not finish"
            times.setdefault(f"{name}_put", []).append(time.perf_counter() - t0)
        gets: dict[str, Callable[[int], object]] = {
            "raw_get": lambda i, pre=f"raw{size}-{r}-": rds.get(f"{pre}{i}"),
            "decode": lambda i: decode(i, False), "decode+mac": lambda i: decode(i, True)}
        for name, t in tiers.items():
            def get(i: int, t: RemoteTier = t, pre: str = f"{name}{size}-{r}-") -> None:
                got = t.get(f"{pre}{i}".encode(), tokens, size)
                assert got is not None and got.numel() == size, f"{pre}{i} missing"
            gets[f"{name}_get"] = get
        spent = dict.fromkeys(gets, 0.0)
        for i in range(count):
            for name in (list(gets) if i % 2 else reversed(gets)):
                t0 = time.perf_counter()
                gets[name](i)
                spent[name] += time.perf_counter() - t0
        for name, v in spent.items():
            times.setdefault(name, []).append(v)
        rds.flushall()
        clear()
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
        path = Path(work) / "secret"
        secret.write_file(str(path), secret.generate())
        cluster = secret.from_file(str(path), "bench")
        procs = [start_redis(Path(work), maxmemory_mb=4096), start_lm_server(Path(work)),
                 start_lm_server(Path(work), secret_file=path), MooncakeMaster(Path(work))]
        try:
            rds = redis.Redis(port=procs[0].port, socket_timeout=60)
            serde = Serde(args.serde, SHAPE)
            urls = {"redis": f"redis://{procs[0].url_hostport}", "lm": f"lm://{procs[1].url_hostport}",
                    "redis+mac": f"redis://{procs[0].url_hostport}", "lm+mac": f"lm://{procs[2].url_hostport}"}
            cfg = load_config({"remote_url": procs[3].url, "extra_config": procs[3].extra_config(4 << 30)}, env={})
            mc = mooncake_settings.from_config(cfg)
            urls["mooncake"] = procs[3].url
            tiers = {name: RemoteTier(url, 60, serde, max_queued_bytes=4 << 30, mooncake=mc,
                                      secret=cluster if name.endswith("+mac") else None) for name, url in urls.items()}

            def clear() -> None:  # the segment holds 4 GiB: empty it between rounds, as Redis is
                client = MooncakeClient.shared(mc)
                client.wait("remove_all", 60, client.submit(lambda st: st.remove_all()))
            rows, cost = [], []
            for size in sizes:
                count = max(2, (args.mib_per_point << 20) // size)
                g = point(rds, tiers, size, count, args.rounds, clear)
                for name in tiers:
                    backend, _, mac = name.partition("+")
                    rows.append({"backend": backend, "mac": bool(mac), "chunk_bytes": size,
                                 "put_gbps": round(g[f"{name}_put"], 3), "get_gbps": round(g[f"{name}_get"], 3),
                                 "raw_put_gbps": round(g["raw_put"], 3), "raw_get_gbps": round(g["raw_get"], 3)})
                for backend in ("redis", "lm"):
                    cost.append({"backend": backend, "chunk_bytes": size,
                                 "get_ratio": round(g[f"{backend}+mac_get"] / g[f"{backend}_get"], 3),
                                 "put_ratio": round(g[f"{backend}+mac_put"] / g[f"{backend}_put"], 3),
                                 "decode_ratio": round(g["decode+mac"] / g["decode"], 3),
                                 "decode_gbps": round(g["decode"], 3), "decode_mac_gbps": round(g["decode+mac"], 3)})
                if not args.json:
                    print(*rows[-len(tiers):], *cost[-2:], sep="\n", file=sys.stderr)
            for t in tiers.values():
                t.close()
        finally:
            mooncake_backend.close_all()  # before its master stops: else exit waits on a dead master
            for p in procs:
                p.stop()
    red = [r for r in rows if r["backend"] == "redis" and not r["mac"]]
    lm = [r for r in rows if r["backend"] == "lm" and not r["mac"]]
    mooncake = [r for r in rows if r["backend"] == "mooncake"]
    at4 = [c["get_ratio"] for c in cost if c["chunk_bytes"] == 4 << 20]
    result = {"rows": rows, "mac_cost": cost, "serde": args.serde,
              "mac_get_ratio_4mib_min": min(at4) if at4 else None,
              "redis_vs_raw_min": round(min(min(r["put_gbps"] / r["raw_put_gbps"], r["get_gbps"] / r["raw_get_gbps"])
                                            for r in red), 3),
              "lm_vs_redis_min": round(min(min(a["put_gbps"] / b["put_gbps"], a["get_gbps"] / b["get_gbps"])
                                           for a, b in zip(lm, red, strict=True)), 3),
              "mooncake_vs_redis_min": round(min(min(a["put_gbps"] / b["put_gbps"], a["get_gbps"] / b["get_gbps"])
                                                 for a, b in zip(mooncake, red, strict=True)), 3)}
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
