"""LMCache's NIXL storage back-end (seed 002 4.5: ``extra_config.enable_nixl_storage`` with
``nixl_backend`` POSIX, GDS, GDS_MT, HF3FS or OBJ): checked at start, so a config that asks for it
stops vLLM with one line naming what is missing, instead of silently storing nothing."""

from __future__ import annotations

import os

from kvferry.common.config import ConfigError, KVFerryConfig

BACKENDS = ("GDS", "GDS_MT", "POSIX", "HF3FS", "OBJ")
CPU_ONLY = ("POSIX", "HF3FS", "OBJ")  # the seed: these move data from CPU memory only
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


def refuse(cfg: KVFerryConfig) -> None:
    """ConfigError when `cfg` asks for NIXL storage: kvferry keeps KV on disk with its own disk tier."""
    extra = cfg.extra_config or {}
    if not extra.get("enable_nixl_storage"):
        return
    backend = extra.get("nixl_backend")
    if backend not in BACKENDS:
        raise ConfigError(f"extra_config nixl_backend {backend!r} is not one of {', '.join(BACKENDS)}")
    device = cfg.nixl_buffer_device or "cpu"
    if backend in CPU_ONLY and device != "cpu":
        raise ConfigError(f"nixl_buffer_device {device!r} with nixl_backend {backend}: {', '.join(CPU_ONLY)} move "
                          "KV from CPU memory only: set nixl_buffer_device: cpu")
    missing = "" if backend == "POSIX" or (backend.startswith("GDS") and _gpu()) else f" (it needs {NEEDS[backend]})"
    raise ConfigError(f"extra_config enable_nixl_storage with nixl_backend {backend}{missing}: kvferry does not store "
                      "KV through NIXL's storage plugins: use local_disk: <the nixl_path folder> with "
                      "max_local_disk_size (kvferry's disk tier, checked files on a local path), or remote_url")
