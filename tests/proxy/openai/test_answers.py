"""proxy/openai/answers.py's raw prompt ids: a prefill answer parsed with its long prompt_token_ids kept
as the engine wrote them equals the answer parsed whole, whatever the engine sends."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvferry.proxy.flows.migrate import continuation_leg
from kvferry.proxy.openai import answers

IDS = list(range(100, 400))


def answer(ids, sep: tuple[str, str] = (",", ":"), **extra) -> bytes:
    c = {"index": 0, "text": " w", "logprobs": None, "finish_reason": "length", "token_ids": [7],
         "prompt_token_ids": ids}
    return json.dumps({"id": "cmpl-1", **extra, "choices": [c], "usage": {"prompt_tokens": 300}},
                      separators=sep).encode()


def whole(buf: bytes):
    out = answers.loads_answer(buf)
    c0 = out["choices"][0] if isinstance(out, dict) and isinstance(out.get("choices"), list) else None
    for holder in (c0, out):
        if isinstance(holder, dict) and "prompt_token_ids" in holder:
            holder["prompt_token_ids"] = answers.ids_list(holder["prompt_token_ids"])
    return out


@pytest.mark.parametrize("buf", [
    answer(IDS), answer(IDS, (", ", ": ")),  # vLLM's compact JSON; json.dumps's default spacing
    answer(IDS, before=IDS),  # the same bytes earlier in the answer
    answer(IDS, prompt_token_ids=IDS[::-1]),  # the key itself earlier (top level): parsed whole, right
    answer(IDS, note="\x00kvferry:prompt_token_ids"),  # the marker in the answer: parsed whole
    answer([[1, 2]] + IDS), answer(["1"] + IDS), answer(IDS + [-1]),  # not a flat list of ids
    answer([1, 2, 3]), answer(None), answer(IDS[:5]),  # short or no ids: parsed as they are
    b'{"choices": "nope"}', b'{"choices": [5]}', b"[1,2]", b'{"x": 1}',  # not the usual shape
])
def test_parsed_with_raw_ids_equals_parsed_whole(buf: bytes) -> None:
    assert whole(buf) == json.loads(buf)


def test_a_chat_answers_top_level_ids_stay_raw() -> None:
    buf = json.dumps({"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "w"},
                                                       "token_ids": [7]}], "prompt_token_ids": IDS}).encode()
    out = answers.loads_answer(buf)
    assert isinstance(out["prompt_token_ids"], msgspec.Raw) and answers.ids_list(out["prompt_token_ids"]) == IDS
    assert whole(buf) == json.loads(buf)


def test_long_ids_stay_raw_and_fit_every_use() -> None:
    out = answers.loads_answer(answer(IDS, (", ", ": ")))
    raw = out["choices"][0]["prompt_token_ids"]
    assert isinstance(raw, msgspec.Raw) and answers.is_ids(raw)
    assert answers.count_ids(raw) == len(IDS) and answers.ids_list(raw) == IDS
    leg = msgspec.json.decode(msgspec.json.encode({"prompt": answers.join_ids(raw, [7, 8])}))
    assert leg["prompt"] == IDS + [7, 8]
    assert continuation_leg({"prompt": None, "max_tokens": 9}, raw, [5], 3, None)["prompt"] == IDS + [5]
    assert answers.join_ids(IDS, [7]) == IDS + [7] and answers.join_ids(raw, []) is raw


@pytest.mark.parametrize("ids, ok", [
    (IDS, True), ([0] * 40, True),
    ([-1] + IDS, False), ([1.5] + IDS, False), (["7"] + IDS, False), ([[1]] + IDS, False),
    ([None] + IDS, False), ([{"a": 1}] + IDS, False),
])
def test_raw_ids_are_checked_as_lists_are(ids, ok: bool) -> None:
    c0 = answers.loads_answer(answer(ids))["choices"][0]
    assert answers.is_ids(c0["prompt_token_ids"]) is ok
    assert answers.is_ids(ids) is ok
    assert answers.is_ids(msgspec.Raw(b"[" + b" " * 80 + b"]")) is False  # empty, however long
    assert answers.is_ids(msgspec.Raw(b"[true, " + b"1, " * 40 + b"1]")) is False  # not a number
