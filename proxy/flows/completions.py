"""POST /v1/completions: one prompt, a batch of prompts, or n samples; streamed or not.

The decode leg gets the prompt's token ids (returned by the prefiller, no /tokenize round trip)
plus the first token, and max_tokens - 1; with --first-token decoder, the client's own request.
"""

from __future__ import annotations

import time

from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.proxy.flows.completion_stream import CompletionStream, Prefilled
from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.failover import DecodeLeg, serve_whole, whole_again
from kvferry.proxy.flows.prefill import NoPrefiller, prefill
from kvferry.proxy.flows.upstream import Upstream
from kvferry.proxy.http.exchange import Request, json_response
from kvferry.proxy.http.sse import Answer
from kvferry.proxy.openai import answers
from kvferry.proxy.openai import body as bodies
from kvferry.proxy.openai.answers import BadAnswer
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.openai.legs import (
    completion_decode_leg,
    completion_prefill_leg,
    fan_out,
    penalizes_outputs,
    prompt_ids,
    sample,
)
from kvferry.proxy.openai.merge import merge_completion, merge_samples

logger = get_logger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # vLLM's default for /v1/completions


class Completions:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._no_ids = RateLimitedLog(logger, 60.0)

    async def handle(self, request: Request) -> Answer:
        t0 = time.perf_counter()
        ctx = self.ctx
        body = await ctx.bodies.read(request)
        batch = bodies.prompts(body.get("prompt"))
        if batch is None:
            raise ProxyError(400, "'prompt' must be a string, a list of token ids, or a list of either",
                             "bad_prompt", param="prompt")
        if len(batch) > ctx.opts.max_batch_prompts:
            raise ProxyError(400, f"{len(batch)} prompts in one request; this proxy takes at most "
                                  f"{ctx.opts.max_batch_prompts} (--max-batch-prompts): split the batch",
                             "too_many_prompts", param="prompt")
        max_tokens = bodies.max_tokens(body, "max_tokens")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        n = body.get("n") or 1
        if len(batch) > 1 or n > 1:
            if body.get("stream"):
                raise ProxyError(400, "a batch of prompts with stream=true is not supported: send one request "
                                      "per prompt, or stream=false", "unsupported_batch_stream", param="prompt")
            outs = await fan_out(self.one(request, sample(body, n, i, prompt=p), max_tokens, t0)
                                 for p in batch for i in range(n))
            return json_response(merge_samples(outs, n))
        body = dict(body, prompt=batch[0])
        if body.get("stream"):
            return await self.stream(request, body, max_tokens, t0)
        return json_response(await self.one(request, body, max_tokens, t0))

    def _leg_body(self, body: dict, max_tokens: int) -> dict:
        """The body the prefill leg is made from: with token ids to decode from, unless no decode
        leg follows or the decoder computes the answer itself (--first-token decoder)."""
        if max_tokens <= 1 or not self.ctx.opts.legs_carry_ids:
            return body
        return dict(body, return_token_ids=True)

    async def first(self, request: Request, body: dict, max_tokens: int) -> Prefilled:
        """The prefill leg (or, for max_tokens <= 1, the whole request on a prefiller; or, routed
        locally, nothing yet: the decoder serves it alone, as "regen" without a transfer)."""
        ctx = self.ctx
        prompt = body["prompt"]
        tokens = await ctx.tokens.completion_async(prompt)
        ntok = len(tokens) if tokens is not None else len(prompt) if isinstance(prompt, list) else len(prompt) // 4 + 1
        route = ctx.router.route(request, tokens, ntok, single=max_tokens <= 1, body=body)
        d = route.decoder
        if route.local and max_tokens > 1:
            return Prefilled({"choices": [{}], "model": body.get("model")}, "", d, d, "regen")
        if max_tokens <= 1:  # no decode leg: a plain request to one instance, no KV sent anywhere
            p = route.prefiller or d
            leg = dict(body, stream=False)
            if body.get("stream"):  # the client's stream is the proxy's to write
                leg.pop("stream_options", None)
            served = [p]

            async def one_token(up: Upstream) -> dict:
                served[0] = up.inst
                return await up.json("/v1/completions", leg, "completion")
            out = await serve_whole(ctx, route, p, ntok, one_token)
            return Prefilled(out, "", d, served[0], "done")
        ids = ctx.opts.legs_carry_ids
        try:
            first, tid, p = await prefill(ctx, "/v1/completions", completion_prefill_leg(body, ids),
                                          route, ntok, "completion")
        except NoPrefiller:
            ctx.router.served_alone(route)
            return Prefilled({"choices": [{}], "model": body.get("model")}, "", d, d, "regen")
        choice = first["choices"][0]
        if choice.get("finish_reason") == "stop":
            ctx.transfers.abort(d, tid, "the first token ended the request")
            return Prefilled(first, tid, d, p, "done")
        if not ids or penalizes_outputs(body):
            # --first-token decoder, or penalties that count output tokens only: the decoder
            # computes the answer from the client's prompt (with the first token in its prompt, it
            # would not count that token as an output)
            return Prefilled(first, tid, d, p, "regen")
        if answers.is_ids(choice.get("token_ids")) and answers.is_ids(prompt_ids(first)):
            return Prefilled(first, tid, d, p, "ids")
        if not p.removed:  # a removed instance's series are gone: logged only
            ctx.metrics.errors.labels("no_token_ids", p.id).inc()
        self._no_ids.warning("%s %s answered without token ids (choices[0].token_ids, prompt_token_ids: it "
                             "ignores return_token_ids); its decoders regenerate the first token", p.role, p.url)
        return Prefilled(first, tid, d, p, "regen")

    async def echo(self, body: dict, pre: Prefilled) -> str:
        """The prompt text vLLM puts before the completion for `echo` (none with return_token_ids,
        as vLLM does); the prefill leg cannot echo it, as it asks for token ids."""
        if not body.get("echo") or body.get("return_token_ids"):
            return ""
        prompt = body["prompt"]
        if isinstance(prompt, str) and body.get("truncate_prompt_tokens") is None:
            return prompt
        ids = prompt_ids(pre.first)
        if not answers.is_ids(ids):
            ids = prompt if answers.is_ids(prompt) else None
        p = pre.prefiller
        if ids is None:
            raise ProxyError(502, f"echo: {p.role} {p.url} returned no prompt_token_ids to echo", "bad_answer")
        with Upstream(self.ctx.router, p, leg="detokenize") as up:
            out = await up.json("/detokenize", {"model": body.get("model"), "tokens": ids})
        if not isinstance(out, dict) or not isinstance(out.get("prompt"), str):
            raise up.bad("/detokenize without a 'prompt' string")
        return out["prompt"]

    async def one(self, request: Request, body: dict, max_tokens: int, t0: float) -> dict:
        """One prompt, one sample, not streamed."""
        ctx = self.ctx
        pre = await self.first(request, self._leg_body(body, max_tokens), max_tokens)
        first, d = pre.first, pre.decoder
        echo = "" if max_tokens <= 1 or pre.mode == "regen" else await self.echo(body, pre)
        if pre.mode == "done":
            out = first
        else:
            leg = completion_decode_leg(body, first if pre.mode == "ids" else None, pre.tid, max_tokens, False)

            async def decode(up: Upstream, leg: dict) -> dict:
                t1 = time.perf_counter()
                rest = await up.json("/v1/completions", leg, "completion")
                ctx.metrics.decoder_first.observe(time.perf_counter() - t1)
                try:
                    return merge_completion(first, rest) if pre.mode == "ids" else rest
                except BadAnswer as e:
                    raise up.bad(str(e)) from None
            # Nothing reached the client yet when a decoder fails: the whole decode leg runs again
            # on another, which computes the prompt's KV itself.
            dl = DecodeLeg(ctx, d, leg, pre.tid)
            out = await dl.run(decode, whole_again(leg))
            echo = "" if pre.mode == "regen" else echo  # the decoder echoed it itself
        if echo:
            out["choices"][0]["text"] = echo + (out["choices"][0].get("text") or "")
        if not body.get("return_token_ids"):
            for c in out["choices"]:
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)
            out.pop("prompt_token_ids", None)
        out.pop("kv_transfer_params", None)
        ctx.metrics.total.observe(time.perf_counter() - t0)
        return out

    async def stream(self, request: Request, body: dict, max_tokens: int, t0: float) -> Answer:
        """One prompt, streamed: the prefiller's first token at once, then the decoder's stream."""
        pre = await self.first(request, self._leg_body(body, max_tokens), max_tokens)
        echo = await self.echo(body, pre) if pre.mode == "ids" else ""
        return await CompletionStream(self.ctx, body, pre, echo, max_tokens, t0).run(request)
