"""Server-sent events to the client: a completion's first token then the decoder's stream under
the proxy's id, offsets and usage; a chat leg relayed (the prefiller's first token at once when
the decoder is sure to repeat it); a finished chat answer written as a stream."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from kvferry.common.log import get_logger
from kvferry.proxy.flows import migrate
from kvferry.proxy.flows.context import Context
from kvferry.proxy.flows.upstream import Upstream
from kvferry.proxy.http.sse import SSEResponse, sse
from kvferry.proxy.openai import answers, json_codec, rewrite
from kvferry.proxy.openai.errors import ProxyError, error_body
from kvferry.proxy.openai.legs import Prefilled, completion_decode_leg, prompt_ids
from kvferry.proxy.openai.merge import offset_after, shift_offsets
from kvferry.proxy.openai.rewrite import ChatRelay, DecodeRelay
from kvferry.proxy.routing.registry import Instance

logger = get_logger(__name__)

async def completion(ctx: Context, request: web.Request, body: dict, pre: Prefilled, echo: str, max_tokens: int,
                     t0: float) -> SSEResponse:
    """A completion stream after its prefill leg: the first token, then the decoder's chunks; a
    decode leg that fails mid-stream continues on another decoder (proxy/flows/migrate.py)."""
    metrics = ctx.metrics
    first, tid, d, mode = pre.first, pre.tid, pre.decoder, pre.mode
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    want_ids = bool(body.get("return_token_ids"))
    choice = first["choices"][0]
    rid = first.get("id") or f"cmpl-{uuid.uuid4().hex}"
    created, model = first.get("created") or int(time.time()), first.get("model")
    usage = answers.usage(first)
    prompt_tokens = usage.get("prompt_tokens") or answers.count_ids(prompt_ids(first))
    completion_tokens = usage.get("completion_tokens", 1) if mode != "regen" else 0
    done = mode == "done"
    # Plain vLLM's text offsets run on across chunks: the decoder's start at 0 again.
    lp = choice.get("logprobs") if mode == "ids" and body.get("logprobs") is not None else None
    shift = offset_after(lp)
    parse_lp = lp is not None  # every chunk's offsets are moved on, and the next one's start kept
    next_off = shift
    mig = migrate.Migration(ctx, ctx.opts.max_migrations)
    fingerprint = None  # vLLM's system_fingerprint, on the usage chunk as vLLM puts it
    up = ctx.router.upstream(d)
    finished = done
    resp = SSEResponse()
    # The tokens the client got are kept ("ids" mode only: the proxy knows the prompt's token ids).
    rl = DecodeRelay(resp, metrics.itl, want_ids, parse_lp, [] if mode == "ids" else None)
    first_leg = True
    ttft_due = mode == "regen"
    leg_open = False  # the decode leg's request went out: the decoder may hold it
    last_batch = b""  # the decoder's last chunks, written with the usage and [DONE] (one write fewer)
    try:
        # The first token goes out before the decode leg starts: sending both at once
        # measured slower here (an extra task and two writers on one loop).
        await resp.prepare(request)
        if mode != "regen":
            c0 = {"index": 0, "text": echo + (choice.get("text") or ""), "logprobs": choice.get("logprobs"),
                  "finish_reason": choice.get("finish_reason") if done else None,
                  "stop_reason": choice.get("stop_reason") if done else None}
            # vLLM writes both keys on every chunk, null unless return_token_ids asked for them.
            c0["prompt_token_ids"] = prompt_ids(first) if want_ids else None
            c0["token_ids"] = choice.get("token_ids") if want_ids else None
            await resp.write(sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                  "choices": [c0]}))
            metrics.ttft.observe(time.perf_counter() - t0)
        if not done:
            leg = completion_decode_leg(body, first if mode == "ids" else None, tid, max_tokens, True)
            if mode == "regen":
                leg["stream_options"] = {"include_usage": True}
            else:
                leg["return_token_ids"] = True  # the proxy counts and keeps what the client got
            leg_open = True
            while True:
                t1 = rl.last = time.perf_counter()
                rl.swap = None
                rl.ended = False
                try:
                    with up:
                        # A read of usual chunks that comes while this task waits is written by
                        # rl.direct in the decoder connection's callback: one task switch less per token.
                        async for batch in up.events("/v1/completions", leg, rl.direct):
                            if rl.swap is None:
                                chunk = up.chunk(batch[0])
                                swap = rl.learn((chunk.get("id"), chunk.get("created")), (rid, created))
                                metrics.decoder_first.observe(time.perf_counter() - t1)
                                if ttft_due:  # the decoder's first chunk is the client's first token
                                    metrics.ttft.observe(time.perf_counter() - t0)
                                    ttft_due = False
                            # The decode leg's usage chunk comes last: the chunks before it may still be usual.
                            usage_tail = batch[-1:] if b'"usage"' in batch[-1] else []
                            usual = rl.usual(batch[:-1] if usage_tail else batch)
                            out = []
                            if usual is not None:  # the usual chunks, rewritten whole
                                out.append(usual)
                                batch = usage_tail
                            for data in batch:
                                if b'"usage"' in data:
                                    u = up.chunk(data)
                                    if not u.get("choices") and u.get("usage"):  # the decode leg's own usage
                                        fingerprint = u.get("system_fingerprint") or fingerprint
                                        if rl.sent is None:
                                            completion_tokens += u["usage"].get("completion_tokens") or 0
                                        if mode == "regen":
                                            prompt_tokens = u["usage"].get("prompt_tokens") or prompt_tokens
                                        continue
                                m = rewrite.TOKEN_IDS.search(data)  # one search: the ids kept and stripped
                                if rl.sent is not None:
                                    ids = rewrite.token_ids_in(data, m)
                                    if ids is None:
                                        rl.sent = None  # an engine that ignores return_token_ids: no moving
                                        completion_tokens = 1
                                    else:
                                        rl.sent += ids
                                if b'"finish_reason":null' not in data and b'"finish_reason"' in data:
                                    rl.ended = True
                                if (swap[0] in data and swap[2] in data and not parse_lp
                                        and b'"prompt_token_ids":[' not in data):
                                    # vLLM writes compact JSON: swap the decoder's id and time for ours in
                                    # place (the ids first: `m` points into the chunk as it came).
                                    if not want_ids:
                                        data = rewrite.strip_token_ids(data, m)
                                    data = data.replace(swap[0], swap[1], 1).replace(swap[2], swap[3], 1)
                                else:
                                    chunk = up.chunk(data)
                                    chunk["id"], chunk["created"] = rid, created
                                    for c in chunk.get("choices", []):
                                        if "prompt_token_ids" in c:  # the decode leg's, not the client's
                                            c["prompt_token_ids"] = None
                                        if not want_ids and "token_ids" in c:
                                            c["token_ids"] = None
                                        if parse_lp:
                                            shift_offsets(c, shift)
                                            next_off = offset_after(c.get("logprobs")) or next_off
                                    data = json_codec.dumps(chunk)
                                out.append(b"data: " + data + b"\n\n")
                            if out:
                                if up.done:  # [DONE] came with it: one write with the stream's end
                                    last_batch = b"".join(out)
                                else:
                                    await resp.write(b"".join(out))
                            rl.tick()
                    finished = True
                    d.served_one()
                    break
                except ProxyError as e:
                    if rl.ended:  # the client has the whole answer: only the stream's end was lost
                        finished = True
                        break
                    sent = rl.sent
                    # A decoder that computes the whole answer moves only before its first chunk.
                    regen_moves = mode == "regen" and rl.swap is None
                    if (sent is None and not regen_moves) or not mig.can_move(e):
                        raise
                    if first_leg:
                        ctx.transfers.abort(d, tid, f"decode leg failed: {e.kind}")
                        first_leg = False
                    if sent is None:
                        nd = mig.next_decoder(d, e)
                        if nd is None:
                            raise
                        d, up = nd, ctx.router.upstream(nd)
                        leg = migrate.continuation_leg(leg, None, [], max_tokens, None)
                        continue
                    left = max_tokens - 1 - len(sent)
                    nd = mig.next_decoder(d, e) if left > 0 else None
                    ids = prompt_ids(first)  # there: `sent` is kept only for a prefill answer with token ids
                    if nd is None or ids is None:
                        raise
                    d, up = nd, ctx.router.upstream(nd)
                    shift = next_off
                    leg = migrate.continuation_leg(leg, answers.join_ids(ids, choice["token_ids"]), sent, left,
                                                   body.get("min_tokens") and body["min_tokens"] - 1)
    except ProxyError as e:
        # Headers are out: tell the client in the stream, OpenAI-style, then end it.
        await resp.write(last_batch + sse(error_body(e.status, e.message, e.kind)))
        last_batch = b""
    except (asyncio.CancelledError, ConnectionResetError):
        if not finished and first_leg and leg_open:  # the client left: the decoder drops the request
            migrate.client_left(ctx, d, tid)
            first_leg = False
        raise
    finally:
        metrics.itl.observe_all(rl.gaps)
        if not finished and first_leg:
            ctx.transfers.abort(d, tid, "decode leg did not finish")
    if rl.sent is not None:
        completion_tokens = 1 + len(rl.sent)  # what the client received, whatever happened upstream
    tail = b""
    if include_usage:
        u = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [], "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                                      "completion_tokens": completion_tokens}}
        if fingerprint:
            u["system_fingerprint"] = fingerprint
        tail = sse(u)
    await resp.write_eof(last_batch + tail + b"data: [DONE]\n\n")
    metrics.total.observe(time.perf_counter() - t0)
    return resp


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


async def relay_chat(ctx: Context, request: web.Request, up: Upstream, path: str, body: dict, t0: float,
                     first_text: str | None = None, first: dict | None = None,
                     move: migrate.ChatMove | None = None) -> SSEResponse:
    """Stream a chat leg to the client; with `first_text`, send the prefiller's first token at
    once (role chunk, then the token with its logprobs and id, as plain vLLM streams them) and
    drop the decoder's repeat of it."""
    metrics = ctx.metrics
    resp = SSEResponse()
    cr = ChatRelay(resp, move)
    # A frozen decoder fails the leg after --stall-timeout, as a completion stream's does.
    events = up.events(path, body, cr.direct)
    started = False
    rid = created = model = None
    skip = first_text or ""
    repeat = False  # the decoder's repeat of the first token is still to come
    last_batch = b""  # the decoder's last chunks, written with [DONE] (one write fewer)
    if first_text is not None and first is not None:
        rid, created, model = first.get("id"), first.get("created"), first.get("model")
        await resp.prepare(request)
        started = repeat = True
        # The client's own request says which fields it asked for (the leg asks for token ids).
        await resp.write(first_chat_chunks(first, first_text, move.body if move is not None else body))
        metrics.ttft.observe(time.perf_counter() - t0)
    # Without the prefiller's first token nor a move, nothing is rewritten (id, created and model
    # come from the stream itself): each chunk goes out as the engine wrote it.
    if rid is None and not skip and move is None:
        cr.swap = ()
    try:
        async for batch in events:
            # A move's usage chunk comes last: the chunks before it may still be usual.
            tail = batch[-1:] if move is not None and b'"usage"' in batch[-1] else []
            usual = cr.usual(batch[:-1] if tail else batch)
            out = []
            if usual is not None:
                out.append(usual)
                batch = tail
            for data in batch:
                chunk = up.chunk(data)
                dec = chunk.get("id"), chunk.get("created"), chunk.get("model")
                if rid is None:
                    rid, created, model = dec
                chunk["id"], chunk["created"], chunk["model"] = rid, created, model
                if repeat and chunk.get("choices"):
                    c = chunk["choices"][0]
                    delta = c.get("delta") or {}
                    if delta.pop("role", None) is not None:
                        chunk.pop("prompt_token_ids", None)  # the client had them with our role chunk
                        chunk.pop("prompt_text", None)
                    text = delta.get("content")
                    if text:
                        n = min(len(skip), len(text))
                        if text[:n] != skip[:n]:
                            logger.warning("decoder's first token differs from the prefiller's; streaming on")
                            skip, repeat = "", False
                        else:
                            delta["content"], skip = text[n:], skip[n:]
                            if not skip:
                                drop_first_token(c)
                                repeat = False
                    if not delta.get("content") and not c.get("finish_reason") and \
                            not any(k for k in delta if k != "content") and not c.get("token_ids") and \
                            not (c.get("logprobs") or {}).get("content"):
                        continue
                if move is not None:
                    move.track(chunk)
                if not repeat and cr.swap is None:
                    cr.learn(dec, (rid, created, model))  # the next chunks: a batch at a time
                out.append(sse(chunk))
            if not out:
                continue
            if not started:
                await resp.prepare(request)
                started = True
                metrics.ttft.observe(time.perf_counter() - t0)
            if up.done:  # [DONE] came with it: one write with the stream's end
                last_batch = b"".join(out)
            else:
                await resp.write(b"".join(out))
    except ProxyError as e:
        if not started:
            raise
        if move is not None and move.can_move(e):
            await _continue_chat(ctx, resp, up.inst, move, e, {"id": rid, "object": "chat.completion.chunk",
                                                                "created": created, "model": model})
        else:
            await resp.write(sse(error_body(e.status, e.message, e.kind)))
    if not started:
        await resp.prepare(request)
    await resp.write_eof(last_batch + b"data: [DONE]\n\n")
    metrics.total.observe(time.perf_counter() - t0)
    return resp


async def _continue_chat(ctx: Context, resp: SSEResponse, d: Instance, move: migrate.ChatMove,
                         e: ProxyError, head: dict) -> None:
    """A chat stream whose decoder failed goes on as a completion of prompt + tokens sent on
    another decoder, its chunks written as chat chunks (proxy/flows/migrate.py); then the usage."""
    if move.tid:  # a local route (one instance did it all) has no transfer
        ctx.transfers.abort(d, move.tid, f"decode leg failed: {e.kind}")
    while True:
        leg = move.leg()
        nd = move.mig.next_decoder(d, e) if leg is not None else None
        if nd is None or leg is None:
            await resp.write(sse(error_body(e.status, e.message, e.kind)))
            return
        move.moved = True
        up = ctx.router.upstream(nd)
        try:
            with up:
                async for batch in up.events("/v1/completions", leg):
                    out = []
                    for data in batch:
                        ch = up.chunk(data)
                        if ch.get("choices"):
                            cc = move.chat_chunk(ch["choices"][0], head)
                            move.track(cc)
                            out.append(sse(cc))
                    if out:
                        await resp.write(b"".join(out))
            nd.served_one()
            break
        except ProxyError as e2:
            if not move.can_move(e2):
                await resp.write(sse(error_body(e2.status, e2.message, e2.kind)))
                return
            d, e = nd, e2
    if (move.body.get("stream_options") or {}).get("include_usage"):
        n, p = len(move.sent), answers.count_ids(move.prompt)
        await resp.write(sse(dict(head, choices=[], usage={"prompt_tokens": p, "total_tokens": p + n,
                                                             "completion_tokens": n})))


async def chat_as_stream(ctx: Context, request: web.Request, out: dict, body: dict, t0: float
                         ) -> SSEResponse:
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
