"""A prompt's token ids before it is routed, from the model's own tokenizer in the proxy
(`--tokenizer`): no /tokenize round trip per request.

The fast tokenizer (`tokenizer.json`, the `tokenizers` library) and the chat template
(`tokenizer_config.json`, rendered with jinja2 as transformers does) are loaded without
transformers or torch, so the proxy stays light. A prediction that differs from what vLLM
computes only costs routing quality: the engines tokenize the prompt themselves, as without this.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from pathlib import Path
from typing import Any

from kvferry.common.errors import ConfigurationError
from kvferry.common.log import RateLimitedLog, get_logger

logger = get_logger(__name__)

CACHE_TEXTS = 256  # recent prompt texts kept tokenized (a shared document is tokenized once)
MAX_TEXT_CHARS = 1 << 20  # longer texts are not tokenized: routed by load
# Longer texts are tokenized on a thread (the tokenizers library releases the GIL while it
# encodes): a long prompt held the event loop, and every other request, for milliseconds. Shorter
# ones stay on the loop, where the hop to a thread would cost more than the encoding.
OFF_LOOP_CHARS = 4096


class TokenizerError(ConfigurationError, ValueError):
    """The tokenizer named by --tokenizer cannot be loaded; the message says why."""


def _folder(name: str) -> Path:
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - only for a model name
    except ImportError:
        raise TokenizerError(f"{name} is not a folder (and huggingface_hub is not installed to fetch it)") from None
    return Path(snapshot_download(name, allow_patterns=["tokenizer.json", "tokenizer_config.json",
                                                        "special_tokens_map.json"]))


def _token_text(v: Any) -> str:
    return v.get("content", "") if isinstance(v, dict) else str(v or "")


class PromptTokens:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._tok: Any = None
        self._encode_fast: Any = None
        self._template: Any = None
        self._specials: dict[str, str] = {}
        self._failed = RateLimitedLog(logger, 60.0)
        self._encode = functools.lru_cache(maxsize=CACHE_TEXTS)(self._encode_text)
        if path:
            self._load(path)

    def _load(self, name: str) -> None:
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415 - optional: pip install 'kvferry[routing]'
        except ImportError:
            raise TokenizerError("the tokenizers library is missing: pip install 'kvferry[routing]'") from None
        folder = _folder(name)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json (a fast tokenizer is needed)")
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # The same ids as encode() without the character offsets it also computes, which cost CPU
        # on every prompt (tokenizers >= 0.20; older ones have encode() only). One text per call, so
        # no rayon pool (a thread per core, a hand-off per prompt) unless the user asks for one.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._encode_fast = getattr(self._tok, "encode_batch_fast", None)
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            import jinja2.sandbox  # noqa: PLC0415 - only with a chat template

            def raise_exception(msg: str) -> None:
                raise jinja2.exceptions.TemplateError(msg)
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
            self._template = env.from_string(template)

    @property
    def enabled(self) -> bool:
        return self._tok is not None

    def completion(self, prompt: Any) -> list[int] | None:
        """vLLM's tokens for a /v1/completions prompt (special tokens added, as vLLM does)."""
        if isinstance(prompt, list):
            return prompt if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt) else None
        if not isinstance(prompt, str) or self._tok is None or len(prompt) > MAX_TEXT_CHARS:
            return None
        return list(self._encode(prompt))

    async def completion_async(self, prompt: Any) -> list[int] | None:
        """completion(), on a thread for a long text prompt."""
        if isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS and self._tok is not None:
            return await asyncio.to_thread(self.completion, prompt)
        return self.completion(prompt)

    async def chat_async(self, body: dict) -> list[int] | None:
        """chat(), on a thread for a long conversation (rendering its template included)."""
        if self._tok is None or self._template is None:
            return None
        msgs = body.get("messages")
        size = sum(len(m.get("content") or "") if isinstance(m, dict) and isinstance(m.get("content"), str)
                   else OFF_LOOP_CHARS for m in msgs) if isinstance(msgs, list) else 0
        if size > OFF_LOOP_CHARS:
            return await asyncio.to_thread(self.chat, body)
        return self.chat(body)

    def _encode_text(self, text: str, special: bool = True) -> tuple[int, ...]:
        if self._encode_fast is not None:
            return tuple(self._encode_fast([text], add_special_tokens=special)[0].ids)
        return tuple(self._tok.encode(text, add_special_tokens=special).ids)

    def chat(self, body: dict) -> list[int] | None:
        """The tokens of a chat request's rendered template; None where it cannot be rendered here."""
        if self._tok is None or self._template is None or len(str(body.get("messages"))) > MAX_TEXT_CHARS:
            return None
        try:
            msgs = [dict(m, content=_flatten(m.get("content"))) for m in body["messages"]]
            kw = body.get("chat_template_kwargs") or {}
            text = self._template.render(messages=msgs, tools=body.get("tools"),
                                         add_generation_prompt=body.get("add_generation_prompt", True),
                                         **self._specials, **kw)
            # vLLM tokenizes a rendered chat prompt without adding special tokens again.
            return list(self._encode(text, False))
        except Exception as e:  # noqa: BLE001 - a template the proxy cannot render is a routing miss
            self._failed.warning("cannot predict a chat prompt's tokens (%s: %s): routing it by load",
                                 type(e).__name__, e)
            return None


def _flatten(content: Any) -> Any:
    """OpenAI content parts as one string (vLLM's "string" content format joins text parts with newlines)."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content
