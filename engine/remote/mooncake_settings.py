"""The Mooncake store's settings (docs/mooncake.md): ``remote_url: mooncakestore://host:port/`` and
LMCache's ``extra_config`` keys for it, read once at start-up so a wrong value is one ConfigError naming
the key, never a stream of misses inside vLLM."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvferry.common.config import ConfigError, KVFerryConfig
from kvferry.common.log import get_logger
from kvferry.common.netutil import is_loopback
from kvferry.engine.remote.backend import RemoteError, hostports

logger = get_logger(__name__)

SCHEME = "mooncakestore"
PROTOCOLS = ("tcp", "rdma")
# LMCache keys kvferry reads for drop-in use but that change nothing here, and why.
NO_EFFECT = {
    "use_exists_sync": "kvferry's lookups are always synchronous and bounded",
    "save_chunk_meta": "every kvferry value carries its own checked header (dtype, shape, layout)",
}
DEFAULT_SEGMENT = 1 << 30  # what this process lends the pool when global_segment_size is unset
MAX_STAGING = 1 << 30


@dataclass(frozen=True)
class MooncakeSettings:
    """Where the master is and what this process lends the pool; `transfer_timeout` bounds each
    call (None: the tier's own timeout)."""

    master: str  # host:port of mooncake_master's RPC port
    metadata_server: str  # "P2PHANDSHAKE", "http://host:port/metadata" or an etcd address
    local_hostname: str
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = DEFAULT_SEGMENT
    local_buffer_size: int = 0
    transfer_timeout: float | None = None
    prefer_local_alloc: bool = False

    @property
    def shown(self) -> str:
        return f"mooncakestore://{self.master}"


def _extra(cfg: KVFerryConfig, key: str) -> Any:
    extra = cfg.extra_config or {}
    return extra.get(key, extra.get(f"lmcache.{key}", extra.get(f"kvferry.{key}")))


def _typed(cfg: KVFerryConfig, key: str, kind: type, default: Any) -> Any:
    value = _extra(cfg, key)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"extra_config {key}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def rdma_devices() -> list[str]:
    """This host's RDMA devices (what the kernel lists under /sys/class/infiniband)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def from_config(cfg: KVFerryConfig) -> MooncakeSettings | None:
    """The Mooncake settings of `cfg`; None unless remote_url is mooncakestore://. ConfigError names
    the key to fix."""
    url = cfg.remote_url or ""
    scheme, _, rest = url.partition("://")
    if scheme != SCHEME:
        return None
    try:
        (host, port), = hostports(rest.partition("/")[0], url)
    except (RemoteError, ValueError):
        raise ConfigError(f"remote_url {url!r}: mooncakestore:// takes one host:port (mooncake_master's RPC "
                          "port, 50051 by default)") from None
    master = _typed(cfg, "master_server_address", str, f"{host}:{port}")
    if master != f"{host}:{port}":
        raise ConfigError(f"extra_config master_server_address {master!r} and remote_url {url!r} name different "
                          "masters: keep one")
    protocol = _typed(cfg, "protocol", str, "tcp")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"extra_config protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    device = _typed(cfg, "device_name", str, "")
    if protocol == "rdma" and not rdma_devices():
        raise ConfigError("extra_config protocol is 'rdma' but this host has no RDMA device (/sys/class/infiniband "
                          "is empty): use protocol: tcp, or install the NIC's driver")
    sizes = {}
    for key, default in (("global_segment_size", DEFAULT_SEGMENT), ("local_buffer_size", 0)):
        sizes[key] = _typed(cfg, key, int, default)
        if sizes[key] < 0:
            raise ConfigError(f"extra_config {key}: must be >= 0 bytes, got {sizes[key]}")
    timeout = _typed(cfg, "transfer_timeout", float, None)
    if timeout is not None and timeout <= 0:
        raise ConfigError(f"extra_config transfer_timeout: must be a positive number of seconds, got {timeout}")
    metadata = _typed(cfg, "metadata_server", str, "P2PHANDSHAKE")
    hostname = _typed(cfg, "local_hostname", str, "127.0.0.1" if is_loopback(host) else os.uname().nodename)
    prefer_local = _typed(cfg, "mooncake_prefer_local_alloc", bool, False)
    for key, why in NO_EFFECT.items():
        if _typed(cfg, key, bool, None) is not None:
            logger.info("extra_config %s: accepted for LMCache compatibility, no effect in kvferry: %s", key, why)
    return MooncakeSettings(master, metadata, hostname, protocol, device, sizes["global_segment_size"],
                            sizes["local_buffer_size"], timeout, prefer_local)
