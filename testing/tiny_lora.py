"""A random-weight LoRA adapter for a tiny Llama (`kvferry make-tiny-model`), in PEFT's format
(adapter_config.json, adapter_model.safetensors), which vLLM loads with ``--enable-lora
--lora-modules NAME=PATH``. Built here, no network: tests of LoRA requests need an adapter that
changes the model's KV (it adapts q, k, v and o of every layer) and so its greedy answers.
"""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def build(model_dir: Path, out: Path, seed: int = 1, rank: int = 8, scale: float = 1.0) -> Path:
    """An adapter for the Llama in `model_dir`, into `out` (its weights depend on `seed` only)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv_heads, head_dim = cfg.get("num_key_value_heads", heads), cfg.get("head_dim", h // heads)
    shapes = {"q_proj": (h, heads * head_dim), "k_proj": (h, kv_heads * head_dim),
              "v_proj": (h, kv_heads * head_dim), "o_proj": (heads * head_dim, h)}
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for name in TARGETS:
            fan_in, fan_out = shapes[name]
            p = f"base_model.model.model.layers.{i}.self_attn.{name}."
            w[p + "lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            w[p + "lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * (scale / rank**0.5)
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(TARGETS), "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": str(model_dir)}, indent=2))
    return out
