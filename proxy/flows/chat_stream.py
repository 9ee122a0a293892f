"""A streamed chat answer, relayed: everything about how a chat chunk reaches the client is here.

The decoder's stream goes out under the client's id, time and model: a batch of usual chunks is
rewritten as bytes all at once (`ChatRelay`, over openai/rewrite.py's plain_sse), any other chunk
parsed on its own. With the prefiller's first token (`first_text`), that token goes out at once,
as plain vLLM streams it (a role chunk, then the token with its logprobs and id), and the
decoder's repeat of it is dropped. A stream that breaks after it began continues as a completion
of prompt + tokens sent on another decoder (flows/migrate.py's ChatMove, on flows/failover.py's
DecodeLeg), its chunks written as chat chunks. A chat answer the prefiller already finished is
written as the stream the client asked for (`chat_as_stream`).
"""

from __future__ import annotations

import time
from typing import Any

from kvferry.common.log import get_logger
from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.failover import DecodeLeg
from kvferry.proxy.flows.migrate import ChatMove
from kvferry.proxy.flows.upstream import Upstream
from kvferry.proxy.http.exchange import error_body
from kvferry.proxy.http.sse import SSEResponse, sse
from kvferry.proxy.openai import answers
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.openai.rewrite import CHAT_UNUSUAL, Client, plain_batch, plain_sse, swap_pairs

logger = get_logger(__name__)


class ChatStream:
    """One chat leg's stream to the client (one decoder; a move goes on in `_continue`)."""

    def __init__(self, ctx: Context, request: Any, path: str, t0: float, first_text: str | None = None,
                 first: dict | None = None, move: ChatMove | None = None) -> None:
        self.ctx, self.request, self.path, self.t0, self.move = ctx, request, path, t0, move
        self.resp = SSEResponse()
        self.relay = ChatRelay(self.resp, move)
        self.started = False
        self.rid: Any = None
        self.created: Any = None
        self.model: Any = None
        self.first, self.first_text = first, first_text
        self.skip = first_text or ""
        self.repeat = False  # the decoder's repeat of the first token is still to come
        self.last_batch = b""  # the decoder's last chunks, written with [DONE] (one write fewer)

    async def run(self, up: Upstream, leg: dict) -> SSEResponse:
        """Relay `leg`'s stream; ProxyError only while nothing reached the client."""
        # A frozen decoder fails the leg after --stall-timeout, as a completion stream's does.
        events = up.events(self.path, leg, self.relay.direct)
        await self._first_token(leg)
        try:
            async for batch in events:
                out = self._batch(batch, up)
                if not out:
                    continue
                await self._start()
                if up.done:  # [DONE] came with it: one write with the stream's end
                    self.last_batch = out
                else:
                    await self.resp.write(out)
        except ProxyError as e:
            if not self.started:
                raise
            m = self.move
            if m is not None and m.can_move(e):
                await self._continue(up.inst, m, e)
            else:
                await self.resp.write(sse(error_body(e.status, e.message, e.kind)))
        if not self.started:
            await self.resp.prepare(self.request)
        await self.resp.write_eof(self.last_batch + b"data: [DONE]\n\n")
        self.ctx.metrics.total.observe(time.perf_counter() - self.t0)
        return self.resp

    async def _first_token(self, leg: dict) -> None:
        first = self.first
        if self.first_text is not None and first is not None:
            self.rid, self.created, self.model = first.get("id"), first.get("created"), first.get("model")
            await self.resp.prepare(self.request)
            self.started = self.repeat = True
            # The client's own request says which fields it asked for (the leg asks for token ids).
            await self.resp.write(first_chat_chunks(first, self.first_text,
                                                    self.move.body if self.move is not None else leg))
            self.ctx.metrics.ttft.observe(time.perf_counter() - self.t0)
        # Without the prefiller's first token nor a move, nothing is rewritten (id, created and
        # model come from the stream itself): each chunk goes out as the engine wrote it.
        if self.rid is None and not self.skip and self.move is None:
            self.relay.swap = ()

    async def _start(self) -> None:
        if not self.started:
            await self.resp.prepare(self.request)
            self.started = True
            self.ctx.metrics.ttft.observe(time.perf_counter() - self.t0)

    def _batch(self, batch: list[bytes], up: Upstream) -> bytes:
        """A batch of the leg's chunk payloads as the client's SSE bytes."""
        move = self.move
        # A move's usage chunk comes last: the chunks before it may still be usual.
        tail = batch[-1:] if move is not None and b'"usage"' in batch[-1] else []
        usual = self.relay.usual(batch[:-1] if tail else batch)
        out = []
        if usual is not None:
            out.append(usual)
            batch = tail
        for data in batch:
            chunk = up.chunk(data)
            dec = chunk.get("id"), chunk.get("created"), chunk.get("model")
            if self.rid is None:
                self.rid, self.created, self.model = dec
            chunk["id"], chunk["created"], chunk["model"] = self.rid, self.created, self.model
            if self.repeat and chunk.get("choices") and not self._drop_repeat(chunk):
                continue
            if move is not None:
                move.track(chunk)
            if not self.repeat and self.relay.swap is None:
                self.relay.learn(dec, (self.rid, self.created, self.model))  # the next chunks: a batch at a time
            out.append(sse(chunk))
        return b"".join(out)

    def _drop_repeat(self, chunk: dict) -> bool:
        """Take the decoder's repeat of the first token out of `chunk`; False when nothing of the
        chunk is left to send."""
        c = chunk["choices"][0]
        delta = c.get("delta") or {}
        if delta.pop("role", None) is not None:
            chunk.pop("prompt_token_ids", None)  # the client had them with our role chunk
            chunk.pop("prompt_text", None)
        text = delta.get("content")
        if text:
            n = min(len(self.skip), len(text))
            if text[:n] != self.skip[:n]:
                logger.warning("decoder's first token differs from the prefiller's; streaming on")
                self.skip, self.repeat = "", False
            else:
                delta["content"], self.skip = text[n:], self.skip[n:]
                if not self.skip:
                    drop_first_token(c)
                    self.repeat = False
        return bool(delta.get("content") or c.get("finish_reason") or any(k for k in delta if k != "content")
                    or c.get("token_ids") or (c.get("logprobs") or {}).get("content"))

    async def _continue(self, d: Any, move: ChatMove, e: ProxyError) -> None:
        """The stream goes on as a completion of prompt + tokens sent on another decoder, its chunks
        written as chat chunks; then the usage."""
        head = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        dl = DecodeLeg(self.ctx, d, {}, move.tid, move.mig)  # a local route (one instance did it all): no transfer
        if not dl.move(e, move.leg()):
            dl.drop_transfer(f"decode leg failed: {e.kind}")
            await self.resp.write(sse(error_body(e.status, e.message, e.kind)))
            return
        move.moved = True

        async def as_chat(up: Upstream, leg: dict) -> None:
            async for batch in up.events("/v1/completions", leg):
                out = []
                for data in batch:
                    ch = up.chunk(data)
                    if ch.get("choices"):
                        cc = move.chat_chunk(ch["choices"][0], head)
                        move.track(cc)
                        out.append(sse(cc))
                if out:
                    await self.resp.write(b"".join(out))
        try:
            await dl.run(as_chat, lambda e2: move.leg() if move.can_move(e2) else None)
        except ProxyError as e2:
            await self.resp.write(sse(error_body(e2.status, e2.message, e2.kind)))
            return
        if (move.body.get("stream_options") or {}).get("include_usage"):
            n, p = len(move.sent), answers.count_ids(move.prompt)
            await self.resp.write(sse(dict(head, choices=[], usage={"prompt_tokens": p, "total_tokens": p + n,
                                                                    "completion_tokens": n})))


def first_chat_chunks(first: dict, first_text: str, body: dict) -> bytes:
    """The prefiller's first token as plain vLLM streams it: a role chunk (with the prompt's
    token ids when `return_token_ids` asked for them), then the token's chunk with its logprobs
    and token id taken from the prefiller's non-streamed answer."""
    choice = first["choices"][0]
    head = {"id": first.get("id"), "object": "chat.completion.chunk", "created": first.get("created"),
            "model": first.get("model")}
    want_ids = bool(body.get("return_token_ids"))
    role = dict(head, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}],
                prompt_token_ids=first.get("prompt_token_ids") if want_ids else None, prompt_text=None)
    token = dict(head, choices=[{"index": 0, "delta": {"content": first_text},
                                 "logprobs": choice.get("logprobs") if body.get("logprobs") else None,
                                 "finish_reason": None,
                                 "token_ids": choice.get("token_ids") if want_ids else None}])
    return sse(role) + sse(token)


def drop_first_token(c: dict) -> None:
    """Take the first token out of a decoder chunk's choice: its logprob entry and token id (the
    client already has the prefiller's)."""
    if c.get("token_ids"):
        c["token_ids"] = c["token_ids"][1:]
    lp = c.get("logprobs")
    if isinstance(lp, dict) and lp.get("content"):
        lp["content"] = lp["content"][1:]


async def chat_as_stream(ctx: Context, request: Any, out: dict, body: dict, t0: float) -> SSEResponse:
    """A chat answer the prefiller already finished, written as the stream the client asked for."""
    resp = SSEResponse()
    await resp.prepare(request)
    choice = out["choices"][0]
    msg = choice.get("message") or {}
    head = {"id": out.get("id"), "object": "chat.completion.chunk", "created": out.get("created"),
            "model": out.get("model")}
    delta = {k: v for k, v in msg.items() if v not in (None, [], "") and k != "role"}
    await resp.write(sse(dict(head, choices=[{"index": 0, "delta": {"role": "assistant", **delta},
                                              "logprobs": choice.get("logprobs"),
                                              "finish_reason": choice.get("finish_reason")}])))
    ctx.metrics.ttft.observe(time.perf_counter() - t0)
    if (body.get("stream_options") or {}).get("include_usage") and out.get("usage"):
        await resp.write(sse(dict(head, choices=[], usage=out["usage"])))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


class ChatRelay:
    """A chat leg's stream once its chunks are the usual ones (the first token's repeat dropped,
    the decoder's id known): rewritten a batch at a time by plain_batch, in the leg's task
    (`usual`) or in the decoder connection's callback (`direct`)."""

    __slots__ = ("resp", "move", "swap")

    def __init__(self, resp: Client, move: ChatMove | None) -> None:
        self.resp, self.move = resp, move
        self.swap: tuple[bytes, ...] | None = None  # the decoder's id, time and model, and the client's

    def learn(self, dec: tuple[Any, Any, Any], ours: tuple[Any, Any, Any]) -> None:
        """From a decoder's chunk (its id, created, model) and what the client sees instead."""
        self.swap = swap_pairs((b'"id":', b'"created":', b'"model":'), dec, ours, False)

    def usual(self, batch: list[bytes]) -> bytes | None:
        fast = self._rewrite(batch, plain_batch) if batch else None
        if fast is None:
            return None
        self._note(fast)
        return fast[0]

    def direct(self, sse: bytes) -> bool:
        fast = self._rewrite(sse, plain_sse)
        if fast is None or not self.resp.write_now(fast[0]):
            return False
        self._note(fast)
        return True

    def _rewrite(self, got: Any, how: Any) -> tuple[bytes, list[int], bool] | None:
        """`how` (plain_sse or plain_batch) on `got`. Only a move needs the chunks' ids and plain
        content; without one every chunk goes out as written, its id, time and model swapped."""
        if self.swap is None:
            return None
        m = self.move
        if m is None:
            return how(got, self.swap, True, False, ())
        return how(got, self.swap, m.want_ids, m.ok, CHAT_UNUSUAL)

    def _note(self, fast: tuple[bytes, list[int], bool]) -> None:
        m = self.move
        if m is not None:
            if m.ok:
                m.got += fast[1]
            m.ended = m.ended or fast[2]
