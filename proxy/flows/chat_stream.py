"""A streamed chat answer: the flow of one chat stream to the client.

The decoder's chunks go through openai/stream_relay.py (`StreamRelay` with the chat dialect, and
`ChatChunks` for a chunk rewritten on its own): under the client's id, time and model, a read of
usual chunks at once. With the prefiller's first token (`first_text`), that token goes out first,
as plain vLLM streams it, and the decoder's repeat of it is dropped. A stream that breaks after it
began continues as a completion of prompt + tokens sent on another decoder (flows/migrate.py's
ChatMove, on flows/failover.py's DecodeLeg), its chunks written as chat chunks. A chat answer the
prefiller already finished is written as the stream the client asked for (`chat_as_stream`).
"""

from __future__ import annotations

import time
from typing import Any

from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.failover import DecodeLeg
from kvferry.proxy.flows.migrate import ChatMove
from kvferry.proxy.flows.upstream import Upstream
from kvferry.proxy.http.exchange import error_body
from kvferry.proxy.http.sse import SSEResponse, sse
from kvferry.proxy.openai import answers
from kvferry.proxy.openai.errors import ProxyError
from kvferry.proxy.openai.stream_relay import (
    CHAT,
    ChatChunks,
    StreamRelay,
    chat_chunk,
    first_chat_chunks,
    whole_chat_chunks,
)


class ChatStream:
    """One chat leg's stream to the client (one decoder; a move goes on in `_continue`)."""

    def __init__(self, ctx: Context, request: Any, path: str, t0: float, first_text: str | None = None,
                 first: dict | None = None, move: ChatMove | None = None) -> None:
        self.ctx, self.request, self.path, self.t0, self.move = ctx, request, path, t0, move
        self.resp = SSEResponse()
        # Without a move nothing is tracked: every chunk is usual, ids and all, as the engine wrote it.
        self.relay = StreamRelay(self.resp, CHAT, ctx.metrics.itl, move.want_ids if move is not None else True,
                                 list(move.first) if move is not None else None,
                                 None if move is not None else ())
        ours = (first.get("id"), first.get("created"), first.get("model")) \
            if first_text is not None and first is not None else None
        # The prompt's ids for a move: the prefiller's, else those the decoder's stream carries.
        prompt = first.get("prompt_token_ids") if move is not None and first is not None else None
        self.chunks = ChatChunks(self.relay, ours, first_text if ours is not None else None, move is not None, prompt)
        self.started = False
        self.first, self.first_text = first, first_text
        self.last_batch = b""  # the decoder's last chunks, written with [DONE] (one write fewer)

    async def run(self, up: Upstream, leg: dict) -> SSEResponse:
        """Relay `leg`'s stream; ProxyError only while nothing reached the client."""
        # A frozen decoder fails the leg after --stall-timeout, as a completion stream's does.
        events = up.events(self.path, leg, self.relay.direct)
        await self._first_token(leg)
        relay = self.relay
        try:
            async for batch in events:
                out = self.chunks.batch(batch, up.chunk)
                relay.tick()
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
            if m is not None and m.can_move(e, relay, self.chunks.prompt):
                await self._continue(up.inst, m, e)
            else:
                await self.resp.write(sse(error_body(e.status, e.message, e.kind)))
        finally:
            relay.flush_gaps()
        if not self.started:
            await self.resp.prepare(self.request)
        await self.resp.write_eof(self.last_batch + b"data: [DONE]\n\n")
        self.ctx.metrics.total.observe(time.perf_counter() - self.t0)
        return self.resp

    async def _first_token(self, leg: dict) -> None:
        first = self.first
        if self.chunks.repeat and first is not None and self.first_text is not None:
            await self.resp.prepare(self.request)
            self.started = True
            # The client's own request says which fields it asked for (the leg asks for token ids).
            await self.resp.write(first_chat_chunks(first, self.first_text,
                                                    self.move.body if self.move is not None else leg))
            self.ctx.metrics.ttft.observe(time.perf_counter() - self.t0)

    async def _start(self) -> None:
        if not self.started:
            await self.resp.prepare(self.request)
            self.started = True
            self.ctx.metrics.ttft.observe(time.perf_counter() - self.t0)

    async def _continue(self, d: Any, move: ChatMove, e: ProxyError) -> None:
        """The stream goes on as a completion of prompt + tokens sent on another decoder, its chunks
        written as chat chunks; then the usage."""
        relay, chunks = self.relay, self.chunks
        assert chunks.ours is not None and relay.sent is not None  # a chunk went out, with its ids (can_move)
        rid, created, model = chunks.ours
        head = {"id": rid, "object": CHAT.object, "created": created, "model": model}
        dl = DecodeLeg(self.ctx, d, {}, move.tid, move.mig)  # a local route (one instance did it all): no transfer
        if not dl.move(e, move.leg(relay.sent, chunks.prompt)):
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
                        cc = chat_chunk(ch["choices"][0], head, move.body)
                        chunks.track(cc)
                        out.append(sse(cc))
                if out:
                    await self.resp.write(b"".join(out))
                    relay.tick()

        def next_leg(e2: ProxyError) -> dict | None:
            if relay.sent is None or not move.can_move(e2, relay, chunks.prompt):
                return None
            return move.leg(relay.sent, chunks.prompt)
        try:
            await dl.run(as_chat, next_leg)
        except ProxyError as e2:
            await self.resp.write(sse(error_body(e2.status, e2.message, e2.kind)))
            return
        if (move.body.get("stream_options") or {}).get("include_usage"):
            n, p = len(relay.sent or ()), answers.count_ids(chunks.prompt)
            await self.resp.write(sse(dict(head, choices=[], usage={"prompt_tokens": p, "total_tokens": p + n,
                                                                    "completion_tokens": n})))


async def chat_as_stream(ctx: Context, request: Any, out: dict, body: dict, t0: float) -> SSEResponse:
    """A chat answer the prefiller already finished, written as the stream the client asked for."""
    resp = SSEResponse()
    await resp.prepare(request)
    await resp.write(whole_chat_chunks(out, body))
    ctx.metrics.ttft.observe(time.perf_counter() - t0)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
