"""Checks on what an engine answers, so a missing or wrong-typed field becomes a clear 502 (or a
fallback the caller chooses) instead of a KeyError, a 500, or a silently truncated 200."""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from kvferry.common.errors import BadDataError
from kvferry.proxy.http import json_codec

# A prompt's token ids kept as the engine's JSON (msgspec.Raw) rather than a list: a long prompt's
# ids were a prefill answer's whole decoding cost, and again its decode leg's encoding, per request.
RAW_IDS_MIN = 64  # bytes: a shorter list is parsed as it is
_DIGITS_AND_SPACE = b"0123456789, \t\r\n"


class BadAnswer(BadDataError, ValueError):
    """An engine's answer lacks a field the proxy needs, or has it with the wrong type; the
    message names the field."""


_KEY = b'"prompt_token_ids":'
_CUT = b'"\\u0000kvferry:prompt_token_ids"'  # what stands in for the ids while the rest is parsed
_CUT_STR = "\x00kvferry:prompt_token_ids"


def loads_answer(buf: bytes) -> Any:
    """A completion or chat answer as loads() gives it, but with the prompt's token ids
    (choices[0].prompt_token_ids, a completion's; or the top-level prompt_token_ids, a chat
    answer's) left as the engine wrote them (msgspec.Raw) when they are a long flat list: see
    ids_list / join_ids. The first list under that key is found by its key (a key inside a string
    would have its quotes escaped), cut out and replaced by a marker while the rest is parsed;
    unless the marker is then exactly at one of those two places, the answer is parsed whole."""
    k = buf.find(_KEY)
    if k < 0:
        return json_codec.loads(buf)
    start = k + len(_KEY)
    while buf[start:start + 1] in (b" ", b"\t", b"\r", b"\n"):
        start += 1
    end = buf.find(b"]", start) + 1
    if (buf[start:start + 1] != b"[" or end - start < RAW_IDS_MIN or _CUT in buf
            or buf[start:end].translate(None, _DIGITS_AND_SPACE) != b"[]"):
        return json_codec.loads(buf)  # short, absent, not a flat list of numbers: parsed as it is
    try:
        out = json_codec.loads(buf[:start] + _CUT + buf[end:])
        holder = out["choices"][0] if out.get("prompt_token_ids") != _CUT_STR else out
        if holder["prompt_token_ids"] != _CUT_STR:
            raise TypeError
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return json_codec.loads(buf)  # the key was another field's: parsed whole
    holder["prompt_token_ids"] = msgspec.Raw(buf[start:end])
    return out


def ids_list(v: Any) -> Any:
    """A prompt's token ids as a list, where loads_answer kept them raw."""
    return msgspec.json.decode(v) if isinstance(v, msgspec.Raw) else v


def count_ids(v: Any) -> int:
    """How many ids (0 for None), without parsing raw ones."""
    if isinstance(v, msgspec.Raw):
        return bytes(v).count(b",") + 1
    return len(v or [])


def join_ids(ids: Any, more: list[int]) -> Any:
    """`ids` followed by `more` (both checked by is_ids): raw ids stay raw, for the encoder to copy."""
    if not isinstance(ids, msgspec.Raw):
        return ids + list(more)
    if not more:
        return ids
    return msgspec.Raw(bytes(ids).rstrip()[:-1] + b"," + b",".join(b"%d" % t for t in more) + b"]")


def is_ids(v: Any) -> bool:
    """A non-empty list of token ids (non-negative 64-bit ints). Checked in C by array(): a
    Python loop over a long prompt's ids held the event loop for a second. Raw ids (valid JSON,
    as msgspec read them) are a list of non-negative integers when they hold only digits, commas
    and spaces between their one pair of brackets (a number too large is then the engine's to
    refuse, as vLLM refuses an id outside its vocabulary)."""
    if isinstance(v, msgspec.Raw):
        b = bytes(v)
        return b.translate(None, _DIGITS_AND_SPACE) == b"[]" and b.strip(b"[] \t\r\n") != b""
    if not isinstance(v, list) or not v:
        return False
    try:
        array("Q", v)
    except (TypeError, OverflowError):
        return False
    return True


def choice0(out: Any, kind: str = "completion") -> dict:
    """`out.choices[0]` of a non-streamed answer, checked: a dict whose text (completions) or
    message (chat) has the right type."""
    if not isinstance(out, dict):
        raise BadAnswer(f"the answer is {type(out).__name__}, not a JSON object")
    choices = out.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadAnswer("the answer has no choices[0] object")
    c = choices[0]
    if kind == "completion":
        if not isinstance(c.get("text", ""), (str, type(None))):
            raise BadAnswer("choices[0].text is not a string")
    else:
        msg = c.get("message")
        if not isinstance(msg, dict):
            raise BadAnswer("choices[0].message is not an object")
        if not isinstance(msg.get("content"), (str, type(None))):
            raise BadAnswer("choices[0].message.content is not a string")
    fr = c.get("finish_reason")
    if fr is not None and not isinstance(fr, str):
        raise BadAnswer("choices[0].finish_reason is not a string")
    if "usage" in out and out["usage"] is not None:
        usage(out)
    lp = c.get("logprobs")
    if lp is not None and not isinstance(lp, dict):
        raise BadAnswer("choices[0].logprobs is not an object")
    return c


def usage(out: dict) -> dict:
    """The answer's usage ({} when absent); counts must be non-negative ints."""
    u = out.get("usage")
    if u is None:
        return {}
    if not isinstance(u, dict):
        raise BadAnswer("usage is not an object")
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        v = u.get(k, 0)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise BadAnswer(f"usage.{k} is not a count")
    return u


def chunk(data: Any) -> dict:
    """One streamed chunk: an object whose choices (if any) are objects."""
    if not isinstance(data, dict):
        raise BadAnswer("a streamed chunk is not a JSON object")
    cs = data.get("choices", [])
    if not isinstance(cs, list) or not all(isinstance(c, dict) for c in cs):
        raise BadAnswer("a streamed chunk's choices are not a list of objects")
    if not all(isinstance(c.get("delta", {}), (dict, type(None))) for c in cs):
        raise BadAnswer("a streamed chunk's delta is not an object")
    if data.get("usage") is not None:
        usage(data)
    return data
