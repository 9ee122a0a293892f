"""The layout fingerprint names vLLM CPU attention's kernel family (connector/cpu_isa.py): what a
KV block holds depends on it (K transposed for `vec`, tiles for `amx`), so two CPUs that differ
must never exchange blocks (the handshake refusal: tests/transfer/test_transfer.py)."""

from __future__ import annotations

import pytest
import torch

from kvferry.connector.cpu_isa import _rule_of_vllm_032, attention_isa
from kvferry.engine.api import PagedKV, fingerprint
from kvferry.kernels.layout import KVLayout
from tests.kv_caches import make_caches

cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size,head_size", [(16, 64), (32, 64), (128, 128), (32, 80)])
def test_cpu_layout_fingerprint_names_the_isa_vllm_chose(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    lay = KVLayout("cpu", 4, block_size, 2, head_size, dtype)
    want = cpu_attn._get_attn_isa(dtype, block_size, head_size, "auto")
    assert attention_isa(lay, "auto") == want == _rule_of_vllm_032(lay)
    kv = PagedKV(make_caches("cpu", 2, 4, block_size, 2, head_size, dtype, seed=0), "cpu")
    fp = fingerprint(kv, "m", block_size * 2, "block", isa=attention_isa(kv.layout, "auto"))
    assert fp.kv_layout.endswith(f" isa={want}")
    assert fingerprint(kv, "m", block_size * 2, "block").kv_layout != fp.kv_layout


def test_layouts_whose_blocks_do_not_depend_on_the_isa_carry_none() -> None:
    for name in ("flash_nhd", "flash_hnd"):
        assert attention_isa(KVLayout(name, 4, 16, 2, 64, torch.bfloat16), "auto") == ""
    assert attention_isa(KVLayout("mla", 4, 16, 1, 576, torch.bfloat16), "auto") == ""
