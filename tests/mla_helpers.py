"""MLA (the tiny DeepSeek-V2) on real vLLM CPU servers: float32 servers (VLLMServer turns vLLM CPU's
rotary op off for MLA: launcher/vllm_proc.py cpu_mla_args), the layout fingerprint of the model's
latent KV, and answers compared across TP sizes (same tokens, logprobs within 1e-3)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from kvferry.common.wire import messages as m
from kvferry.engine.pd.shared import KV_LAYOUT_NAMES
from kvferry.launcher.vllm_proc import VLLMServer

FP32 = ["--dtype", "float32"]


def mla_fingerprint(model: Path) -> m.LayoutFingerprint:
    c = json.loads((model / "config.json").read_text())
    latent, layers = c["kv_lora_rank"] + c["qk_rope_head_dim"], c["num_hidden_layers"]
    return m.LayoutFingerprint(model=model.name, dtype="float32", num_layers=layers, num_kv_heads=1,
                               head_size=latent, block_size=16, kv_layout=KV_LAYOUT_NAMES["mla"],
                               chunk_format="block", chunk_size=256, tp_size=1,
                               page_bytes=layers * 256 * latent * 4, kv_kind="mla")


def close_to(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]], what: str) -> None:
    """Across TP sizes: the same tokens, logprobs within 1e-3 (float32)."""
    assert got[0] == want[0], f"{what}: tokens differ"
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3, f"{what}: logprobs differ"


def prefix_drift(server: VLLMServer, base: list[int]) -> float:
    """How far vLLM's prompt logprobs of `base` move when one more token follows it: exactly 0.0 for a
    causal model. vLLM 0.32's CPU rotary op gives the tiny DeepSeek 0.4 and more (its result depends on
    the batch's token count), unless it is turned off (CPU_MLA_ROTARY_FIX)."""
    def logprobs(p: list[int]) -> list[float]:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": server.served_name, "prompt": p,
                       "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}, timeout=300)
        assert r.status_code == 200, r.text
        return [max(v["logprob"] for v in d.values()) for d in r.json()["choices"][0]["prompt_logprobs"][1:]]
    alone, followed = logprobs(base), logprobs(base + [base[0]])
    return max(abs(a - b) for a, b in zip(alone, followed, strict=False))


def answers_match(answers: list[tuple[tuple[list[int], list[float]], tuple[list[int], list[float]]]]) -> None:
    """The transfer was checked by the caller; the answers across TP sizes are compared last."""
    for i, (got, want) in enumerate(answers):
        close_to(got, want, f"prompt {i}")
