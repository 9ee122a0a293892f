"""JSON in and out of the proxy, on msgspec: a request body, an engine's answer and every chunk it
relays are parsed and written here, and only here.

msgspec rather than the json module: it decodes and encodes several times faster, which bounds how
long one large body holds the event loop (decoding in a thread would not help: it holds the GIL).
It writes compact JSON, as vLLM does, which the byte-level chunk rewriter (openai/rewrite.py)
relies on.
"""

from __future__ import annotations

from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_ID_LIST = msgspec.json.Decoder(list[int])


def loads(raw: bytes) -> Any:
    """JSON text to Python objects (ValueError when it is not JSON)."""
    return _decoder.decode(raw)


def dumps(obj: Any) -> bytes:
    """Compact JSON, as vLLM writes it."""
    return _encoder.encode(obj)


def int_list(raw: bytes) -> list[int]:
    """A JSON list of integers (ValueError otherwise: msgspec's errors are ValueErrors)."""
    return _ID_LIST.decode(raw)
