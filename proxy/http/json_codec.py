"""JSON in and out of the proxy, on msgspec: a request body, an engine's answer and every chunk it
relays are parsed and written here, and only here.

msgspec rather than the json module: it decodes and encodes several times faster, which bounds how
long one large body holds the event loop (decoding in a thread would not help: it holds the GIL).
It writes compact JSON, as vLLM does, which the byte-level chunk rewriter (openai/stream_relay.py)
relies on.

Nesting. msgspec decodes recursively, bounded by the interpreter's recursion limit: past it
(about 1,000 levels, fewer the deeper the caller's stack) it raises RecursionError, which is no
ValueError, so a client's `[[[[...` would reach the guard as an internal error. `loads` turns it
into a ValueError (`TooDeep`). A client's body (`loads_request`) is held to a bound of its own,
MAX_DEPTH, well under that limit: what decoded is then also re-encoded, copied and printed by the
proxy's own (recursive) code without a RecursionError wherever that runs. The check costs one pass
of `bytes.translate` over the body (a count of `[` and `{`); only a body with more than MAX_DEPTH
of them, which few are, is scanned for its depth, in C-level passes too (its strings dropped by
`split`, its brackets by `translate`, then counted a block at a time).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import msgspec

from kvferry.common.errors import BadDataError

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_ID_LIST = msgspec.json.Decoder(list[int])

MAX_DEPTH = 256  # nesting levels of a client's JSON body (OpenAI's own schemas nest a few dozen at most)
_OPENERS = b"[{"
_ALL_BUT_OPENERS = bytes(c for c in range(256) if c not in _OPENERS)
_ALL_BUT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_STEP = [1 if c == ord("[") else -1 for c in range(256)]  # over brackets only
_BLOCK = 64  # brackets summed by one count() where the depth cannot pass the bound within them


class TooDeep(BadDataError, ValueError):
    """JSON nested deeper than its decoder takes (msgspec's RecursionError) or than MAX_DEPTH."""

    def __init__(self, limit: int | None = None) -> None:
        bound = f"{limit} levels" if limit is not None else "the decoder allows"
        super().__init__(f"JSON nested deeper than {bound}")


def loads(raw: bytes) -> Any:
    """JSON text to Python objects (ValueError when it is not JSON, TooDeep among them)."""
    try:
        return _decoder.decode(raw)
    except RecursionError:
        raise TooDeep() from None


def loads_request(raw: bytes, limit: int = MAX_DEPTH) -> Any:
    """A client's JSON body: loads(), and TooDeep when it nests deeper than `limit`."""
    try:
        obj = _decoder.decode(raw)
    except RecursionError:
        raise TooDeep(limit) from None
    if len(raw.translate(None, _ALL_BUT_OPENERS)) > limit and deeper_than(raw, limit):
        raise TooDeep(limit)
    return obj


def deeper_than(raw: bytes, limit: int) -> bool:
    """Does valid JSON `raw` nest deeper than `limit`? Brackets inside strings do not count."""
    if b"\\" in raw:  # escapes pair off from the left, so once `\\` is gone every `\"` is a quote's
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(raw.split(b'"')[::2]).translate(_AS_SQUARE, _ALL_BUT_BRACKETS)  # outside strings
    depth, count, n = 0, brackets.count, len(brackets)
    for i in range(0, n, _BLOCK):
        opens = count(b"[", i, i + _BLOCK)
        if depth + opens > limit and max(accumulate(map(_STEP.__getitem__, brackets[i:i + _BLOCK]),
                                                    initial=depth)) > limit:
            return True
        depth += 2 * opens - min(_BLOCK, n - i)
    return False


def dumps(obj: Any) -> bytes:
    """Compact JSON, as vLLM writes it."""
    return _encoder.encode(obj)


def int_list(raw: bytes) -> list[int]:
    """A JSON list of integers (ValueError otherwise: msgspec's errors are ValueErrors)."""
    return _ID_LIST.decode(raw)
