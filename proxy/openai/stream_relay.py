"""Every path a streamed chunk takes from a decoder to the client, for completions and chat alike.

The byte primitives rewrite a read of usual chunks all at once rather than parsing them chunk by
chunk (`plain_sse`, `plain_batch`; the token ids found and stripped without parsing). A dialect
(`COMPLETION`, `CHAT`) says which keys are swapped for the client's values and which keys make a
chunk unusual: a new field a chunk must rewrite is one entry there.

`StreamRelay` relays a decode stream with them: a read of usual chunks in the decoder
connection's own callback when it comes while the stream's task waits (`direct`, offered by
Upstream.events: no task wakeup per token), else a batch at a time in that task (`usual`). A
chunk that is not the usual one is rewritten on its own (`CompletionChunks.one`,
`ChatChunks.batch`). The relay keeps what the client got: the token ids (`sent`, None once they
cannot be kept: then the stream cannot continue elsewhere), whether a chunk ended the answer
(`ended`), and the gaps between reads (the inter-token latency, observed in batches). The chat
chunks the proxy writes itself (the prefiller's first token, a finished answer, a continuation's
completion choice) are built here too.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

from kvferry.common.log import get_logger
from kvferry.proxy.http import json_codec
from kvferry.proxy.http.sse import sse
from kvferry.proxy.openai.merge import offset_after, shift_offsets

logger = get_logger(__name__)

# vLLM writes compact JSON: a chunk's token ids are found without parsing it ("prompt_token_ids"
# does not match: its key has no quote before "token_ids").
TOKEN_IDS = re.compile(rb'"token_ids":\[([0-9,\s]*)\]')


def token_ids_in(data: bytes, m: re.Match | None | bool = True) -> list[int] | None:
    """The `token_ids` of one raw stream chunk, None when it has none (`m`: TOKEN_IDS.search(data)
    when the caller has it)."""
    if m is True:
        m = TOKEN_IDS.search(data)
    if m is None or m is False:
        return None
    try:
        return ids_list(m.group(1))
    except ValueError:  # "1,,2": not JSON, so no ids the proxy can keep
        return None


def ids_list(inner: bytes) -> list[int]:
    """What TOKEN_IDS' group holds (between the brackets) as ints; ValueError for "1,,2"."""
    inner = inner.strip()
    return [int(x) for x in inner.split(b",")] if inner else []


def strip_token_ids(data: bytes, m: re.Match | None | bool = True) -> bytes:
    """A raw chunk without its `token_ids` (the proxy asked for them; the client did not); `m`:
    TOKEN_IDS.search(data) when the caller has it (one search serves both)."""
    if m is True:
        m = TOKEN_IDS.search(data)
    if m is None or m is False:
        return data
    return data[:m.start()] + b'"token_ids":null' + data[m.end():]


# A chunk with one of these keys is not a usual one: a usage or prompt ids chunk; in chat, a delta
# that is not plain content (a move continues plain text only: migrate.ChatMove). A substring test
# per key: bytes' own search is cheaper than one regex whose every '"' starts a try.
COMPLETION_UNUSUAL = (b'"usage"', b'"prompt_token_ids":[')
CHAT_UNUSUAL = (*COMPLETION_UNUSUAL, b'"tool_calls"', b'"reasoning', b'"function_call"')
_FINISH = b'"finish_reason":'


@dataclass(frozen=True)
class Dialect:
    """A stream's chunks as the relay sees them: the keys whose values are swapped for the
    client's (`keep_equal`: each pair kept even when the values are equal, for a caller that swaps
    them by index), and the keys that make a chunk unusual."""

    object: str
    swap_keys: tuple[bytes, ...]
    keep_equal: bool
    unusual: tuple[bytes, ...]


COMPLETION = Dialect("text_completion", (b'"id":', b'"created":'), True, COMPLETION_UNUSUAL)
CHAT = Dialect("chat.completion.chunk", (b'"id":', b'"created":', b'"model":'), False, CHAT_UNUSUAL)


def _token_ids(found: list[bytes]) -> list[int]:
    """The ids inside a read's `"token_ids":[...]` lists, in order: one C call for all of them, a
    list at a time only where that refuses (an empty list, a number past 64 bits). ValueError when
    they are not integers."""
    try:
        return json_codec.int_list(b"[" + b",".join(found) + b"]")
    except ValueError:
        return [t for inner in found for t in ids_list(inner)]


def plain_sse(sse: bytes, swap: tuple[bytes, ...], want_ids: bool, keep_ids: bool,
              unusual: tuple[bytes, ...] = COMPLETION_UNUSUAL) -> tuple[bytes, list[int], bool] | None:
    """Whole SSE events of a stream's chunks (each `data: {...}` and a blank line, as vLLM writes
    them) as the client gets them, rewritten in a few passes over all of them rather than chunk by
    chunk: (the SSE bytes, the token ids in them, whether a chunk had a finish_reason). `swap`:
    pairs of a decoder's key and value (its id, time, ...) and the client's, flattened; every
    chunk must have each. None when any event is not the usual one (another field or line, an
    error, [DONE], an `unusual` key, a chunk without a swapped key or, with `keep_ids`, its token
    ids): the caller then takes each chunk as it comes. vLLM writes compact JSON, and a quote or
    newline inside a string is escaped, so each pattern matches a key of a chunk, never its text.
    One event (a token per read, as a decoder streams) takes the shortest way."""
    if (not sse.startswith(b"data: ") or not sse.endswith(b"\n\n") or sse.startswith(b'data: {"error"')
            or sse.startswith(b"data: [DONE]") or b"\r" in sse):
        return None
    for key in unusual:
        if key in sse:
            return None
    one = sse.find(b"\n") == len(sse) - 2
    if one:
        n = 1
    else:
        n = sse.count(b"\n\n")
        if sse.count(b"\n") != 2 * n or sse.count(b"data: ") != n or b'{"error"' in sse or b"data: [DONE]" in sse:
            return None
    olds = swap[::2]
    for o in olds:
        if (o not in sse) if one else (sse.count(o) != n):
            return None
    got = _ids(sse, one, n, want_ids, keep_ids)
    if got is None:
        return None
    sse, ids = got
    if one:
        f = sse.find(_FINISH)
        ended = f >= 0 and not sse.startswith(b"null", f + len(_FINISH))
    else:
        ended = sse.count(_FINISH) != sse.count(_FINISH + b"null")
    for i in range(0, len(swap), 2):
        sse = sse.replace(swap[i], swap[i + 1])
    return sse, ids, ended


def _ids(sse: bytes, one: bool, n: int, want_ids: bool, keep_ids: bool) -> tuple[bytes, list[int]] | None:
    """plain_sse's token ids: (the events, stripped of their ids unless `want_ids`; the ids when
    `keep_ids`), None when an event lacks the ids `keep_ids` needs or they are not integers."""
    if want_ids and not keep_ids:
        return sse, []
    # Without keep_ids a chunk need not carry ids (--first-token decoder's legs do not ask: vLLM
    # writes null, others nothing); whatever ids come are stripped all the same.
    if one:
        m = TOKEN_IDS.search(sse)
        if m is None:
            if keep_ids:
                return None
            found = []
        else:
            found = [m.group(1)]
            if not want_ids:
                sse = strip_token_ids(sse, m)
    else:
        parts = TOKEN_IDS.split(sse)  # one pass: the text around each list, and its ids
        found = parts[1::2]
        if keep_ids and len(found) != n:
            return None
        if found and not want_ids:
            sse = b'"token_ids":null'.join(parts[::2])
    if not keep_ids:
        return sse, []
    try:
        return sse, _token_ids(found)
    except ValueError:  # "1,,2": the chunk by chunk path decides
        return None


def plain_batch(batch: list[bytes], swap: tuple[bytes, ...], want_ids: bool, keep_ids: bool,
                unusual: tuple[bytes, ...] = COMPLETION_UNUSUAL) -> tuple[bytes, list[int], bool] | None:
    """plain_sse of events already split (Upstream.events' batches: their `data:` payloads)."""
    return plain_sse(b"data: " + b"\n\ndata: ".join(batch) + b"\n\n", swap, want_ids, keep_ids, unusual)


def swap_pairs(keys: tuple[bytes, ...], dec: tuple[Any, ...], ours: tuple[Any, ...],
               keep_equal: bool) -> tuple[bytes, ...]:
    """plain_sse's `swap`: each key (`b'"id":'`) with a decoder's value and the client's, as
    vLLM's compact JSON writes them; a pair whose values are equal left out unless `keep_equal`."""
    swap: tuple[bytes, ...] = ()
    for key, d, o in zip(keys, dec, ours, strict=True):
        if keep_equal or d != o:
            swap += (key + json_codec.dumps(d), key + json_codec.dumps(o))
    return swap


def first_chat_chunks(first: dict, first_text: str, body: dict) -> bytes:
    """The prefiller's first token as plain vLLM streams it: a role chunk (with the prompt's
    token ids when `return_token_ids` asked for them), then the token's chunk with its logprobs
    and token id taken from the prefiller's non-streamed answer."""
    choice = first["choices"][0]
    head = {"id": first.get("id"), "object": CHAT.object, "created": first.get("created"), "model": first.get("model")}
    want_ids = bool(body.get("return_token_ids"))
    role = dict(head, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}],
                prompt_token_ids=first.get("prompt_token_ids") if want_ids else None, prompt_text=None)
    token = dict(head, choices=[{"index": 0, "delta": {"content": first_text},
                                 "logprobs": choice.get("logprobs") if body.get("logprobs") else None,
                                 "finish_reason": None,
                                 "token_ids": choice.get("token_ids") if want_ids else None}])
    return sse(role) + sse(token)


def whole_chat_chunks(out: dict, body: dict) -> bytes:
    """A chat answer the prefiller already finished, as the stream the client asked for: one
    chunk with the whole message, then the usage when asked for."""
    choice = out["choices"][0]
    msg = choice.get("message") or {}
    head = {"id": out.get("id"), "object": CHAT.object, "created": out.get("created"), "model": out.get("model")}
    delta = {k: v for k, v in msg.items() if v not in (None, [], "") and k != "role"}
    got = sse(dict(head, choices=[{"index": 0, "delta": {"role": "assistant", **delta},
                                   "logprobs": choice.get("logprobs"), "finish_reason": choice.get("finish_reason")}]))
    if (body.get("stream_options") or {}).get("include_usage") and out.get("usage"):
        got += sse(dict(head, choices=[], usage=out["usage"]))
    return got


def drop_first_token(c: dict) -> None:
    """Take the first token out of a decoder chunk's choice: its logprob entry and token id (the
    client already has the prefiller's)."""
    if c.get("token_ids"):
        c["token_ids"] = c["token_ids"][1:]
    lp = c.get("logprobs")
    if isinstance(lp, dict) and lp.get("content"):
        lp["content"] = lp["content"][1:]


def chat_chunk(c: dict, head: dict, body: dict) -> dict:
    """A continuation's completion choice as a chat chunk (logprobs in chat's shape)."""
    out = {"index": 0, "delta": {"content": c.get("text") or ""}, "logprobs": None,
           "finish_reason": c.get("finish_reason")}
    lp = c.get("logprobs")
    if body.get("logprobs") and isinstance(lp, dict):
        k = body.get("top_logprobs") or 0
        content = []
        for i, tok in enumerate(lp.get("tokens") or []):
            top = (lp.get("top_logprobs") or [None] * (i + 1))[i] or {}
            content.append({"token": tok, "logprob": max((lp.get("token_logprobs") or [])[i], -9999.0),
                            "bytes": list(tok.encode("utf-8", errors="replace")),
                            "top_logprobs": [{"token": t, "logprob": max(v, -9999.0),
                                              "bytes": list(t.encode("utf-8", errors="replace"))}
                                             for t, v in list(top.items())[:k]]})
        out["logprobs"] = {"content": content}
    if c.get("finish_reason"):
        out["stop_reason"] = c.get("stop_reason")
    out["token_ids"] = c.get("token_ids")
    return dict(head, choices=[out])


GAPS_BATCH = 64  # a long stream's gaps reach /metrics every this many batches


class Client(Protocol):
    """Where the chunks go (http/sse.py's SSEResponse)."""

    def write_now(self, data: bytes) -> bool: ...


class StreamRelay:
    """A decode stream's chunks, rewritten for the client under its id (and, in chat, model)."""

    __slots__ = ("resp", "dialect", "itl", "want_ids", "unusual", "swap", "slow", "sent", "ended", "gaps", "last")

    def __init__(self, resp: Client, dialect: Dialect, itl: Any, want_ids: bool, sent: list[int] | None,
                 unusual: tuple[bytes, ...] | None = None) -> None:
        self.resp, self.dialect, self.itl, self.want_ids = resp, dialect, itl, want_ids
        # The dialect's unusual keys unless the caller says (a chat stream nothing needs to track
        # passes none: every whole read of it goes out at once).
        self.unusual = dialect.unusual if unusual is None else unusual
        self.swap: tuple[bytes, ...] | None = None  # the decoder's id (time, model) and the client's, flattened
        self.slow = False  # every chunk the chunk-by-chunk way (a completion's logprobs offsets move)
        self.sent = sent  # the token ids the client got; None: not kept
        self.ended = False  # a chunk with a finish_reason went out (on this leg)
        self.gaps: list[float] = []
        self.last = time.perf_counter()

    def new_leg(self, now: float) -> None:
        """A decode leg starts (the first, or one on another decoder): its id is learnt anew."""
        self.last, self.swap, self.ended = now, None, False

    def learn(self, dec: tuple[Any, ...], ours: tuple[Any, ...]) -> None:
        """From a decoder's chunk (its values of the dialect's swapped keys) and the client's."""
        self.swap = swap_pairs(self.dialect.swap_keys, dec, ours, self.dialect.keep_equal)

    def pass_through(self) -> None:
        """Nothing to swap: the engine's chunks go out as it wrote them."""
        self.swap = ()

    def keep(self, ids: list[int] | None) -> None:
        """A chunk rewritten on its own went out with these token ids (None: it had none)."""
        if self.sent is not None:
            if ids is None:
                self.sent = None
            else:
                self.sent += ids

    def usual(self, batch: list[bytes]) -> bytes | None:
        """A batch of chunk payloads as the client's SSE bytes, when every one is usual; else None."""
        if self.swap is None or self.slow or not batch:
            return None
        fast = plain_batch(batch, self.swap, self.want_ids, self.sent is not None, self.unusual)
        if fast is None:
            return None
        self._note(fast)
        return fast[0]

    def direct(self, sse: bytes) -> bool:
        """Write a read of usual chunks to the client at once; False (nothing changed) otherwise."""
        if self.swap is None or self.slow:
            return False
        fast = plain_sse(sse, self.swap, self.want_ids, self.sent is not None, self.unusual)
        if fast is None or not self.resp.write_now(fast[0]):
            return False
        self._note(fast)
        self.tick()
        return True

    def tick(self) -> None:
        """A read went out: its gap since the last one."""
        now = time.perf_counter()
        self.gaps.append(now - self.last)
        self.last = now
        if len(self.gaps) >= GAPS_BATCH:
            self.flush_gaps()

    def flush_gaps(self) -> None:
        self.itl.observe_all(self.gaps)
        self.gaps.clear()

    def _note(self, fast: tuple[bytes, list[int], bool]) -> None:
        if self.sent is not None:
            self.sent += fast[1]
        self.ended = self.ended or fast[2]


class CompletionChunks:
    """A completion's decode stream, every chunk of it: a batch of usual chunks through the relay,
    any other rewritten on its own, as bytes in place when its id and time are where vLLM writes
    them, else parsed. The decode leg's own usage chunk is not the client's: it goes to `on_usage`."""

    __slots__ = ("relay", "ours", "shift", "next_off", "on_usage", "on_no_ids")

    def __init__(self, relay: StreamRelay, ours: tuple[str, int], parse_lp: bool, shift: int, on_usage: Any,
                 on_no_ids: Any) -> None:
        self.relay, self.ours = relay, ours  # the client's id and created
        relay.slow = parse_lp
        # Plain vLLM's text offsets run on across chunks: each leg's start at 0 again, so they are
        # moved on by `shift` (the first token's, then where the last leg stopped: `next_off`).
        self.shift = self.next_off = shift
        self.on_usage, self.on_no_ids = on_usage, on_no_ids

    def new_leg(self, now: float) -> None:
        self.relay.new_leg(now)
        self.shift = self.next_off

    def learn(self, dec: tuple[Any, Any]) -> None:
        """From a decoder's chunk (its id and created): both pairs kept, in that order (`one` swaps
        them by index)."""
        self.relay.learn(dec, self.ours)

    def batch(self, batch: list[bytes], parse: Any) -> bytes:
        """A batch of the leg's chunk payloads as the client's SSE bytes (b"" for none); `parse`
        turns one payload into a checked dict (Upstream.chunk)."""
        # The decode leg's usage chunk comes last: the chunks before it may still be usual.
        usage_tail = batch[-1:] if b'"usage"' in batch[-1] else []
        fast = self.relay.usual(batch[:-1] if usage_tail else batch)
        out = []
        if fast is not None:  # the usual chunks, rewritten whole
            out.append(fast)
            batch = usage_tail
        for data in batch:
            one = self.one(data, parse)
            if one is not None:
                out.append(b"data: " + one + b"\n\n")
        return b"".join(out)

    def one(self, data: bytes, parse: Any) -> bytes | None:
        """One chunk's payload as the client gets it; None for the leg's own usage chunk."""
        relay = self.relay
        if b'"usage"' in data:
            u = parse(data)
            if not u.get("choices") and u.get("usage"):
                self.on_usage(u)
                return None
        m = TOKEN_IDS.search(data)  # one search: the ids kept and stripped
        if relay.sent is not None:
            ids = token_ids_in(data, m)
            relay.keep(ids)
            if ids is None:  # an engine that ignores return_token_ids: no moving
                self.on_no_ids()
        if b'"finish_reason":null' not in data and b'"finish_reason"' in data:
            relay.ended = True
        swap = relay.swap
        assert swap is not None, "learn() first"
        if swap[0] in data and swap[2] in data and not relay.slow and b'"prompt_token_ids":[' not in data:
            # vLLM writes compact JSON: swap the decoder's id and time for ours in place (the ids
            # first: `m` points into the chunk as it came).
            if not relay.want_ids:
                data = strip_token_ids(data, m)
            return data.replace(swap[0], swap[1], 1).replace(swap[2], swap[3], 1)
        chunk = parse(data)
        chunk["id"], chunk["created"] = self.ours
        for c in chunk.get("choices", []):
            if "prompt_token_ids" in c:  # the decode leg's, not the client's
                c["prompt_token_ids"] = None
            if not relay.want_ids and "token_ids" in c:
                c["token_ids"] = None
            if relay.slow:
                shift_offsets(c, self.shift)
                self.next_off = offset_after(c.get("logprobs")) or self.next_off
        return json_codec.dumps(chunk)


class ChatChunks:
    """A chat stream's chunks: a batch of usual ones through the relay, any other parsed and
    written under the client's id, time and model. With the prefiller's first token sent
    (`first_text`), the decoder's repeat of it is dropped; with `moving`, the token ids (and the
    prompt's, from a chunk that carries them: `prompt`) are kept for a move and stripped where the
    client did not ask for them."""

    __slots__ = ("relay", "ours", "skip", "repeat", "moving", "prompt")

    def __init__(self, relay: StreamRelay, ours: tuple[Any, Any, Any] | None, first_text: str | None,
                 moving: bool, prompt: Any) -> None:
        self.relay = relay
        self.ours = ours  # the client's id, created and model; None: the decoder's first chunk's
        self.skip = first_text or ""
        self.repeat = first_text is not None  # the decoder's repeat of the first token is still to come
        self.moving = moving
        # The prompt's token ids: a list, or msgspec.Raw as answers.loads_answer keeps the prefiller's.
        self.prompt: Any = prompt or None
        if ours is None and not self.skip and not moving:
            relay.pass_through()  # nothing to rewrite: each chunk goes out as the engine wrote it

    def batch(self, batch: list[bytes], parse: Any) -> bytes:
        """A batch of the leg's chunk payloads as the client's SSE bytes; `parse`: Upstream.chunk."""
        relay = self.relay
        # A tracked stream's usage chunk comes last: the chunks before it may still be usual.
        tail = batch[-1:] if relay.unusual and b'"usage"' in batch[-1] else []
        usual = relay.usual(batch[:-1] if tail else batch)
        out = []
        if usual is not None:
            out.append(usual)
            batch = tail
        for data in batch:
            chunk = parse(data)
            dec = chunk.get("id"), chunk.get("created"), chunk.get("model")
            if self.ours is None:
                self.ours = dec
            chunk["id"], chunk["created"], chunk["model"] = self.ours
            if self.repeat and chunk.get("choices") and not self._drop_repeat(chunk):
                continue
            if self.moving:
                self.track(chunk)
            if not self.repeat and relay.swap is None:
                relay.learn(dec, self.ours)  # the next chunks: a batch at a time
            out.append(sse(chunk))
        return b"".join(out)

    def track(self, chunk: dict) -> None:
        """Note a chunk about to go to the client; take out the ids the client did not ask for."""
        relay = self.relay
        if chunk.get("prompt_token_ids"):
            self.prompt = self.prompt or list(chunk["prompt_token_ids"])
            if not relay.want_ids:
                chunk["prompt_token_ids"] = None
        for c in chunk.get("choices") or []:
            delta = c.get("delta") or {}
            if any(delta.get(k) for k in ("tool_calls", "reasoning", "reasoning_content", "function_call")):
                relay.sent = None  # a move continues plain text only
            ids = c.get("token_ids")
            if ids is None:
                if delta.get("content"):
                    relay.sent = None
            else:
                relay.keep(ids)
                if not relay.want_ids:
                    c["token_ids"] = None
            if c.get("finish_reason"):
                relay.ended = True

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
