"""Which kernel family vLLM's CPU attention uses, because it decides what a KV block holds.

vLLM CPU writes K (and, with AMX, V) into each block in an order its attention kernel reads fast:
transposed per head for its `vec` kernels, packed in 16-token tiles for `amx` (bf16 on a CPU with
AMX tiles). Two machines with one model, dtype and block size can therefore hold different bytes
for the same tokens; kvferry names the family in the layout fingerprint, so such a pair is refused
at the handshake and their offload keys never match, rather than one reading the other's blocks
as its own (docs/pd.md, "Why not on vLLM CPU").
"""

from __future__ import annotations

import torch

from kvferry.common.log import get_logger
from kvferry.engine.api import KVLayout

logger = get_logger(__name__)


def attention_isa(layout: KVLayout, kv_cache_dtype: str | None) -> str:
    """vLLM's own choice for this cache (its cpu_attn._get_attn_isa); "" for a layout whose blocks
    do not depend on it (the GPU flash layouts, MLA)."""
    if layout.name != "cpu":
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # another vLLM: the rule it used in 0.32, so a mixed pair still differs
        return _rule_of_vllm_032(layout)
    try:
        return str(_get_attn_isa(layout.dtype, layout.block_size, layout.head_size, kv_cache_dtype))
    except (TypeError, NotImplementedError) as e:
        logger.warning("vLLM's CPU attention ISA could not be asked (%s): using vLLM 0.32's rule", e)
        return _rule_of_vllm_032(layout)


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, from the kernel's CPU flags (torch tells it only privately)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def _rule_of_vllm_032(layout: KVLayout) -> str:
    if layout.head_size % 32 and not layout.head_size % 16:
        return "vec16"
    if amx_tiles() and layout.dtype == torch.bfloat16 and not layout.block_size % 32:
        return "amx"
    return "vec" if not layout.block_size % 32 else "vec16"
