"""A streamed completion after its prefill leg: the first token at once, then the decoder's
chunks under the proxy's id, offsets and usage (openai/stream_relay.py's StreamRelay and
CompletionChunks), on one
decoder after another when one fails (flows/failover.py's DecodeLeg).

A decode leg that fails mid-stream continues on another decoder from the tokens the client got
("ids" mode: the prefiller gave the prompt's token ids), or, where the decoder computes the whole
answer ("regen"), only before its first chunk. Once the answer's headers are out, an error is
told in the stream, OpenAI-style, and the stream ends.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvferry.proxy.flows import migrate
from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.failover import DecodeLeg
from kvferry.proxy.flows.upstream import Upstream
from kvferry.proxy.http.exchange import error_body
from kvferry.proxy.http.sse import SSEResponse, sse
from kvferry.proxy.openai import answers
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.openai.legs import completion_decode_leg, prompt_ids
from kvferry.proxy.openai.merge import offset_after
from kvferry.proxy.openai.stream_relay import COMPLETION, CompletionChunks, StreamRelay
from kvferry.proxy.routing.instances import Instance

PATH = "/v1/completions"



@dataclass
class Prefilled:
    """A completion's prefill leg, done. mode: "done" (`first` is the whole answer), "ids" (decode
    from its token ids) or "regen" (it has no usable token ids: the decoder gets the client's
    prompt and regenerates the first token)."""

    first: dict
    tid: str
    decoder: Instance
    prefiller: Instance
    mode: str


class CompletionStream:
    """One streamed completion: what the client was sent and is owed."""

    def __init__(self, ctx: Context, body: dict, pre: Prefilled, echo: str, max_tokens: int, t0: float) -> None:
        self.ctx, self.body, self.pre, self.echo, self.max_tokens, self.t0 = ctx, body, pre, echo, max_tokens, t0
        first, mode = pre.first, pre.mode
        self.choice = first["choices"][0]
        self.rid = first.get("id") or f"cmpl-{uuid.uuid4().hex}"
        self.created, self.model = first.get("created") or int(time.time()), first.get("model")
        usage = answers.usage(first)
        self.prompt_tokens = usage.get("prompt_tokens") or answers.count_ids(prompt_ids(first))
        self.completion_tokens = usage.get("completion_tokens", 1) if mode != "regen" else 0
        self.fingerprint = None  # vLLM's system_fingerprint, on the usage chunk as vLLM puts it
        self.ttft_due = mode == "regen"  # the decoder's first chunk is the client's first token
        self.resp = SSEResponse()
        lp = self.choice.get("logprobs") if mode == "ids" and body.get("logprobs") is not None else None
        # The tokens the client got are kept ("ids" mode only: the proxy knows the prompt's token ids).
        self.relay = StreamRelay(self.resp, COMPLETION, ctx.metrics.itl, bool(body.get("return_token_ids")),
                                 [] if mode == "ids" else None)
        self.chunks = CompletionChunks(self.relay, (self.rid, self.created), lp is not None, offset_after(lp),
                                       self._leg_usage, self._no_ids)
        self.leg_start = 0.0
        self.dl: DecodeLeg | None = None
        self.last_batch = b""  # the decoder's last chunks, written with the usage and [DONE] (one write fewer)

    async def run(self, request: Any) -> SSEResponse:
        pre = self.pre
        # "done": the first token ended the answer, and its transfer was aborted then.
        dl = self.dl = DecodeLeg(self.ctx, pre.decoder, {}, pre.tid if pre.mode != "done" else "")
        try:
            # The first token goes out before the decode leg starts: both at once would take an
            # extra task and two writers on one loop.
            await self.resp.prepare(request)
            if pre.mode != "regen":
                await self.resp.write(self._first_chunk())
                self.ctx.metrics.ttft.observe(time.perf_counter() - self.t0)
            if pre.mode != "done":
                dl.leg = self._decode_leg()
                await dl.run(self._relay, self._next_leg)
        except ProxyError as e:
            # Headers are out: tell the client in the stream, OpenAI-style, then end it.
            await self.resp.write(self.last_batch + sse(error_body(e.status, e.message, e.kind)))
            self.last_batch = b""
        finally:
            self.relay.flush_gaps()
            dl.drop_transfer("decode leg did not finish")  # nothing once the leg finished or moved
        await self.resp.write_eof(self.last_batch + self._usage() + b"data: [DONE]\n\n")
        self.ctx.metrics.total.observe(time.perf_counter() - self.t0)
        return self.resp

    def _first_chunk(self) -> bytes:
        """The prefiller's first token as vLLM's first chunk (the whole answer in "done" mode)."""
        choice, done = self.choice, self.pre.mode == "done"
        want_ids = bool(self.body.get("return_token_ids"))
        c0 = {"index": 0, "text": self.echo + (choice.get("text") or ""), "logprobs": choice.get("logprobs"),
              "finish_reason": choice.get("finish_reason") if done else None,
              "stop_reason": choice.get("stop_reason") if done else None,
              # vLLM writes both keys on every chunk, null unless return_token_ids asked for them.
              "prompt_token_ids": prompt_ids(self.pre.first) if want_ids else None,
              "token_ids": choice.get("token_ids") if want_ids else None}
        return sse({"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [c0]})

    def _decode_leg(self) -> dict:
        pre = self.pre
        leg = completion_decode_leg(self.body, pre.first if pre.mode == "ids" else None, pre.tid, self.max_tokens,
                                    True)
        if pre.mode == "regen":
            leg["stream_options"] = {"include_usage": True}
        else:
            leg["return_token_ids"] = True  # the proxy counts and keeps what the client got
        return leg

    async def _relay(self, up: Upstream, leg: dict) -> None:
        """One decode leg's stream to the client. A read of usual chunks that comes while this task
        waits is written by the rewriter in the decoder connection's callback (one task switch
        less per token)."""
        relay, chunks, metrics = self.relay, self.chunks, self.ctx.metrics
        self.leg_start = time.perf_counter()
        chunks.new_leg(self.leg_start)
        try:
            async for batch in up.events(PATH, leg, relay.direct):
                if relay.swap is None:
                    chunk = up.chunk(batch[0])
                    chunks.learn((chunk.get("id"), chunk.get("created")))
                    metrics.decoder_first.observe(time.perf_counter() - self.leg_start)
                    if self.ttft_due:
                        metrics.ttft.observe(time.perf_counter() - self.t0)
                        self.ttft_due = False
                out = chunks.batch(batch, up.chunk)
                if out:
                    if up.done:  # [DONE] came with it: one write with the stream's end
                        self.last_batch = out
                    else:
                        await self.resp.write(out)
                relay.tick()
        except ProxyError:
            if not relay.ended:
                raise
            # The client has the whole answer: only the stream's end was lost.

    def _next_leg(self, e: ProxyError) -> dict | None:
        """The leg for the next decoder: the rest of the answer after what the client got, or the
        whole request again while a decoder computing all of it sent nothing; None: no move."""
        assert self.dl is not None
        relay, leg, pre = self.relay, self.dl.leg, self.pre
        sent = relay.sent
        if sent is None:
            # A decoder that computes the whole answer moves only before its first chunk.
            if pre.mode == "regen" and relay.swap is None:
                return migrate.continuation_leg(leg, None, [], self.max_tokens, None)
            return None
        left = self.max_tokens - 1 - len(sent)
        ids = prompt_ids(pre.first)  # there: `sent` is kept only for a prefill answer with token ids
        if left <= 0 or ids is None:
            return None
        mt = self.body.get("min_tokens")
        return migrate.continuation_leg(leg, answers.join_ids(ids, self.choice["token_ids"]), sent, left,
                                        mt and mt - 1)

    def _leg_usage(self, u: dict) -> None:
        """The decode leg's own usage chunk: counted, not relayed."""
        self.fingerprint = u.get("system_fingerprint") or self.fingerprint
        if self.relay.sent is None:
            self.completion_tokens += u["usage"].get("completion_tokens") or 0
        if self.pre.mode == "regen":
            self.prompt_tokens = u["usage"].get("prompt_tokens") or self.prompt_tokens

    def _no_ids(self) -> None:
        self.completion_tokens = 1

    def _usage(self) -> bytes:
        """The usage chunk, when the client asked for it: what the client received, whatever
        happened upstream."""
        if not (self.body.get("stream_options") or {}).get("include_usage"):
            return b""
        n = 1 + len(self.relay.sent) if self.relay.sent is not None else self.completion_tokens
        u: dict = {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [], "usage": {"prompt_tokens": self.prompt_tokens,
                                            "total_tokens": self.prompt_tokens + n, "completion_tokens": n}}
        if self.fingerprint:
            u["system_fingerprint"] = self.fingerprint
        return sse(u)
