"""A decode leg that fails after the client's stream started continues on another decoder.

The proxy keeps the token ids it sent to the client (the decode leg always asks vLLM for them).
When the leg's stream breaks (connection reset, engine gone, vLLM's error event, a 5xx) or sends
nothing for `--stall-timeout` seconds, another healthy decoder gets the prompt plus every token
already sent as its prompt and `max_tokens` less what was sent; it computes that prompt's KV
itself (no prefill leg: nothing is waiting on a prefiller, and the re-prefill is one decoder
forward pass). The client's stream goes on under the same id and `created`, with no duplicate and
no gap; usage counts the tokens the client received. At most `--max-migrations` moves a request.
"""

from __future__ import annotations

import time
from typing import Any

from kvferry.common.log import get_logger
from kvferry.common.reasons import CLIENT_LEFT
from kvferry.proxy.flows.context import Context
from kvferry.proxy.openai import answers
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.openai.stream_relay import StreamRelay
from kvferry.proxy.routing.instances import Instance

logger = get_logger(__name__)

# Failures after which a request moves: the instance's, never the request's (a 4xx, a bad answer).
MIGRATE_KINDS = frozenset({"stream_broken", "stream_error", "timeout", "stall", "unreachable", "upstream_5xx"})
class Migration:
    """One request's moves: which decoders failed it, how many moves are left."""

    def __init__(self, ctx: Context, limit: int) -> None:
        self.ctx = ctx
        self.limit = limit
        self.moves = 0
        self.failed: list[Instance] = []

    def can_move(self, e: ProxyError) -> bool:
        return e.kind in MIGRATE_KINDS and self.moves < self.limit

    def next_decoder(self, failed: Instance, e: ProxyError) -> Instance | None:
        """Another usable decoder (the router's `elsewhere`), or None; counts the move."""
        self.failed.append(failed)
        try:
            d = self.ctx.router.elsewhere("decoder", self.failed, "move the request to")
        except ProxyError:
            logger.warning("cannot migrate a request off %s %s (%s): no other healthy decoder", failed.id,
                           failed.url, e.kind)
            return None
        self.moves += 1
        self.ctx.metrics.migrations.labels(e.kind).inc()
        tracer = self.ctx.router.client.tracer
        if tracer is not None:
            tracer.record("migration", time.time_ns(), {
                "kvferry.migration.from": failed.id, "kvferry.migration.to": d.id, "kvferry.migration.move": self.moves,
                "error.type": e.kind, "kvferry.migration.cause": e.message[:300]})
        logger.warning("migrating a request from decoder %s (%s: %s) to %s %s (move %d of at most %d)", failed.id,
                       e.kind, e.message[:160], d.id, d.url, self.moves, self.limit)
        return d


def continuation_leg(leg: dict, prompt: Any, sent: list[int], max_tokens: int, min_tokens: int | None) -> dict:
    """A completion leg that goes on after `sent`: prompt + sent as its prompt, the rest of the
    token budget, no transfer (the new decoder computes that prompt's KV itself). `prompt` None:
    nothing was sent, the leg's own prompt is kept (a decoder that computes the whole answer)."""
    out = dict(leg, max_tokens=max_tokens)
    if prompt is not None:
        out["prompt"] = list(answers.ids_list(prompt)) + list(sent)
    out.pop("kv_transfer_params", None)
    if min_tokens:
        out["min_tokens"] = max(0, min_tokens - len(sent))
    return out


def client_left(ctx, decoder: Instance, tid: str) -> None:
    """The client left while its decode leg was open: the transfer is aborted at once (its pages
    come back now), with CLIENT_LEFT as the reason. Closing the leg's connection makes vLLM abort
    the request; should the decoder's scheduler see the request before that abort, its connector
    finds the transfer ended for CLIENT_LEFT and waits for vLLM's abort instead of recomputing the
    prompt for a client that is gone (engine/pd/consumer.py)."""
    if tid:
        ctx.transfers.abort(decoder, tid, CLIENT_LEFT)


# Chat sampling settings a completions continuation carries over (tools, response_format and
# reasoning are chat-only: such requests are not moved).
CHAT_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop", "stop_token_ids", "seed", "ignore_eos", "logit_bias",
                 "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                 "bad_words", "allowed_token_ids")


def chat_movable(body: dict) -> bool:
    """A chat request whose stream can continue as plain text on another decoder."""
    return not any(body.get(k) for k in ("tools", "functions", "response_format", "structured_outputs",
                                         "guided_json", "guided_regex", "guided_choice", "guided_grammar"))


class ChatMove:
    """A streamed chat request's state for a move: its body, the transfer the first decoder holds,
    the prefiller's first token ids (sent before the decoder's), and its moves. What the client
    received, and the prompt's ids, are the stream's (openai/stream_relay.py's relay and ChatChunks)."""

    def __init__(self, ctx, body: dict, tid: str, first_ids: list[int] | None) -> None:
        self.ctx, self.body, self.tid = ctx, body, tid
        self.mig = Migration(ctx, ctx.opts.max_migrations)
        self.want_ids = bool(body.get("return_token_ids"))
        self.first = list(first_ids or [])  # the prefiller's token, sent before the decoder's
        self.moved = False

    def can_move(self, e: ProxyError, relay: StreamRelay, prompt: Any) -> bool:
        """The stream can go on elsewhere: every token the client got is known, none ended it, and
        the prompt's ids are known."""
        return relay.sent is not None and not relay.ended and prompt is not None and self.mig.can_move(e)

    def leg(self, sent: list[int], prompt: Any) -> dict | None:
        """The completions request that continues the answer after `sent`, or None when nothing is
        left to make."""
        b = self.body
        leg = {k: b[k] for k in CHAT_SAMPLING if k in b}
        mx = b.get("max_completion_tokens") or b.get("max_tokens")
        if mx is not None and mx - len(sent) <= 0:
            return None
        leg.update(model=b.get("model"), prompt=list(answers.ids_list(prompt) or []) + sent, stream=True,
                   stream_options={"include_usage": True}, return_token_ids=True,
                   max_tokens=None if mx is None else mx - len(sent))
        if b.get("logprobs"):
            leg["logprobs"] = b.get("top_logprobs") or 0
        if b.get("min_tokens"):
            leg["min_tokens"] = max(0, b["min_tokens"] - len(sent))
        return leg
