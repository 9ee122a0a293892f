"""POST /v1/chat/completions.

Both legs are chat requests (tools, reasoning, response_format behave as on one vLLM): the decode
leg repeats the conversation, loads all of the prompt's KV but its last token, and regenerates
the first token. Only when that token is sure to be the prefiller's (greedy, or a seed the client
sent) does the client get the prefiller's token at once and the proxy drop the decoder's repeat;
otherwise (and always with --first-token decoder) the client gets the decoder's whole answer.
"""

from __future__ import annotations

import time
from typing import TypeVar

from kvferry.proxy.flows import migrate
from kvferry.proxy.flows.chat_stream import ChatStream, chat_as_stream
from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.failover import DecodeLeg, serve_whole
from kvferry.proxy.flows.prefill import NoPrefiller, prefill
from kvferry.proxy.http.exchange import Request, json_response
from kvferry.proxy.http.sse import Answer
from kvferry.proxy.openai import body as bodies
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.openai.legs import chat_decode_leg, chat_prefill_leg, fan_out, same_first_token, sample
from kvferry.proxy.openai.merge import merge_samples
from kvferry.proxy.routing.cache import Route

PATH = "/v1/chat/completions"
T = TypeVar("T")
FINISHED = ("stop", "tool_calls")  # a first token with one of these ends the answer: no decode leg


class Chat:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def handle(self, request: Request) -> Answer:
        t0 = time.perf_counter()
        ctx = self.ctx
        body = await ctx.bodies.read(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ProxyError(400, "'messages' must be a non-empty list", "bad_messages", param="messages")
        max_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = bodies.max_tokens(body, max_key)
        n = body.get("n") or 1
        if n > 1:  # stream=true was refused by the body reader
            outs = await fan_out(self.one(request, sample(body, n, i), max_key, max_tokens) for i in range(n))
            ctx.metrics.total.observe(time.perf_counter() - t0)
            return json_response(merge_samples(outs, n))
        if not body.get("stream"):
            out = await self.one(request, body, max_key, max_tokens)
            ctx.metrics.total.observe(time.perf_counter() - t0)
            return json_response(out)
        route, ntok = await self._route(request, body, max_tokens == 1)
        d = route.decoder
        ids = ctx.opts.legs_carry_ids  # else the decoder computes every token: no ids, no moves mid-stream
        pre = None
        if not (max_tokens == 1 or route.local):
            pre = await self._prefill(request, body, max_key, route, ntok)
            if pre is None:
                route = ctx.router.served_alone(route)
        if max_tokens == 1 or route.local:  # one instance serves it all: no KV sent anywhere
            return await self._stream_alone(request, body, route, ntok, max_tokens, t0)
        assert pre is not None  # a route with a prefiller, whose leg answered
        first, tid = pre
        choice = first["choices"][0]
        if choice.get("finish_reason") in FINISHED:
            ctx.transfers.abort(d, tid, "the first token ended the request")
            return await chat_as_stream(ctx, request, first, body, t0)
        msg = choice["message"]
        # The decoder regenerates the first token: stream the prefiller's at once only when the
        # decoder is sure to pick the same one; else stream the decoder's own.
        fast = msg.get("content") if (ids and same_first_token(body) and msg.get("content")
                                      and not msg.get("tool_calls") and not msg.get("reasoning_content")) else None
        leg = chat_decode_leg(body, tid)
        move = None
        if ids and migrate.chat_movable(body) and (fast is None or choice.get("token_ids")):
            # Both legs give token ids, so a failed stream can continue elsewhere.
            move = migrate.ChatMove(ctx, body, tid, choice.get("token_ids") if fast is not None else None)
            leg["return_token_ids"] = True
        dl = DecodeLeg(ctx, d, leg, tid, move.mig if move is not None else None)

        def next_leg(e: ProxyError) -> dict | None:
            # The stream raises only while nothing reached the client: with no first token sent,
            # the conversation runs again, whole, on another decoder (no transfer: it computes the
            # prompt itself; a move's state is still empty).
            if fast is not None:
                return None
            if move is not None:
                move.tid = ""
            return {k: v for k, v in dl.leg.items() if k != "kv_transfer_params"}
        return await dl.run(lambda up, leg: ChatStream(ctx, request, PATH, t0, fast, first, move).run(up, leg),
                            next_leg)

    async def _stream_alone(self, request: Request, body: dict, route: Route, ntok: int,
                            max_tokens: int | None, t0: float) -> Answer:
        """A streamed request one instance serves whole (one token, or a local route)."""
        ctx = self.ctx
        p = route.prefiller if max_tokens == 1 and route.prefiller else route.decoder
        leg, move = body, None
        if ctx.opts.legs_carry_ids and route.local and max_tokens != 1 and migrate.chat_movable(body):
            # A decoder that fails mid-stream hands the rest to another (prompt ids from its stream).
            leg, move = dict(body, return_token_ids=True), migrate.ChatMove(ctx, body, "", None)
        return await serve_whole(ctx, route, p, ntok, lambda up: ChatStream(ctx, request, PATH, t0, move=move).run(
            up, leg), move.mig if move is not None else None)

    async def _route(self, request: Request, body: dict, single: bool) -> tuple[Route, int]:
        tokens = await self.ctx.tokens.chat_async(body)
        ntok = len(tokens) if tokens is not None else bodies.chat_tokens(body["messages"])
        return self.ctx.router.route(request, tokens, ntok, single, body), ntok

    async def _prefill(self, request: Request, body: dict, max_key: str, route: Route, ntok: int
                       ) -> tuple[dict, str] | None:
        """The prefill leg's answer and transfer id; None when no prefiller could take it (the
        decoder then serves the request alone)."""
        leg = chat_prefill_leg(body, max_key)
        if self.ctx.opts.legs_carry_ids:
            leg["return_token_ids"] = True  # the first token's id, for a stream that moves (proxy/flows/migrate.py)
        try:
            first, tid, _ = await prefill(self.ctx, PATH, leg, route, ntok, "chat")
        except NoPrefiller:
            return None
        return first, tid

    async def one(self, request: Request, body: dict, max_key: str, max_tokens: int | None) -> dict:
        """One non-streamed chat answer: the prefiller's, when its first token ends it; else the
        decoder's, which repeats the conversation with the prompt's KV and regenerates that token."""
        ctx = self.ctx
        route, ntok = await self._route(request, body, max_tokens == 1)
        d = route.decoder
        pre = None
        if not (max_tokens == 1 or route.local):
            pre = await self._prefill(request, body, max_key, route, ntok)
            if pre is None:
                route = ctx.router.served_alone(route)
        if max_tokens == 1 or route.local:
            p = route.prefiller if max_tokens == 1 and route.prefiller else d
            return await serve_whole(ctx, route, p, ntok, lambda up: up.json(PATH, body, "chat"))
        assert pre is not None  # a route with a prefiller, whose leg answered
        first, tid = pre
        if first["choices"][0].get("finish_reason") in FINISHED:
            ctx.transfers.abort(d, tid, "the first token ended the request")
            first.pop("kv_transfer_params", None)
            if not body.get("return_token_ids"):  # the proxy asked for them; vLLM's nulls for the client
                first["prompt_token_ids"] = None
                for c in first.get("choices") or []:
                    c["token_ids"] = None
            return first
        # Nothing reached the client when a decoder fails: the conversation runs again, whole, on
        # another decoder.
        dl = DecodeLeg(ctx, d, chat_decode_leg(body, tid), tid)
        out = await dl.run(lambda up, leg: up.json(PATH, leg, "chat"), lambda e: dict(body))
        out.pop("kv_transfer_params", None)
        return out
