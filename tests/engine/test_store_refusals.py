"""LMCache back-ends kvferry does not run (InfiniStore, NIXL storage other than
POSIX) load from LMCache's example files but stop the engine at start with one line that names what is missing and the
alternative; nothing pretends to work."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.common.config import load_config
from kvferry.engine.offload.planner import OffloadPlanner

LMCACHE_CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "lmcache-configs"
NIXL = {"chunk_size": 256, "nixl_buffer_size": 1 << 30}


def nixl(backend: str, device: str = "cpu") -> dict:
    return {**NIXL, "nixl_buffer_device": device,
            "extra_config": {"enable_nixl_storage": True, "nixl_backend": backend, "nixl_pool_size": 64,
                             "nixl_path": "/tmp/nixl/", "use_direct_io": True}}


@pytest.mark.parametrize("keys,fix", [
    (LMCACHE_CONFIGS / "infinistore-config.yaml", "InfiniStore speaks RDMA only.*use mooncakestore://"),
    (LMCACHE_CONFIGS / "nixl-storage-obj.yaml", "nixl_backend OBJ \\(it needs an S3-compatible object store"),
    (nixl("HF3FS"), "nixl_backend HF3FS \\(it needs a 3FS file system"),
    (nixl("GDS", "cuda"), "nixl_backend GDS( \\(it needs a CUDA GPU)?.*use nixl_backend: POSIX, or local_disk"),
    (nixl("GDS_MT"), "nixl_backend GDS_MT"),
    (nixl("POSIX", "cuda"), "nixl_buffer_device 'cuda' with nixl_backend POSIX.*set nixl_buffer_device: cpu"),
    (nixl("NVMe"), "nixl_backend 'NVMe' is not one of GDS, GDS_MT, POSIX, HF3FS, OBJ"),
    ({**nixl("POSIX"), "local_disk": "/tmp/d", "max_local_disk_size": 1.0}, "are both set: keep one"),
], ids=["infinistore", "obj", "hf3fs", "gds", "gds_mt", "posix_cuda", "unknown", "posix_and_local_disk"])
def test_each_refused_backend_is_one_line_at_start(keys: Path | dict, fix: str) -> None:
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": str(keys)}) if isinstance(keys, Path) else load_config(keys, env={})
    with pytest.raises(Exception, match=fix) as e:  # ConfigError or RemoteError: vLLM shows it as one line
        OffloadPlanner(cfg, b"salt", 16, 1024)
    assert "\n" not in str(e.value)
