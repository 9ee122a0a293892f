"""NIXL POSIX storage vs kvferry's own disk tier, same files and sizes, one run.

    python benchmarks/nixl_storage_bench.py --json [--chunk-mib 1,4,16] [--mib-per-point 256] [--rounds 3]

For each chunk size, rounds alternate (order rotating) between the disk tier (os write/readv) and
the disk tier with NIXL's POSIX plugin moving the payload (engine/tiers/nixl_posix.py): write
`--mib-per-point` MiB of chunks and wait until they are on disk (flush, then fsync of every file),
drop them from the page cache (posix_fadvise DONTNEED), then read them all back (each read
checked: header, size, checksum). GB/s = 1e9 bytes/s, medians over rounds:
``{"rows": [{"backend", "chunk_bytes", "write_gbps", "read_gbps"}], "posix_vs_disk_min"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvferry.engine.tiers.disk import DiskTier
from kvferry.engine.tiers.nixl_posix import NixlPosixDiskTier

DIGEST = b"bench-layout0000"


def settle(tier: DiskTier, keys: list[bytes]) -> None:
    """Every file written to the device and out of the page cache."""
    assert tier.flush(600), "writes did not finish"
    for k in keys:
        fd = os.open(tier.path(k), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def round_trip(tier: DiskTier, chunks: list[torch.Tensor], count: int, tag: str) -> tuple[float, float]:
    keys = [f"{tag}-{i}".encode().ljust(16, b"\0")[:16] for i in range(count)]
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        tier.put(k, chunks[i % len(chunks)])
    settle(tier, keys)
    write = time.perf_counter() - t0
    size = chunks[0].numel()
    t0 = time.perf_counter()
    for k in keys:
        assert tier.get(k, size) is not None, f"{tag}: a chunk did not read back"
    read = time.perf_counter() - t0
    for k in keys:
        tier.delete(k)
    assert tier.flush(60)
    return write, read


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--chunk-mib", default="1,4,16")
    ap.add_argument("--mib-per-point", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp folder)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvferry-nixl-bench-", dir=args.dir) as work:
        tiers = {"disk": DiskTier(Path(work) / "disk", DIGEST), "nixl_posix": NixlPosixDiskTier(Path(work) / "posix",
                                                                                                DIGEST)}
        for mib in (float(x) for x in args.chunk_mib.split(",")):
            size = int(mib * (1 << 20))
            count = max(2, (args.mib_per_point << 20) // size)
            chunks = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(4)]
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in tiers}
            for r in range(args.rounds):
                names = list(tiers)[r % 2:] + list(tiers)[:r % 2]
                for name in names:
                    times[name].append(round_trip(tiers[name], chunks, count, f"{name}{r}"))
            for name, t in times.items():
                rows.append({"backend": name, "chunk_bytes": size,
                             "write_gbps": round(size * count / statistics.median(w for w, _ in t) / 1e9, 3),
                             "read_gbps": round(size * count / statistics.median(r for _, r in t) / 1e9, 3)})
            if not args.json:
                print(*rows[-2:], sep="\n", file=sys.stderr)
        for t in tiers.values():
            t.close()
    pairs = [(a, b) for a in rows for b in rows
             if a["backend"] == "nixl_posix" and b["backend"] == "disk" and a["chunk_bytes"] == b["chunk_bytes"]]
    result = {"rows": rows, "posix_vs_disk_min": round(min(min(a["write_gbps"] / b["write_gbps"],
                                                               a["read_gbps"] / b["read_gbps"]) for a, b in pairs), 3)}
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
