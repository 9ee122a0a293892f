"""Small random-weight models with a locally trained tokenizer, for tests and the demo.

``llama`` (the default) is a dense GQA model; ``deepseek`` is a DeepSeek-V2-architecture MLA model
(one 576-wide latent vector per token per layer: kv_lora_rank 512 + qk_rope_head_dim 64, the only
shape vLLM's CPU_MLA decode kernel compiles for; vLLM CPU forces block_size 16 for it), all layers
dense (no MoE experts) so it stays small.

No network: the tokenizer is trained on seeded synthetic text and the weights are drawn from a
seeded torch generator, so every machine builds the same files. Sized so vLLM's CPU build loads
it in seconds while its KV cache is 16 KiB per token (8 layers x 8 KV heads x 64 x 2 x bf16).

``llama-copy`` is a smaller Llama (2 layers, GQA 2:1) *trained* here, in about 2.5 minutes on one
core, to continue a repeated 16-token pattern (``copy_prompt``): its answers read the cached KV of
the pattern's last period with the large margins of a trained model, where the random models'
margins are tiny. It judges lossy KV (``remote_serde: cachegen``): a greedy answer that survives
there says the codec kept what attention reads; on the random models any lossy KV flips answers.
``deepseek-copy`` is the same task on the MLA architecture (2 layers, the 576-wide latent vLLM's
CPU MLA kernel needs), also about 2.5 minutes: it judges a lossy codec on MLA's latent KV.

``kv_heads`` builds the Llama with fewer KV heads than its 8 (e.g. 1: at TP=2 every rank holds a
copy of the one head, vLLM's replicated heads), into a directory of its own (``tiny-llama-kv1``);
the default 8 is the model above, byte for byte, in ``tiny-llama``. The tokenizer is the same.

Initialisation is at unit scale (not the usual 0.02) so attention, not just the last token,
decides the next token: a transfer that delivers wrong KV changes the output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvferry.common.paths import cache_root

# Bump when anything below changes what is written; a cached model of another version is rebuilt.
TINY_MODEL_VERSION = 1
SEED = 1234
STAMP = "kvferry_tiny_model.json"

ARCH: dict[str, Any] = {  # a config.json: values of mixed types
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
TARGET_VOCAB = 4096
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the of and to in is was that for on as with by at from his her they this which be or had "
    "an not are but were we all one their has have been there who its more would when will no "
    "if out so said what up about into than them can only other new some time could these two "
    "may first then do any like my now over such our man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three cache memory token model layer "
    "prefill decode transfer buffer page chunk kernel network engine proxy request stream answer "
    "question system server client vector tensor matrix value key query head attention weight "
    "river mountain forest ocean city garden window kitchen letter music paper story picture "
    "quickly slowly happily bright dark green blue red yellow purple silver golden ancient "
    "explain describe significance language models latest generation comprehensive suite dense "
    "experts tell me a story about once upon there lived king queen dragon castle village"
).split()


# The MLA model: attention heads split over TP ranks (4 -> 2 per rank at TP=2); the latent cache is
# the same on every rank. KV per token: 8 layers x 576 x bf16 = 9 KiB.
DEEPSEEK_ARCH: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
# The copy model (llama-copy, see above): trained to continue a pattern of COPY_PERIOD tokens.
COPY_ARCH: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
COPY_PERIOD = 16
COPY_TOKENS = (10, 522)  # the ids [lo, hi) a pattern draws from (its logits are the ones trained)
# (steps, batch, tokens): short sequences first (the copy is learnt there in a few hundred steps),
# then long ones, so that prompts of up to a thousand tokens keep the margins.
COPY_SCHEDULE, COPY_LR = ((400, 16, 128), (600, 4, 512)), 3e-3
# deepseek-copy: the copy task on the DeepSeek-V2 MLA architecture (kv_lora_rank 512 + rope 64, as
# vLLM's CPU MLA kernel needs), all layers dense. Its 512-wide latent makes a step about twice a
# llama-copy step; at llama-copy's learning rate the copy is not learnt in the first 400 steps.
COPY_MLA_ARCH: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
COPY_MLA_SCHEDULE, COPY_MLA_LR = ((300, 16, 128), (300, 4, 512)), 1e-3
# The trained models: (steps, batch, tokens) schedule and peak learning rate of each.
COPY_RECIPES: dict[str, tuple[tuple[tuple[int, int, int], ...], float]] = {
    "llama-copy": (COPY_SCHEDULE, COPY_LR), "deepseek-copy": (COPY_MLA_SCHEDULE, COPY_MLA_LR)}
ARCHES = ("llama", "deepseek", *COPY_RECIPES)
KV_HEADS = ARCH["num_key_value_heads"]  # the Llama's default; fewer must divide its attention heads


def default_dir(arch: str = "llama", kv_heads: int = KV_HEADS) -> Path:
    _check_arch(arch, kv_heads)
    return cache_root() / (f"tiny-{arch}" if kv_heads == KV_HEADS else f"tiny-{arch}-kv{kv_heads}")


def _check_arch(arch: str, kv_heads: int = KV_HEADS) -> None:
    if arch not in ARCHES:
        raise ValueError(f"tiny model arch {arch!r} is not one of {ARCHES}")
    if kv_heads == KV_HEADS:
        return
    if arch != "llama":
        raise ValueError(f"kv_heads applies to the llama tiny model only (the {arch} model has its own)")
    nh = ARCH["num_attention_heads"]
    if not 1 <= kv_heads <= nh or nh % kv_heads:
        raise ValueError(f"kv_heads {kv_heads} must divide the tiny Llama's {nh} attention heads")


def _corpus(n_lines: int = 20000) -> list[str]:
    rng = random.Random(SEED)
    punct = [".", ",", "?", "!", ";", ":"]
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        lines.append(" ".join(words).capitalize() + rng.choice(punct))
    return lines


def _train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": ARCH["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=2))
    return tok.get_vocab_size()


def _write_weights(out: Path, vocab: int, eos_id: int, kv_heads: int = KV_HEADS) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(SEED)
    h, inter = ARCH["hidden_size"], ARCH["intermediate_size"]
    nh, nkv, hd = ARCH["num_attention_heads"], kv_heads, ARCH["head_dim"]

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, h, std=1.0)}
    for i in range(ARCH["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        # Sharp attention (q, k at 2x unit scale) makes outputs depend on specific past tokens.
        w[p + "self_attn.q_proj.weight"] = rnd(nh * hd, h, std=2.0 / h**0.5)
        w[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, h, std=2.0 / h**0.5)
        w[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, h, std=1.0 / h**0.5)
        w[p + "self_attn.o_proj.weight"] = rnd(h, nh * hd, std=1.0 / (nh * hd) ** 0.5)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h, std=1.0 / h**0.5)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h, std=1.0 / h**0.5)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter, std=1.0 / inter**0.5)
    w["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    lm_head = rnd(vocab, h, std=1.0 / h**0.5)
    # EOS never wins a greedy step, so every answer runs to max_tokens (stable benchmarks).
    lm_head[eos_id] = 0
    w["lm_head.weight"] = lm_head
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_deepseek_weights(out: Path, vocab: int, eos_id: int) -> None:
    import torch
    from safetensors.torch import save_file

    a = DEEPSEEK_ARCH
    g = torch.Generator().manual_seed(SEED)
    h, inter, nh = a["hidden_size"], a["intermediate_size"], a["num_attention_heads"]
    lora, rope, nope, vd = a["kv_lora_rank"], a["qk_rope_head_dim"], a["qk_nope_head_dim"], a["v_head_dim"]

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, h, std=1.0)}
    for i in range(a["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        # Sharp attention (q and the latent's key part at 2x unit scale), as in the Llama model.
        w[p + "self_attn.q_proj.weight"] = rnd(nh * (nope + rope), h, std=2.0 / h**0.5)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = rnd(lora + rope, h, std=2.0 / h**0.5)
        w[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(lora, dtype=torch.bfloat16)
        w[p + "self_attn.kv_b_proj.weight"] = rnd(nh * (nope + vd), lora, std=1.0 / lora**0.5)
        w[p + "self_attn.o_proj.weight"] = rnd(h, nh * vd, std=1.0 / (nh * vd) ** 0.5)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h, std=1.0 / h**0.5)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h, std=1.0 / h**0.5)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter, std=1.0 / inter**0.5)
    w["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    lm_head = rnd(vocab, h, std=1.0 / h**0.5)
    lm_head[eos_id] = 0
    w["lm_head.weight"] = lm_head
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})


def _config(arch: str, vocab: int, ids: dict[str, int], kv_heads: int = KV_HEADS) -> dict:
    common = {
        "vocab_size": vocab,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }
    if arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, **ARCH,
                "num_key_value_heads": kv_heads}
    if arch == "llama-copy":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, **COPY_ARCH}
    mla = COPY_MLA_ARCH if arch == "deepseek-copy" else DEEPSEEK_ARCH
    return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **common,
            **mla, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 1,
            "moe_intermediate_size": 256, "moe_layer_freq": 1, "topk_method": "greedy",
            # Every layer dense (MLP, no experts): the MoE fields above are never instantiated.
            "first_k_dense_replace": mla["num_hidden_layers"]}


def copy_prompt(rng: random.Random, tokens: int) -> list[int]:
    """A prompt of the copy model's task: a random pattern of COPY_PERIOD ids, repeated."""
    pattern = [rng.randrange(*COPY_TOKENS) for _ in range(COPY_PERIOD)]
    return (pattern * (tokens // COPY_PERIOD + 1))[:tokens]


def _write_copy_weights(out: Path, arch: str, config: dict[str, Any], eos_id: int) -> float:
    """Train copy model `arch` (float32, one thread, seeded) of `config`, write it in bfloat16 and
    return its last training loss."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    schedule, lr = COPY_RECIPES[arch]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one machine's runs give the same weights
    try:
        torch.manual_seed(SEED)
        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields),
                                                 dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        total = sum(steps for steps, _, _ in schedule)
        # cosine decay to zero: the last steps sharpen the margins
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / total)))
        rng = random.Random(SEED)
        loss = float("nan")
        for steps, batch, tokens in schedule:
            for _ in range(steps):
                x = torch.tensor([copy_prompt(rng, tokens) for _ in range(batch)])
                loss = _copy_step(model, opt, x)
                sched.step()
        w = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)
    w["lm_head.weight"][eos_id] = 0  # EOS never wins a greedy step
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return loss


def _copy_step(model: Any, opt: Any, x: Any) -> float:
    import torch

    lo, hi = COPY_TOKENS
    hidden = model.model(x).last_hidden_state[:, COPY_PERIOD - 1:-1]
    # Only the pattern's ids compete (a fraction of the vocabulary's cost); the first period
    # cannot be predicted and is not trained on.
    logits = hidden @ model.lm_head.weight[lo:hi].T
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), (x[:, COPY_PERIOD:] - lo).flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def build(out: Path, arch: str = "llama", kv_heads: int = KV_HEADS) -> Path:
    """Write the tiny model of architecture `arch` (the Llama with `kv_heads` KV heads) into `out`
    (atomically) and return it."""
    _check_arch(arch, kv_heads)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        tok_vocab = _train_tokenizer(tmp)
        tok = json.loads((tmp / "tokenizer.json").read_text())
        ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
        vocab = (tok_vocab + 63) // 64 * 64
        config = _config(arch, vocab, ids, kv_heads)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "do_sample": False}, indent=2))
        trained: dict[str, Any] = {}
        if arch == "llama":
            _write_weights(tmp, vocab, ids["</s>"], kv_heads)
        elif arch in COPY_RECIPES:
            trained["copy_task_loss"] = round(_write_copy_weights(tmp, arch, config, ids["</s>"]), 4)
        else:
            _write_deepseek_weights(tmp, vocab, ids["</s>"])
        digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
        stamp: dict[str, Any] = {"version": TINY_MODEL_VERSION, "arch": arch, "seed": SEED, "weights_sha256": digest,
                                 **trained}
        if kv_heads != KV_HEADS:  # the default model's stamp stays as it was
            stamp["kv_heads"] = kv_heads
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_current(path: Path, kv_heads: int | None = None) -> bool:
    """A model of this version is built at `path` (with `kv_heads` KV heads, when given)."""
    try:
        stamp = json.loads((Path(path) / STAMP).read_text())
        return stamp["version"] == TINY_MODEL_VERSION and (
            kv_heads is None or stamp.get("kv_heads", KV_HEADS) == kv_heads)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def ensure(path: Path | None = None, arch: str = "llama", kv_heads: int = KV_HEADS) -> Path:
    """The tiny model's directory, built on first use (or when its version is stale)."""
    import fcntl

    path = Path(path) if path else default_dir(arch, kv_heads)
    # The stamp's kv_heads is checked for the Llama only (a built deepseek stamp names none).
    want = kv_heads if arch == "llama" else None
    if is_current(path, want):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Several test processes may ask at once: one builds, the others wait and reuse it.
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_current(path, want):
            build(path, arch, kv_heads)
    return path
