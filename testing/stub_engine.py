"""A fast, deterministic stand-in for a vLLM OpenAI server, for the proxy's unit tests and overhead
benchmark only (never as proof that disaggregation works).

    python -m kvferry.testing.stub_engine --port 8100 [--token-delay 0.001]

Tokens are a pure function of the sequence so far, so prefill-then-decode through the proxy gives
the same answer as one request to one stub. "<eos-first>" in a prompt makes the first token EOS.
A request with ``temperature > 0`` stands in for sampling: with a ``seed`` its tokens are a pure
function of the seed and the sequence (alike on every stub), without one they depend on the
stub's ``--salt`` too (so two stubs answer differently).
Test hooks: ``POST /stub/fail {"status": 500, "count": 1}`` fails the next requests;
``{"dead": true}`` plays a vLLM whose EngineCore died (every request a 500 naming it, /health
503) and ``{"die_mid_stream": true}`` one that dies during its next stream (one token, then
vLLM's error event and [DONE], then dead), both until ``POST /stub/reset``; ``GET /stub/log``
returns the request bodies it saw (and each one's ``traceparent``, ``tracestate`` and
``X-Request-Id`` headers), the text it generated for each, and how many streams the
client cut. ``{"answer": {...}}`` makes the next answer that object verbatim (200, as an engine
with a different API shape would); ``GET /metrics`` gives vLLM's ``vllm:num_requests_running`` /
``vllm:num_requests_waiting`` (``--max-running`` bounds the first, the rest wait; ``--prompt-delay``
adds seconds to each completion) for the proxy's load scrapes; ``--no-token-ids`` plays an engine that ignores
``return_token_ids`` (an older vLLM, another engine behind the same API). With
``KVFERRY_STUB_TRACE=1`` in its environment, ``GET /stub/trace`` returns (and forgets) each
completion's CLOCK_MONOTONIC timestamps (benchmarks/c1_segments.py; off: no cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid

from aiohttp import web

from kvferry.common.wire.transfer_params import ParamsError, answer, error_answer, prefill_params

EOS = 2
# KVFERRY_STUB_TRACE=1: each completion's CLOCK_MONOTONIC times (ns), kept in memory and read (and
# cleared) by GET /stub/trace: [request no., "P" (not streamed) or "D", handler entered, body read,
# first chunk written (a whole answer: its end), last chunk written]. The request number is the
# prompt's first word (a text prompt, or a byte-tokenized one: benchmarks' prompts begin with it).
TRACE = bool(os.environ.get("KVFERRY_STUB_TRACE"))
_now = time.monotonic_ns


def _prompt_no(prompt: object) -> int:
    if isinstance(prompt, str):
        head = prompt.split(" ", 1)[0]
    elif isinstance(prompt, list):
        head = "".join(chr(t - 10) for t in prompt[:12]).split(" ", 1)[0]
    else:
        return -1
    return int(head) if head.isdigit() else -1


ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."  # vLLM's words


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))  # compact, as vLLM writes it


def tokenize(text: str) -> list[int]:
    return [10 + (b % 200) for b in text.encode()]


def next_token(seq: list[int], mix: int = 0) -> int:
    h = 7
    for t in seq[-64:]:
        h = (h * 31 + t) % 1_000_003
    return 300 + (h + len(seq) + mix) % 500


def token_text(t: int) -> str:
    return f" w{t}"


def render_chat(messages: list[dict]) -> str:
    return "".join(f"<{m.get('role')}>{m.get('content') or ''}\n" for m in messages) + "<assistant>"


def _kv_answer(body: dict, first: int, num_tokens: int) -> dict:
    """What kvferry's connector adds to a prefill leg's answer (a bad kv_transfer_params: its error)."""
    try:
        p = prefill_params(body.get("kv_transfer_params"))
    except ParamsError as e:
        return {"kv_transfer_params": error_answer(str(e))}
    return {"kv_transfer_params": answer(p.tid, num_tokens, first)} if p is not None else {}


class Stub:
    def __init__(self, token_delay: float, salt: int = 1, token_ids: bool = True, prompt_delay: float = 0.0,
                 max_running: int = 0) -> None:
        self.token_delay = token_delay
        self.prompt_delay = prompt_delay
        self.slots = asyncio.Semaphore(max_running) if max_running > 0 else None
        self.waiting = 0
        self.token_ids = token_ids
        self.verbatim: list[object] = []
        self.active = self.max_active = 0  # completions being answered at once, and the most seen
        self.salt = salt
        self.fail: list[int] = []
        self.log: list[dict] = []
        self.headers: list[dict] = []  # each logged request's traceparent, tracestate and X-Request-Id
        self.answers: list[str] = []
        self.cut_streams = 0
        self.dead = False
        self.die_mid_stream = False
        self.trace: list[list] = []

    async def stub_trace(self, request: web.Request) -> web.Response:
        out, self.trace = self.trace, []
        return web.json_response(out)

    def _log_headers(self, request: web.Request) -> None:
        self.headers.append({k: request.headers.get(k) for k in ("traceparent", "tracestate", "x-request-id")})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="", status=503 if self.dead else 200)

    async def stub_log(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.log, "headers": self.headers, "answers": self.answers,
                                  "cut_streams": self.cut_streams,
                                  "max_active": self.max_active})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize_endpoint)
        app.router.add_post("/stub/fail", self.set_fail)
        app.router.add_get("/stub/log", self.stub_log)
        app.router.add_post("/stub/reset", self.reset)
        app.router.add_get("/stub/trace", self.stub_trace)
        return app

    async def set_fail(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("dead"):
            self.dead = True
        elif body.get("die_mid_stream"):
            self.die_mid_stream = True
        elif "answer" in body:
            self.verbatim.append(body["answer"])
        else:
            self.fail += [int(body.get("status", 500))] * int(body.get("count", 1))
        return web.json_response({"ok": True})

    async def reset(self, request: web.Request) -> web.Response:
        self.fail, self.log, self.answers, self.cut_streams, self.max_active = [], [], [], 0, 0
        self.headers = []
        self.dead = self.die_mid_stream = False
        self.verbatim = []
        return web.json_response({"ok": True})

    async def tokenize_endpoint(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize (a prompt, or chat messages): what cache-aware routers ask before routing."""
        body = await request.json()
        text = render_chat(body["messages"]) if "messages" in body else str(body.get("prompt", ""))
        ids = tokenize(text)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 1 << 20})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "kvferry"}]})

    def _generate(self, body: dict, prompt_ids: list[int], eos_first: bool) -> tuple[list[int], str]:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        seq, out = list(prompt_ids), []
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        temp, seed = body.get("temperature"), body.get("seed")
        mix = 0 if not (isinstance(temp, (int, float)) and temp > 0) else seed if isinstance(seed, int) else self.salt
        text = ""  # grown a token at a time: joined whole per token, a long answer took quadratic time
        for i in range(n):
            t = EOS if (eos_first and i == 0) else next_token(seq, mix)
            out.append(t)
            seq.append(t)
            if t == EOS:
                return out, "stop"
            if stops:
                text += token_text(t)
                if any(s in text for s in stops):
                    return out, "stop"
        return out, "length"

    async def _maybe_fail(self) -> web.Response | None:
        if self.dead:
            return web.json_response({"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None,
                                                "code": 500}}, status=500)
        if self.fail:
            status = self.fail.pop(0)
            return web.json_response({"error": {"message": f"stub failure {status}", "type": "stub", "code": status}},
                                     status=status)
        if self.verbatim:
            return web.json_response(self.verbatim.pop(0))
        return None

    async def metrics(self, request: web.Request) -> web.Response:
        lines = [f'vllm:num_requests_running{{engine="0",model_name="stub"}} {float(self.active)}',
                 f'vllm:num_requests_waiting{{engine="0",model_name="stub"}} {float(self.waiting)}',
                 'vllm:kv_cache_usage_perc{engine="0",model_name="stub"} 0.0']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if self.slots is not None:
            self.waiting += 1
            try:
                await self.slots.acquire()
            finally:
                self.waiting -= 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.prompt_delay:
                await asyncio.sleep(self.prompt_delay)
            return await self._completions(request)
        finally:
            self.active -= 1
            if self.slots is not None:
                self.slots.release()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        t_in = _now() if TRACE else 0
        body = await request.json()
        tr: list = []
        if TRACE:
            tr = [_prompt_no(body.get("prompt")), "D" if body.get("stream") else "P", t_in, _now(), 0, 0]
            self.trace.append(tr)
        self.log.append(body)
        self._log_headers(request)
        if (r := await self._maybe_fail()) is not None:
            return r
        prompt = body.get("prompt")
        if prompt is None or body.get("max_tokens", 1) == 0:
            return web.json_response({"error": {"message": "bad request", "type": "BadRequestError", "code": 400}},
                                     status=400)
        ids = tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        eos_first = isinstance(prompt, str) and "<eos-first>" in prompt
        toks, finish = self._generate(body, ids, eos_first)
        self.answers.append("".join(token_text(t) if t != EOS else "" for t in toks))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        extra = _kv_answer(body, toks[0], len(ids))
        texts = [token_text(t) if t != EOS else "" for t in toks]
        # vLLM echoes no prompt text when it returns the prompt's token ids instead.
        echo = prompt if (body.get("echo") and isinstance(prompt, str)
                          and not (body.get("return_token_ids") and self.token_ids)) else ""
        lp = bool(body.get("logprobs"))

        def logprobs(ts: list[int], tx: list[str]) -> dict | None:
            return {"tokens": tx, "token_logprobs": [-(t % 7) / 10 for t in ts],
                    "top_logprobs": [{x: -(t % 7) / 10} for t, x in zip(ts, tx, strict=True)],
                    "text_offset": list(range(len(ts)))} if lp else None
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(toks), "total_tokens": len(ids) + len(toks)}
        if not body.get("stream"):
            choice = {"index": 0, "text": echo + "".join(texts), "logprobs": logprobs(toks, texts),
                      "finish_reason": finish, "stop_reason": None}
            if (body.get("return_token_ids") and self.token_ids):
                choice["token_ids"] = toks
                choice["prompt_token_ids"] = ids
            await asyncio.sleep(self.token_delay * len(toks))
            r = web.json_response({"id": rid, "object": "text_completion", "created": created, "model": "stub",
                                   "choices": [choice], "usage": usage, **extra})
            if TRACE:
                await r.prepare(request)
                await r.write_eof()
                tr[4] = tr[5] = _now()
            return r
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i, (t, x) in enumerate(zip(toks, texts, strict=True)):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                c = {"index": 0, "text": (echo if i == 0 else "") + x, "logprobs": logprobs([t], [x]),
                     "finish_reason": finish if i == len(toks) - 1 else None, "stop_reason": None}
                if (body.get("return_token_ids") and self.token_ids):
                    c["token_ids"] = [t]
                await resp.write(b"data: " + _dumps({"id": rid, "object": "text_completion", "created": created,
                                                         "model": "stub", "choices": [c]}).encode() + b"\n\n")
                if TRACE and i == 0:
                    tr[4] = _now()
                if self.die_mid_stream:
                    await self._die(resp)
                    return resp
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(b"data: " + _dumps({"id": rid, "object": "text_completion", "created": created,
                                                         "model": "stub", "choices": [], "usage": usage}).encode()
                                 + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            if TRACE:
                tr[5] = _now()
        except (ConnectionResetError, asyncio.CancelledError):
            self.cut_streams += 1
            raise
        return resp

    async def _die(self, resp: web.StreamResponse) -> None:
        """What vLLM's stream generator writes when the EngineCore dies after the 200 went out (a
        token's time after the token before it: a reader gets that token on its own)."""
        self.dead, self.die_mid_stream = True, False
        await asyncio.sleep(self.token_delay)
        err = {"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}}
        await resp.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.log.append(body)
        self._log_headers(request)
        if (r := await self._maybe_fail()) is not None:
            return r
        text = render_chat(body.get("messages") or [])
        ids = tokenize(text)
        toks, finish = self._generate(body, ids, "<eos-first>" in text)
        texts = [token_text(t) if t != EOS else "" for t in toks]
        self.answers.append("".join(texts))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(toks), "total_tokens": len(ids) + len(toks)}
        extra = _kv_answer(body, toks[0], len(ids))
        rti = bool(body.get("return_token_ids") and self.token_ids)
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * len(toks))
            return web.json_response({"id": rid, "object": "chat.completion", "created": created, "model": "stub",
                                      "choices": [{"index": 0, "message": {"role": "assistant",
                                                                           "content": "".join(texts)},
                                                   "logprobs": None, "finish_reason": finish,
                                                   "token_ids": toks if rti else None}],
                                      "usage": usage, "prompt_token_ids": ids if rti else None, **extra})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": "stub"}
        try:
            await resp.write(b"data: " + _dumps(dict(head, choices=[{"index": 0, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                prompt_token_ids=ids if rti else None)).encode() + b"\n\n")
            for i, x in enumerate(texts):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                await resp.write(b"data: " + _dumps(dict(head, choices=[{
                    "index": 0, "delta": {"content": x}, "logprobs": None,
                    "finish_reason": finish if i == len(texts) - 1 else None,
                    "token_ids": [toks[i]] if rti else None}])).encode() + b"\n\n")
                if self.die_mid_stream:
                    await self._die(resp)
                    return resp
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(b"data: " + _dumps(dict(head, choices=[], usage=usage)).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.cut_streams += 1
            raise
        return resp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token")
    ap.add_argument("--salt", type=int, default=None, help="mixed into unseeded sampled tokens (default: the port)")
    ap.add_argument("--prompt-delay", type=float, default=0.0, help="seconds added to every completion")
    ap.add_argument("--max-running", type=int, default=0, help="completions computed at once (0: no limit); "
                                                                "the rest wait")
    ap.add_argument("--no-token-ids", action="store_true", help="ignore return_token_ids, as an older engine does")
    args = ap.parse_args()
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    web.run_app(Stub(args.token_delay, args.port if args.salt is None else args.salt,
                     not args.no_token_ids, args.prompt_delay, args.max_running).app(),
                host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()

