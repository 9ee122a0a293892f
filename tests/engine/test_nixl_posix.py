"""NIXL POSIX storage (LMCache's NIXL storage example) as the disk tier: chunks round-trip byte-exact through NIXL's
POSIX plugin, survive a restart (a new tier, and the planner's scan, find them), a damaged file is
a counted miss, and files are interchangeable with the plain disk tier's."""

from __future__ import annotations

from pathlib import Path

import torch

from kvferry.common.config import load_config
from kvferry.engine.offload.planner import OffloadPlanner
from kvferry.engine.tiers import nixl_storage
from kvferry.engine.tiers.disk import HEADER_BYTES, DiskTier, rank_root
from kvferry.engine.tiers.nixl_posix import NixlPosixDiskTier

LMCACHE_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "lmcache-configs"
DIGEST = b"P" * 16
N = 256 << 10


def chunk(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_the_seed_posix_file_is_the_disk_tier_in_nixl_path() -> None:
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": str(LMCACHE_CONFIGS / "nixl-storage-posix.yaml")})
    assert nixl_storage.posix(cfg)
    eff = nixl_storage.effective(cfg, N)
    assert eff.local_disk == "/mnt/nixl/cache/"
    assert abs(eff.max_local_disk_size * (1 << 30) - 64 * (N + HEADER_BYTES)) < 1  # nixl_pool_size chunks


def test_round_trip_restart_and_a_damaged_file(tmp_path: Path) -> None:
    root = rank_root(str(tmp_path), 0)
    t = NixlPosixDiskTier(root, DIGEST)
    a, b = chunk(1), chunk(2)
    t.put(b"A" * 16, a)
    t.put(b"B" * 16, b)
    assert t.flush(30)
    assert t.counters.writes == 2 and t.counters.write_errors == 0
    assert torch.equal(t.get(b"A" * 16, N), a)
    assert t.get(b"C" * 16, N) is None and t.counters.misses == 1
    t.close()
    # A restart: a new tier finds the files, and so does the planner's scan of the folder.
    t2 = NixlPosixDiskTier(root, DIGEST)
    assert torch.equal(t2.get(b"B" * 16, N), b)
    assert torch.equal(DiskTier(root, DIGEST).get(b"A" * 16, N), a)  # the plain disk tier reads it too
    cfg = load_config({"local_cpu": False, "chunk_size": 16, "extra_config": {
        "enable_nixl_storage": True, "nixl_backend": "POSIX", "nixl_path": str(tmp_path), "nixl_pool_size": 8}},
        env={})
    plan = OffloadPlanner(cfg, b"salt", 16, N)
    assert plan.index.by_name["disk"].capacity >= 8 * N and len(plan.index.by_name["disk"]) == 2
    # One flipped byte in a chunk's payload: a counted miss, and the file is deleted.
    path = t2.path(b"A" * 16)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert t2.get(b"A" * 16, N) is None and t2.counters.corrupt == 1 and not path.exists()
    t2.close()
