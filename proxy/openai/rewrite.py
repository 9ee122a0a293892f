"""A decode stream's chunks as the client gets them, rewritten as bytes a read at a time rather
than parsed chunk by chunk, and, for a read that comes while the stream's task waits, written to
the client in the decoder connection's own callback (Upstream.events' `direct`): no task wakeup
per token; a chunk that is not the usual one is rewritten on its own.
flows/completion_stream.py and flows/chat_stream.py relay what it rewrites."""

from __future__ import annotations

import re
import time
from typing import Any, Protocol

from kvferry.proxy.http import json_codec
from kvferry.proxy.openai.merge import offset_after, shift_offsets

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


GAPS_BATCH = 64  # a long stream's gaps reach /metrics every this many batches


class Client(Protocol):
    """Where the chunks go (http/sse.py's SSEResponse)."""

    def write_now(self, data: bytes) -> bool: ...


# A chunk with one of these keys is not a usual one: a usage or prompt ids chunk; in chat, a delta
# that is not plain content (a move continues plain text only: migrate.ChatMove). A substring test
# per key: bytes' own search is cheaper than one regex whose every '"' starts a try.
COMPLETION_UNUSUAL = (b'"usage"', b'"prompt_token_ids":[')
CHAT_UNUSUAL = (*COMPLETION_UNUSUAL, b'"tool_calls"', b'"reasoning', b'"function_call"')
_FINISH = b'"finish_reason":'


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


class CompletionRewriter:
    """A completion's decode stream as the client gets it: every chunk of it is rewritten here,
    whichever way it comes. A read of usual chunks (`direct`, called in the decoder connection's
    callback: Upstream.events) or a batch of them (`batch`) is rewritten as bytes, all at once
    (plain_batch); any other chunk is rewritten on its own: as bytes in place when its id and
    time are where vLLM writes them, else parsed. The decode leg's own usage chunk is not the
    client's: it goes to `on_usage`."""

    __slots__ = ("resp", "itl", "want_ids", "parse_lp", "swap", "sent", "ended", "gaps", "last", "ours", "shift",
                 "next_off", "on_usage", "on_no_ids")

    def __init__(self, resp: Client, itl: Any, want_ids: bool, parse_lp: bool, sent: list[int] | None,
                 ours: tuple[str, int], shift: int, on_usage: Any, on_no_ids: Any) -> None:
        self.resp, self.itl, self.want_ids, self.parse_lp = resp, itl, want_ids, parse_lp
        self.swap: tuple[bytes, ...] | None = None  # the leg's id and time, and ours (plain_batch)
        # The tokens the client got, to continue elsewhere if the decoder fails; None once a chunk
        # came without its token ids.
        self.sent = sent
        self.ended = False  # a chunk with a finish_reason went out (on this leg)
        self.gaps: list[float] = []  # inter-token gaps, observed together (Histogram.observe_all)
        self.last = 0.0
        self.ours = ours  # the client's id and created
        # Plain vLLM's text offsets run on across chunks: each leg's start at 0 again, so they are
        # moved on by `shift` (the first token's, then where the last leg stopped: `next_off`).
        self.shift = self.next_off = shift
        self.on_usage, self.on_no_ids = on_usage, on_no_ids

    def new_leg(self, now: float) -> None:
        """A decode leg starts (the first, or one on another decoder): its id is learnt anew."""
        self.last, self.swap, self.ended = now, None, False
        self.shift = self.next_off

    def learn(self, dec: tuple[Any, Any]) -> None:
        """From a decoder's chunk (its id and created): both pairs kept, in that order (`one` swaps
        them by index)."""
        self.swap = swap_pairs((b'"id":', b'"created":'), dec, self.ours, True)

    def batch(self, batch: list[bytes], parse: Any) -> bytes:
        """A batch of the leg's chunk payloads as the client's SSE bytes (b"" for none); `parse`
        turns one payload into a checked dict (Upstream.chunk)."""
        # The decode leg's usage chunk comes last: the chunks before it may still be usual.
        usage_tail = batch[-1:] if b'"usage"' in batch[-1] else []
        fast = self._rewrite(batch[:-1] if usage_tail else batch)
        out = []
        if fast is not None:  # the usual chunks, rewritten whole
            self._note(fast)
            out.append(fast[0])
            batch = usage_tail
        for data in batch:
            one = self.one(data, parse)
            if one is not None:
                out.append(b"data: " + one + b"\n\n")
        return b"".join(out)

    def one(self, data: bytes, parse: Any) -> bytes | None:
        """One chunk's payload as the client gets it; None for the leg's own usage chunk."""
        if b'"usage"' in data:
            u = parse(data)
            if not u.get("choices") and u.get("usage"):
                self.on_usage(u)
                return None
        m = TOKEN_IDS.search(data)  # one search: the ids kept and stripped
        if self.sent is not None:
            ids = token_ids_in(data, m)
            if ids is None:
                self.sent = None  # an engine that ignores return_token_ids: no moving
                self.on_no_ids()
            else:
                self.sent += ids
        if b'"finish_reason":null' not in data and b'"finish_reason"' in data:
            self.ended = True
        swap = self.swap
        assert swap is not None, "learn() first"
        if swap[0] in data and swap[2] in data and not self.parse_lp and b'"prompt_token_ids":[' not in data:
            # vLLM writes compact JSON: swap the decoder's id and time for ours in place (the ids
            # first: `m` points into the chunk as it came).
            if not self.want_ids:
                data = strip_token_ids(data, m)
            return data.replace(swap[0], swap[1], 1).replace(swap[2], swap[3], 1)
        chunk = parse(data)
        chunk["id"], chunk["created"] = self.ours
        for c in chunk.get("choices", []):
            if "prompt_token_ids" in c:  # the decode leg's, not the client's
                c["prompt_token_ids"] = None
            if not self.want_ids and "token_ids" in c:
                c["token_ids"] = None
            if self.parse_lp:
                shift_offsets(c, self.shift)
                self.next_off = offset_after(c.get("logprobs")) or self.next_off
        return json_codec.dumps(chunk)

    def direct(self, sse: bytes) -> bool:
        """Write a read of usual chunks to the client at once; False (nothing changed) otherwise."""
        if self.swap is None or self.parse_lp:
            return False
        fast = plain_sse(sse, self.swap, self.want_ids, self.sent is not None)
        if fast is None or not self.resp.write_now(fast[0]):
            return False
        self._note(fast)
        self.tick()
        return True

    def tick(self) -> None:
        now = time.perf_counter()
        self.gaps.append(now - self.last)
        self.last = now
        if len(self.gaps) >= GAPS_BATCH:
            self.itl.observe_all(self.gaps)
            self.gaps.clear()

    def _rewrite(self, head: list[bytes]) -> tuple[bytes, list[int], bool] | None:
        if self.swap is None or self.parse_lp or not head:
            return None
        return plain_batch(head, self.swap, self.want_ids, self.sent is not None)

    def _note(self, fast: tuple[bytes, list[int], bool]) -> None:
        if self.sent is not None:
            self.sent += fast[1]
        self.ended = self.ended or fast[2]
