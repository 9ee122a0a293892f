"""LMCache's NIXL storage back-end (``extra_config.enable_nixl_storage`` with
``nixl_backend`` POSIX, GDS, GDS_MT, HF3FS or OBJ), checked at start. POSIX becomes the disk tier
in ``nixl_path`` with NIXL's POSIX plugin moving the bytes (engine/tiers/nixl_posix.py); the others
stop vLLM with one line naming what is missing, instead of silently storing nothing."""

from __future__ import annotations

import os

import msgspec

from kvferry.common.config import ConfigError, KVFerryConfig
from kvferry.engine.tiers.disk import HEADER_BYTES

BACKENDS = ("GDS", "GDS_MT", "POSIX", "HF3FS", "OBJ")
CPU_ONLY = ("POSIX", "HF3FS", "OBJ")  # NIXL's storage plugins that move data from CPU memory only
# What each back-end needs beyond the nixl wheel, for the refusal's one line.
NEEDS = {
    "GDS": "a CUDA GPU with GPUDirect Storage (cuFile, nvidia-fs)",
    "GDS_MT": "a CUDA GPU with GPUDirect Storage (cuFile, nvidia-fs)",
    "HF3FS": "a 3FS file system and NIXL's HF3FS plugin (not in the nixl wheel)",
    "OBJ": "an S3-compatible object store (extra_config.nixl_backend_params: bucket, keys, endpoint)",
    "POSIX": "nothing beyond the nixl wheel",
}


def _gpu() -> bool:
    return os.path.exists("/dev/nvidia0")


def posix(cfg: KVFerryConfig) -> bool:
    """True when `cfg` asks for NIXL POSIX storage (usable here); ConfigError for a back-end that is
    not, or a contradiction, naming the fix."""
    extra = cfg.extra_config or {}
    if not extra.get("enable_nixl_storage"):
        return False
    backend = extra.get("nixl_backend")
    if backend not in BACKENDS:
        raise ConfigError(f"extra_config nixl_backend {backend!r} is not one of {', '.join(BACKENDS)}")
    device = cfg.nixl_buffer_device or "cpu"
    if backend in CPU_ONLY and device != "cpu":
        raise ConfigError(f"nixl_buffer_device {device!r} with nixl_backend {backend}: {', '.join(CPU_ONLY)} move "
                          "KV from CPU memory only: set nixl_buffer_device: cpu")
    if backend != "POSIX":
        missing = "" if backend.startswith("GDS") and _gpu() else f" (it needs {NEEDS[backend]})"
        raise ConfigError(f"extra_config enable_nixl_storage with nixl_backend {backend}{missing}: kvferry stores "
                          "KV through NIXL's POSIX plugin only: use nixl_backend: POSIX, or local_disk with "
                          "max_local_disk_size (kvferry's disk tier), or remote_url")
    path = extra.get("nixl_path")
    if not isinstance(path, str) or not path:
        raise ConfigError("extra_config nixl_backend POSIX needs nixl_path: the folder its chunk files go to")
    if cfg.local_disk:
        raise ConfigError(f"local_disk {cfg.local_disk!r} and NIXL POSIX storage (nixl_path {path!r}) are both "
                          "set: keep one (they are the same tier)")
    return True


def effective(cfg: KVFerryConfig, chunk_bytes: int) -> KVFerryConfig:
    """`cfg` with NIXL POSIX storage as the disk tier: local_disk is nixl_path, and without
    max_local_disk_size the tier holds nixl_pool_size chunks (LMCache's pool of files)."""
    if not posix(cfg):
        return cfg
    extra = cfg.extra_config or {}
    pool = extra.get("nixl_pool_size", 64)
    if not isinstance(pool, int) or isinstance(pool, bool) or pool <= 0:
        raise ConfigError(f"extra_config nixl_pool_size: expected a positive int, got {pool!r}")
    size = cfg.max_local_disk_size or pool * (chunk_bytes + HEADER_BYTES) / (1 << 30)
    return msgspec.structs.replace(cfg, local_disk=extra["nixl_path"], max_local_disk_size=size)
