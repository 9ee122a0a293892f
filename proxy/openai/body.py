"""The client's request body: checked field by field as vLLM checks it, and stripped of
`kv_transfer_params` (only the proxy chooses where KV goes). Every JSON route reads its body here
(completions, chat, the admin API), so each answers a body that is not JSON, or nests deeper than
json_codec.MAX_DEPTH, with the same 400 (code `bad_json`), never a 500."""

from __future__ import annotations

from typing import Any

from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.proxy.http import json_codec
from kvferry.proxy.http.exchange import Request
from kvferry.proxy.openai import answers
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.options import ProxyOptions

logger = get_logger(__name__)

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy decoding


class BodyReader:
    def __init__(self, opts: ProxyOptions) -> None:
        self.opts = opts
        self._client_kvp = RateLimitedLog(logger, 60.0)

    async def read(self, request: Request) -> dict:
        """The body (read within --max-body-bytes by the server) as a JSON object, or a 400 naming
        the field (or the nesting past json_codec.MAX_DEPTH)."""
        try:
            body = json_codec.loads_request(request.body)
        except json_codec.TooDeep as e:
            raise ProxyError(400, f"request body is {e}, which the proxy refuses: nest it less deeply",
                             "bad_json") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ProxyError(400, f"request body is not valid JSON: {e}", "bad_json") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object", "bad_json")
        # Only the proxy writes kv_transfer_params: a client's would point a
        # prefiller's sender at any host. vLLM also reads them from vllm_xargs.
        xargs = body.get("vllm_xargs")
        if "kv_transfer_params" in body or (isinstance(xargs, dict) and "kv_transfer_params" in xargs):
            body.pop("kv_transfer_params", None)
            if isinstance(xargs, dict):
                body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
            self._client_kvp.warning("ignoring a client's kv_transfer_params: only the proxy chooses where KV goes")
        self._check_n(body)
        if body.get("stream_options") is not None and not body.get("stream"):  # as vLLM refuses it
            raise ProxyError(400, "Stream options can only be defined when `stream=True`.", "bad_field",
                             param="stream_options")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise ProxyError(400, "'stream' must be true or false", "bad_field")
        return body

    def _check_n(self, body: dict) -> None:
        n = body.get("n")
        if n is None:
            return
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ProxyError(400, f"'n' must be a positive integer, got {n!r}", "bad_field", param="n")
        if n > self.opts.max_n:
            raise ProxyError(400, f"n={n} is more than this proxy's --max-n {self.opts.max_n}", "too_many_samples",
                             param="n")
        t = body.get("temperature")
        if n > 1 and isinstance(t, (int, float)) and t < GREEDY_EPS:  # vLLM's own refusal
            raise ProxyError(400, f"n must be 1 when using greedy sampling, got {n}.", "bad_field", param="n")
        if n > 1 and body.get("stream"):
            raise ProxyError(400, f"n={n} with stream=true is not supported through the disaggregation proxy: "
                                  "send n requests, or stream=false", "unsupported_n", param="n")


def max_tokens(body: dict, key: str) -> int | None:
    """The body's `key` (max_tokens or max_completion_tokens): None when absent, else a positive int."""
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ProxyError(400, f"'{key}' must be a positive integer, got {v!r}", "bad_field")
    return v


def prompts(prompt: Any) -> list | None:
    """The prompts of a completion request (one for a string or a list of token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if answers.is_ids(prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(answers.is_ids(p) for p in prompt):
            return list(prompt)
    return None


def chat_tokens(msgs: list) -> int:
    """A rough prompt size for the prefillers' load measure."""
    return sum(len(str(x.get("content", ""))) for x in msgs if isinstance(x, dict)) // 4 + 1
