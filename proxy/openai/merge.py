"""Answers put together: the prefiller's first token with the decoder's rest, and the samples of
n>1 or of a batch of prompts, numbered and counted as one vLLM would answer."""

from __future__ import annotations

from kvferry.proxy.openai import answers
from kvferry.proxy.openai.answers import BadAnswer
from kvferry.proxy.openai.legs import prompt_ids


def offset_after(lp: dict | None) -> int:
    """Where the next token's text_offset starts after completion logprobs `lp` (vLLM advances
    by the tokens reported, not by the text)."""
    if not isinstance(lp, dict):
        return 0
    offs, toks = lp.get("text_offset") or [], lp.get("tokens") or []
    if not offs or not toks or not isinstance(offs[-1], int) or not isinstance(toks[-1], str):
        return 0
    return offs[-1] + len(toks[-1])


def shift_offsets(c: dict, shift: int) -> int:
    """Move a streamed choice's logprobs text offsets on by `shift` (returned, for the next chunk)."""
    lp = c.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):
        lp["text_offset"] = [o + shift for o in lp["text_offset"]]
    return shift


def merge_samples(outs: list[dict], n: int) -> dict:
    """One answer from per-prompt, per-sample answers, as vLLM orders and counts them: choice
    index prompt * n + sample; prompt tokens once per prompt, completion tokens per sample."""
    merged = dict(outs[0])
    merged["choices"] = [dict(o["choices"][0], index=i) for i, o in enumerate(outs)]
    us = [o.get("usage") or {} for o in outs]
    prompt = sum(u.get("prompt_tokens") or 0 for u in us[::n])
    completion = sum(u.get("completion_tokens") or 0 for u in us)
    merged["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return merged


def merge_completion(first: dict, rest: dict) -> dict:
    """The prefiller's first token and the decoder's rest as one answer (BadAnswer when the
    decoder's token ids or logprobs do not fit the prefiller's)."""
    a, b = first["choices"][0], rest["choices"][0]
    out = dict(first)
    c = dict(a, text=(a.get("text") or "") + (b.get("text") or ""), finish_reason=b.get("finish_reason"),
             stop_reason=b.get("stop_reason"))
    if "token_ids" in a and b.get("token_ids") is not None:
        if not isinstance(b["token_ids"], list):
            raise BadAnswer("choices[0].token_ids is not a list")
        c["token_ids"] = list(a["token_ids"]) + list(b["token_ids"])
    la, lb = a.get("logprobs"), b.get("logprobs")
    if la and lb:
        shift = offset_after(la)
        try:
            c["logprobs"] = {"tokens": la["tokens"] + lb["tokens"],
                             "token_logprobs": la["token_logprobs"] + lb["token_logprobs"],
                             "top_logprobs": (la.get("top_logprobs") or []) + (lb.get("top_logprobs") or []),
                             "text_offset": (la.get("text_offset") or []) + [o + shift for o in
                                                                              lb.get("text_offset") or []]}
        except (KeyError, TypeError):
            raise BadAnswer("choices[0].logprobs without tokens/token_logprobs lists") from None
    out["choices"] = [c]
    pu, du = answers.usage(first), answers.usage(rest)
    prompt_tokens = pu.get("prompt_tokens") or answers.count_ids(prompt_ids(first))
    completion = (pu.get("completion_tokens") or 1) + (du.get("completion_tokens") or 0)
    out["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion}
    out.pop("kv_transfer_params", None)
    return out
