"""A request's KV identity as the proxy can predict it: the root its prompt's block keys chain
from (routing/prefix_index.py), from the body's ``model`` (an adapter the events named) and
``cache_salt``. A prompt with inputs the proxy cannot hash (prompt embeddings, images, audio,
video) is not predicted at all: it is routed by load, as the engines key those inputs themselves.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from kvferry.proxy.routing.prefix_index import identity_root


def prompt_root(body: dict[str, Any], adapters: Container[str]) -> bytes | None:
    """The root of the prompt's chain, or None when its KV depends on what the proxy cannot hash."""
    if body.get("prompt_embeds") is not None or body.get("multi_modal_data") is not None:
        return None
    msgs = body.get("messages")
    if isinstance(msgs, list):
        for msg in msgs:
            parts = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(parts, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in parts):
                return None
    model = body.get("model")
    salt = body.get("cache_salt")
    return identity_root(model if isinstance(model, str) and model in adapters else None,
                         salt if isinstance(salt, str) and salt else None)
