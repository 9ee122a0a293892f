"""The prefix index against its size: bytes per indexed block and event ingestion rate up to 10
million blocks, and memory held flat past --prefix-index-max-blocks. Part of
benchmarks/scale_bench.py (`measure(quick)`); runs alone too:

    python benchmarks/scale_index.py [--quick]
    python benchmarks/scale_index.py --point BLOCKS MAX_BLOCKS   # one point, in this process

Each point runs in a fresh subprocess: one instance's index (PrefixIndex attached to the
cluster's Holders, as the proxy keeps it) fed through KVEventSubscription.apply with msgpack
batches of one BlockStored each: a 32-block prompt of 16-token blocks, every block new. Memory =
the process's resident set (/proc/self/statm) after the feed less before it, over the blocks the
index then holds; bounded (--prefix-index-max-blocks), the same feeds from 3x the bound on.
Ingestion = stored blocks per CPU second (process time of `apply`: decoding and
indexing, one core) over the last tenth of the feed, so it is the rate at that index size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from kvferry.proxy.routing.holders import Holders
from kvferry.proxy.routing.kv_event_subscription import BlockStored, EventBatch, KVEventSubscription
from kvferry.proxy.routing.prefix_index import PrefixIndex

BS, CHAIN = 16, 32
UNBOUNDED = (100_000, 300_000, 1_000_000, 3_000_000, 10_000_000)
BOUND, BOUNDED = 100_000, (300_000, 1_000_000, 3_000_000, 10_000_000)
QUICK_UNBOUNDED, QUICK_BOUND, QUICK_BOUNDED = (100_000, 200_000), 20_000, (60_000, 200_000)
METHOD = ("one instance's PrefixIndex attached to Holders, fed by KVEventSubscription.apply with msgpack batches "
          f"of one BlockStored ({CHAIN} new blocks of {BS} tokens); a fresh subprocess per point; memory = RSS "
          "(/proc/self/statm) after the feed less before, per block held; ingestion = stored blocks per CPU second "
          "of apply over the last tenth of the feed (one core).")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def point(blocks: int, max_blocks: int) -> dict:
    """Feed `blocks` blocks into an index bounded at `max_blocks`, in this process."""
    enc = msgspec.msgpack.Encoder()
    holders = Holders()
    index = PrefixIndex(max_blocks)
    index.attach(holders, "p0")
    stream = KVEventSubscription("prefiller bench", "ipc:///nonexistent", None, index, 3600.0)
    gc.collect()
    before = rss()
    events = blocks // CHAIN
    tail = max(1, events // 10)
    cpu = 0.0
    for e in range(events):
        base = e * CHAIN * BS
        payload = enc.encode(EventBatch(0.0, [BlockStored(list(range(base, base + CHAIN)), None,
                                                          list(range(base, base + CHAIN * BS)), BS)]))
        if e >= events - tail:
            t = time.process_time()
            stream.apply(e, payload)
            cpu += time.process_time() - t
        else:
            stream.apply(e, payload)
    gc.collect()
    held = len(index)
    grown = rss() - before
    stream.close()
    return {"stored_blocks": events * CHAIN, "max_blocks": max_blocks, "held_blocks": held,
            "rss_bytes": grown, "bytes_per_block": round(grown / max(1, held), 1),
            "blocks_per_s_per_core": round(tail * CHAIN / cpu) if cpu else None,
            "events_per_s_per_core": round(tail / cpu) if cpu else None}


def in_subprocess(blocks: int, max_blocks: int) -> dict:
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--point", str(blocks), str(max_blocks)],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"index point {blocks}/{max_blocks} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(quick: bool) -> dict:
    """The index curves (scale_bench.py's interface)."""
    sizes, bound, fed = (QUICK_UNBOUNDED, QUICK_BOUND, QUICK_BOUNDED) if quick else (UNBOUNDED, BOUND, BOUNDED)
    unbounded = [in_subprocess(n, sizes[-1]) for n in sizes]
    bounded = [in_subprocess(n, bound) for n in fed]
    per = [p["bytes_per_block"] for p in unbounded]
    # Flat past the bound: what the index holds after 3x its bound against after the most (a dict
    # keeps freed slots until it resizes, so the first fill past the bound still grows a little).
    return {"method": METHOD, "points": unbounded, "bounded_points": bounded, "bound_blocks": bound,
            "index_bytes_per_block_spread": round(max(per) / min(per), 3),
            "bounded_rss_ratio_last_vs_first": round(bounded[-1]["rss_bytes"] / max(1, bounded[0]["rss_bytes"]), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--point", nargs=2, type=int, metavar=("BLOCKS", "MAX_BLOCKS"))
    a = ap.parse_args()
    print(json.dumps(point(*a.point) if a.point else measure(a.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
