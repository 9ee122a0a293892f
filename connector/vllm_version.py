"""The vLLM releases kvferry's connector is checked against, and the start-up check of the one it runs in.

vLLM's connector API (``KVConnectorBase_V1``, the scheduler output, the KV event types) changes
from release to release. Every release in :data:`CHECKED_RELEASES` passed the API check
(connector/api_compat.py, ``make vllm-compat``); the ``cuda`` extra in pyproject.toml names the
same range (a test holds them equal). The connector logs vLLM's version at start and refuses one
outside the range unless ``allow_unsupported_vllm: true``, so an upgrade is noticed at start and
not as a wrong answer later.
"""

from __future__ import annotations

import json

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvferry.common.config import ConfigError
from kvferry.common.log import get_logger

logger = get_logger(__name__)

# Each one's KVConnectorBase_V1 and the fields the connector reads were checked (docs/compatibility.md).
CHECKED_RELEASES = ("0.32.0", "0.33.0")
SUPPORTED_VLLM = f">={CHECKED_RELEASES[0]},<={CHECKED_RELEASES[-1]}"


class UnsupportedVLLM(ConfigError):
    """vLLM's version is outside the checked range; the message names the range and the override."""


def release_of(version: str) -> Version:
    """`version` without its local label (``0.32.0+cpu`` -> 0.32.0): vLLM's builds for CPU or a
    CUDA version carry one, and share the Python source of their release."""
    return Version(Version(version).public)


def in_range(version: str) -> bool:
    try:
        v = release_of(version)
    except InvalidVersion:
        return False
    return SpecifierSet(SUPPORTED_VLLM).contains(v, prereleases=True)


def check_vllm_version(version: str, allow_unsupported: bool) -> bool:
    """Log the vLLM version the connector runs in; refuse one outside SUPPORTED_VLLM (UnsupportedVLLM)
    unless `allow_unsupported`, which only warns. True when it is in the range."""
    if in_range(version):
        logger.info("KVFerryConnector in vLLM %s (kvferry supports vLLM %s)", version, SUPPORTED_VLLM)
        return True
    msg = (f"vLLM {version} is outside the range kvferry's connector was checked against (vLLM {SUPPORTED_VLLM}): "
           "install a vLLM in that range (pip install 'kvferry[cuda]'), or set allow_unsupported_vllm: true "
           "to start anyway")
    if not allow_unsupported:
        raise UnsupportedVLLM(msg)
    logger.warning("%s; starting because allow_unsupported_vllm is true", msg.partition(": install")[0])
    return False


# vLLM's CPU build (0.32) rotates MLA's q_pe wrongly with its `rotary_embedding` C++ op: q_pe is a
# strided view (each head's nope and rope parts side by side) and the op's result for a token depends
# on how many tokens share the batch, so a prefix's KV changes with what follows it and TP=1 and TP=2
# disagree. vLLM's native PyTorch rotary is right; this is the switch that selects it.
CPU_MLA_ROTARY_FIX = {"custom_ops": ["-rotary_embedding"]}


def cpu_mla_rotary_unfixed(is_cpu: bool, use_mla: bool, custom_ops: list[str]) -> bool:
    """An MLA model on vLLM's CPU build with the broken rotary op in use (see CPU_MLA_ROTARY_FIX)."""
    return is_cpu and use_mla and not ({"-rotary_embedding", "none"} & set(custom_ops))


def warn_cpu_mla_rotary(vllm_config: object) -> bool:
    """Warn, naming the flag, when `cpu_mla_rotary_unfixed` holds for this vLLM; True when it warned."""
    from vllm.platforms import current_platform

    use_mla = bool(getattr(getattr(vllm_config, "model_config", None), "use_mla", False))
    ops = list(getattr(getattr(vllm_config, "compilation_config", None), "custom_ops", None) or [])
    if not cpu_mla_rotary_unfixed(current_platform.is_cpu(), use_mla, ops):
        return False
    logger.warning("vLLM's CPU build rotates an MLA model's query wrongly with its rotary_embedding op (the answer "
                   "then depends on the batch, and TP sizes disagree): start vLLM with --compilation-config "
                   "'%s' (kvferry up does)", json.dumps(CPU_MLA_ROTARY_FIX))
    return True


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)
