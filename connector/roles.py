"""Which roles a connector plays, from vLLM's kv_role and kvferry's config, checked against each other."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvferry.common.config import ConfigError, KVFerryConfig, load_config
from kvferry.engine.api import offload_salt

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class Roles:
    cfg: KVFerryConfig
    kv_role: str
    producer_side: bool  # computes prompts itself or loads them from its tiers (kv_both, kv_producer, store PD)
    pd: bool  # a prefiller or a decoder
    offload: bool  # uses the offload tiers


def offload_wanted(cfg: KVFerryConfig, kv_role: str) -> bool:
    """Offload tiers serve kv_both instances and prefillers (a repeated prompt is not recomputed
    there either); a decoder's KV comes from its prefiller."""
    tiers = (cfg.local_cpu and cfg.max_local_cpu_size > 0) or bool(cfg.local_disk) or bool(cfg.remote_url)
    return tiers and (kv_role in ("kv_both", "kv_producer") or store_pd(cfg, kv_role))


def store_pd(cfg: KVFerryConfig, kv_role: str) -> bool:
    """LMCache's store-based PD: a prefiller and a decoder without enable_pd share KV through remote_url
    (the decoder loads the prompt from the store, as a kv_both instance would)."""
    return not cfg.enable_pd and bool(cfg.remote_url) and kv_role in ("kv_producer", "kv_consumer")


def connector_config(vllm_config: VllmConfig) -> tuple[KVFerryConfig, str]:
    """kvferry's config and vLLM's kv_role, checked against each other."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ConfigError("KVFerryConnector needs vLLM's --kv-transfer-config (kv_connector and kv_role)")
    role = ktc.kv_role
    cfg = load_config(ktc.kv_connector_extra_config or {})
    if role == "kv_both":
        if cfg.enable_pd:
            raise ConfigError("kv_role kv_both offloads and shares KV; enable_pd is for a prefiller (kv_role "
                              "kv_producer) or a decoder (kv_consumer): set enable_pd: false or change kv_role")
        if not offload_wanted(cfg, role):
            raise ConfigError("kv_role kv_both has no tier to use: set local_cpu: true with max_local_cpu_size "
                              "> 0, local_disk and max_local_disk_size, or remote_url")
        return cfg, role
    want = {"kv_producer": "sender", "kv_consumer": "receiver"}.get(role or "")
    if want is None or role is None:
        raise ConfigError(f"kv_role {role!r}: KVFerryConnector takes kv_role kv_both (offload), kv_producer "
                          "(prefiller) or kv_consumer (decoder)")
    if store_pd(cfg, role):
        return cfg, role
    if not cfg.enable_pd:
        raise ConfigError(f"kv_role {role} needs enable_pd: true and pd_role: {want} in the kvferry config "
                          "(KVFERRY_CONFIG_FILE / LMCACHE_CONFIG_FILE or kv_connector_extra_config), or "
                          "remote_url to share KV through a store")
    if cfg.pd_role != want:
        raise ConfigError(f"kv_role {role} does not match pd_role {cfg.pd_role!r}: set pd_role: {want}")
    return cfg, role


def roles(vllm_config: VllmConfig) -> Roles:
    cfg, kv_role = connector_config(vllm_config)
    return Roles(cfg, kv_role, producer_side=kv_role in ("kv_producer", "kv_both") or store_pd(cfg, kv_role),
                 pd=cfg.enable_pd, offload=offload_wanted(cfg, kv_role))


def model_name(vc: VllmConfig) -> str:
    return os.path.basename(str(vc.model_config.model).rstrip("/"))


def salt(vc: VllmConfig, cfg: KVFerryConfig, num_layers: int) -> bytes:
    """The offload keys' salt; the scheduler and the workers (which register it with the
    controller) compute the same one."""
    mc, pc = vc.model_config, vc.parallel_config
    return offload_salt(model_name(vc), str(mc.dtype).removeprefix("torch."), num_layers, mc.get_num_kv_heads(pc),
                        mc.get_head_size(), vc.cache_config.block_size, cfg.chunk_size, pc.tensor_parallel_size)


def engine_id(vc: VllmConfig) -> str:
    """vLLM's engine id for this instance (vLLM fills it in whenever a connector is configured)."""
    assert vc.kv_transfer_config is not None and vc.kv_transfer_config.engine_id is not None
    return vc.kv_transfer_config.engine_id
