"""The tiny model: deterministic, big enough KV, and served by real vLLM with context-dependent output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest

from kvferry.launcher import tiny_model
from kvferry.launcher.vllm_proc import VLLMServer


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic(tmp_path: Path, tiny_model_path: Path) -> None:
    fresh = tiny_model.build(tmp_path / "m")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert sha(fresh / name) == sha(tiny_model_path / name), name


def test_kv_is_at_least_16_kib_per_token(tiny_model_path: Path) -> None:
    c = json.loads((tiny_model_path / "config.json").read_text())
    kv_bytes = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2  # K+V, bf16
    assert kv_bytes >= 16 * 1024


def test_stale_model_is_rebuilt(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / tiny_model.STAMP).write_text(json.dumps({"version": -1}))
    assert not tiny_model.is_current(out)
    tiny_model.ensure(out)
    assert tiny_model.is_current(out) and (out / "model.safetensors").exists()


def test_fewer_kv_heads_build_their_own_model_with_the_same_tokenizer(
        tmp_path: Path, tiny_model_path: Path, tiny_kv1_model_path: Path) -> None:
    """`make-tiny-model --kv-heads 1`: the Llama with one KV head (replicated at TP 2) in a directory of
    its own; the default model (8 heads) and its stamp are what they were, and one is never taken for
    the other."""
    from safetensors import safe_open

    assert tiny_kv1_model_path.name == "tiny-llama-kv1" and tiny_model.default_dir() == tiny_model_path
    c = json.loads((tiny_kv1_model_path / "config.json").read_text())
    assert c["num_key_value_heads"] == 1 and c["num_attention_heads"] == 8
    with safe_open(str(tiny_kv1_model_path / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape()) == (64, 512)
    assert sha(tiny_kv1_model_path / "tokenizer.json") == sha(tiny_model_path / "tokenizer.json")
    assert "kv_heads" not in json.loads((tiny_model_path / tiny_model.STAMP).read_text())
    assert tiny_model.is_current(tiny_kv1_model_path, 1) and not tiny_model.is_current(tiny_kv1_model_path, 8)
    assert tiny_model.is_current(tiny_model_path, 8) and not tiny_model.is_current(tiny_model_path, 1)
    fresh = tiny_model.build(tmp_path / "kv1", kv_heads=1)
    assert sha(fresh / "model.safetensors") == sha(tiny_kv1_model_path / "model.safetensors")
    # Asked for one KV head where the 8-head model lies, ensure rebuilds it rather than serve the wrong one.
    other = tiny_model.build(tmp_path / "m")
    assert tiny_model.ensure(other, kv_heads=1) == other and tiny_model.is_current(other, 1)
    for bad, arch in ((3, "llama"), (0, "llama"), (16, "llama"), (1, "deepseek")):
        with pytest.raises(ValueError):
            tiny_model.default_dir(arch, bad)


def test_make_tiny_model_cli_names_a_bad_kv_heads(capsys: pytest.CaptureFixture[str]) -> None:
    from kvferry.launcher.cli import main

    assert main(["make-tiny-model", "--kv-heads", "3"]) == 2
    assert "must divide" in capsys.readouterr().err
    assert main(["make-tiny-model", "--arch", "deepseek", "--kv-heads", "1"]) == 2
    assert "llama tiny model only" in capsys.readouterr().err


def complete(server: VLLMServer, prompt: str | list[int], n: int = 16) -> list[int]:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": server.served_name, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == n and choice["finish_reason"] == "length"
    return choice["token_ids"]


@pytest.mark.vllm
def test_vllm_serves_it_and_output_depends_on_context(plain_vllm: VLLMServer) -> None:
    prompts = ["Tell me a story about the king", "Explain the significance of KV cache.",
               "The river and the mountain", "Once upon a time there lived a dragon"]
    outs = [complete(plain_vllm, p) for p in prompts]
    assert len({tuple(o) for o in outs}) == len(prompts), "greedy continuations must differ"
    # Changing only the first token changes the continuation: attention reaches far back.
    base = list(range(100, 400))
    other = [101] + base[1:]
    assert complete(plain_vllm, base) != complete(plain_vllm, other)
    r = httpx.post(f"{plain_vllm.url}/v1/chat/completions", timeout=120, json={
        "model": plain_vllm.served_name, "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    assert r.json()["choices"][0]["message"]["content"]


def test_tiny_deepseek_mla_is_what_vllm_cpu_mla_needs() -> None:
    """`make-tiny-model --arch deepseek`: a DeepSeek-V2 config transformers accepts, a 576-wide
    latent (kv_lora_rank 512 + qk_rope_head_dim 64: the only head size of vLLM's CPU_MLA decode
    kernel), every layer dense, weights of the shapes vLLM's loader expects."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = tiny_model.ensure(arch="deepseek")
    assert path.name == "tiny-deepseek"
    c = AutoConfig.from_pretrained(str(path))
    assert c.model_type == "deepseek_v2" and c.kv_lora_rank + c.qk_rope_head_dim == 576
    assert c.first_k_dense_replace == c.num_hidden_layers and c.q_lora_rank is None
    assert c.num_attention_heads % 2 == 0  # splits over TP 2
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").get_shape()) == (576, 512)
    assert not any("experts" in n for n in names)
    # Same tokenizer as the Llama model: prompts mean the same on both.
    assert sha(path / "tokenizer.json") == sha(tiny_model.ensure() / "tokenizer.json")
    with pytest.raises(ValueError, match="not one of"):
        tiny_model.default_dir("gpt2")


@pytest.mark.parametrize(("arch", "model_type"), [("llama-copy", "llama"), ("deepseek-copy", "deepseek_v2")])
def test_tiny_copy_models_continue_their_pattern_with_a_trained_models_margin(arch: str, model_type: str) -> None:
    """`make-tiny-model --arch llama-copy|deepseek-copy`: trained here, each continues a repeated
    16-token pattern at every prompt length the tests use, its answer ahead of the runner-up by
    several nats (what lets it judge lossy KV: a random-weight model's margins are a fraction of one)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_model.ensure(arch=arch)
    assert path.name == f"tiny-{arch}"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert model.config.model_type == model_type
    if arch == "deepseek-copy":  # the latent vLLM's CPU MLA kernel takes
        assert model.config.kv_lora_rank + model.config.qk_rope_head_dim == 576
    rng = random.Random(1)
    for tokens in (128, 300, 600, 1000):
        p = tiny_model.copy_prompt(rng, tokens)
        with torch.no_grad():
            logprobs = model(torch.tensor([p])).logits[0, -1].log_softmax(-1)
        top = logprobs.topk(2)
        assert int(top.indices[0]) == p[tokens - tiny_model.COPY_PERIOD], tokens
        assert float(top.values[0] - top.values[1]) > 3.0, tokens
    # Same tokenizer as the other tiny models.
    assert sha(path / "tokenizer.json") == sha(tiny_model.ensure() / "tokenizer.json")
