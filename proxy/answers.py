"""Checks on what an engine answers, so a missing or wrong-typed field becomes a clear 502 (or a
fallback the caller chooses) instead of a KeyError, a 500, or a silently truncated 200."""

from __future__ import annotations

from array import array
from typing import Any

from kvferry.common.errors import BadDataError


class BadAnswer(BadDataError, ValueError):
    """An engine's answer lacks a field the proxy needs, or has it with the wrong type; the
    message names the field."""


def is_ids(v: Any) -> bool:
    """A non-empty list of token ids (non-negative 64-bit ints). Checked in C by array(): a
    Python loop over a long prompt's ids held the event loop for a second."""
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
