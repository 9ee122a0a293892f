"""proxy/upstream.plain_events and proxy/relay.plain_batch: a read of SSE events split in one
pass, and a batch of a decoder's chunks rewritten whole, equal what the line-by-line and
chunk-by-chunk paths give (id and created the client's, token ids kept and stripped); anything
unusual is left to those paths."""

from __future__ import annotations

import json

import pytest

from kvferry.proxy.http.sse import plain_events
from kvferry.proxy.openai.stream_relay import CHAT, CHAT_UNUSUAL, StreamRelay, plain_batch, plain_sse

SWAP = (b'"id":"cmpl-d"', b'"id":"cmpl-client"', b'"created":5', b'"created":9')


def chunk(i: int, text: str = "x", finish: str | None = None, ids: list[int] | None = None, **extra) -> bytes:
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
         "token_ids": [i] if ids is None else ids}
    return json.dumps({"id": "cmpl-d", "object": "text_completion", "created": 5, "model": "m", "choices": [c],
                       **extra}, separators=(",", ":")).encode()


def events(sse: bytes) -> list[dict]:
    assert sse.endswith(b"\n\n")
    parts = sse[:-2].split(b"\n\n")
    assert all(p.startswith(b"data: ") for p in parts)
    return [json.loads(p[6:]) for p in parts]


@pytest.mark.parametrize("want_ids", [False, True])
def test_a_batch_rewritten_whole_equals_each_chunk_rewritten(want_ids: bool) -> None:
    # Text that holds the patterns themselves, escaped as JSON escapes them: never matched.
    texts = ['say "token_ids":[9]', '"id":"cmpl-d", "created":5', '"finish_reason":"stop"', "\\", "end"]
    batch = [chunk(i, t, ids=[i, i + 100] if i == 2 else None) for i, t in enumerate(texts)]
    batch[-1] = chunk(4, "end", finish="length")
    out = plain_batch(batch, SWAP, want_ids, keep_ids=True)
    assert out is not None
    sse, ids, ended = out
    assert ids == [0, 1, 2, 102, 3, 4] and ended
    want = []
    for raw in batch:
        c = json.loads(raw)
        c["id"], c["created"] = "cmpl-client", 9
        if not want_ids:
            c["choices"][0]["token_ids"] = None
        want.append(c)
    assert events(sse) == want
    assert plain_batch(batch[:-1], SWAP, want_ids, keep_ids=True)[2] is False  # no finish_reason yet
    # One chunk a read (a decoder's token at a time) takes plain_sse's shortest way: the same result.
    alone = [plain_batch([raw], SWAP, want_ids, keep_ids=True) for raw in batch]
    assert all(a is not None for a in alone)
    assert [e for a in alone for e in events(a[0])] == want
    assert [i for a in alone for i in a[1]] == ids and [a[2] for a in alone] == [False] * 4 + [True]


@pytest.mark.parametrize("batch", [
    [chunk(0), chunk(1, usage={"prompt_tokens": 3})],  # a usage: its own path
    [chunk(0), chunk(1, prompt_token_ids=[1, 2])],  # prompt ids on a chunk
    [chunk(0), chunk(1).replace(b'"token_ids":[1]', b'"token_ids":null')],  # a chunk without its ids
    [chunk(0), chunk(1).replace(b'"id":"cmpl-d"', b'"id":"cmpl-other"')],  # another id
    [chunk(0), chunk(1).replace(b'"created":5', b'"created": 5')],  # not compact
])
def test_an_unusual_chunk_is_left_to_the_chunk_by_chunk_path(batch: list[bytes]) -> None:
    assert plain_batch(batch, SWAP, False, keep_ids=True) is None
    assert plain_batch(batch[-1:], SWAP, False, keep_ids=True) is None  # alone, too


@pytest.mark.parametrize(("lists", "want"), [
    ([[5], [], [6, 7]], [5, 6, 7]),  # a chunk with no id (vLLM's last one may have none)
    ([[5], [2**70]], [5, 2**70]),  # past 64 bits: the engine's to refuse, kept as it came
    ([[5], [6]], [5, 6]),
])
def test_the_ids_kept_are_every_chunks_in_order(lists: list[list[int]], want: list[int]) -> None:
    out = plain_batch([chunk(i, ids=ids) for i, ids in enumerate(lists)], SWAP, False, keep_ids=True)
    assert out is not None and out[1] == want
    assert all(c["choices"][0]["token_ids"] is None for c in events(out[0]))


@pytest.mark.parametrize("bad", [b'"token_ids":[1,,2]', b'"token_ids":[1 2]', b'"token_ids":[,]'])
def test_ids_that_are_not_a_list_of_integers_are_left_to_the_chunk_by_chunk_path(bad: bytes) -> None:
    batch = [chunk(0), chunk(1).replace(b'"token_ids":[1]', bad)]
    assert plain_batch(batch, SWAP, False, keep_ids=True) is None
    assert plain_batch(batch[1:], SWAP, False, keep_ids=True) is None


@pytest.mark.parametrize("ids", [b'"token_ids":null', b"", b'"token_ids":[7]'])
def test_without_ids_to_keep_a_chunk_needs_none(ids: bytes) -> None:
    """--first-token decoder's legs ask for no token ids (vLLM writes null, another engine nothing):
    their chunks are usual ones, rewritten whole, in one read or many; ids that come are stripped."""
    raw = [chunk(i, finish="length" if i == 2 else None).replace(b'"token_ids":[%d]' % i, ids) for i in range(3)]
    raw = [r.replace(b',}', b'}') for r in raw]
    want = []
    for r in raw:
        c = json.loads(r)
        c["id"], c["created"] = "cmpl-client", 9
        if ids.endswith(b"]"):
            c["choices"][0]["token_ids"] = None
        want.append(c)
    alone = [plain_batch([r], SWAP, False, keep_ids=False) for r in raw]
    assert all(a is not None for a in alone), ids
    assert [e for a in alone for e in events(a[0])] == want
    assert [a[1] for a in alone] == [[], [], []] and [a[2] for a in alone] == [False, False, True]
    whole = plain_batch(raw, SWAP, False, keep_ids=False)
    assert whole is not None and events(whole[0]) == want and whole[1] == [] and whole[2]
    if not ids.endswith(b"]"):  # ids to keep must be there
        assert plain_batch(raw, SWAP, False, keep_ids=True) is None
        assert plain_batch(raw[:1], SWAP, False, keep_ids=True) is None


@pytest.mark.parametrize("sse", [
    b"data: [DONE]\n\n", b'data: {"error": {"message": "gone"}}\n\n',  # the end, an error
    b"data: " + chunk(0) + b"\r\n\r\n",  # carriage returns
    b"data: " + chunk(0) + b"\nid: 7\n\n",  # another field
    b": keep-alive\n\ndata: " + chunk(0) + b"\n\n",  # a comment first
    b"data: " + chunk(0) + b"\n\ndata: [DONE]\n\n",  # the end with a chunk
    b"data: " + chunk(0) + b"\n\ndata: " + chunk(1),  # a chunk cut short
])
def test_what_a_direct_read_must_not_relay_is_refused(sse: bytes) -> None:
    """plain_sse takes a read as the engine wrote it (StreamRelay.direct): anything but whole
    usual events is refused, for the leg's task to take."""
    assert plain_sse(sse, SWAP, True, keep_ids=False) is None


def chat_chunk(i: int, text: str = "x", **delta) -> bytes:
    c = {"index": 0, "delta": {"content": text, **delta}, "logprobs": None, "finish_reason": None, "token_ids": [i]}
    return json.dumps({"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 5, "model": "dm",
                       "choices": [c]}, separators=(",", ":")).encode()


def test_a_chat_batch_gets_the_clients_id_time_and_model_and_moves_only_plain_content() -> None:
    swap = (b'"id":"chatcmpl-d"', b'"id":"chatcmpl-p"', b'"created":5', b'"created":9',
            b'"model":"dm"', b'"model":"m"')
    batch = [chat_chunk(i, t) for i, t in enumerate(['"model":"dm"', "b"])]
    sse, ids, ended = plain_batch(batch, swap, False, keep_ids=True, unusual=CHAT_UNUSUAL)
    want = []
    for raw in batch:
        c = json.loads(raw)
        c.update(id="chatcmpl-p", created=9, model="m")
        c["choices"][0]["token_ids"] = None
        want.append(c)
    assert events(sse) == want and ids == [0, 1] and not ended
    # A tool call or reasoning is not plain text: a move cannot continue it (migrate.ChatMove).
    for extra in ({"tool_calls": [{"index": 0}]}, {"reasoning_content": "hm"}):
        assert plain_batch([batch[0], chat_chunk(2, "", **extra)], swap, False, True, CHAT_UNUSUAL) is None
    assert plain_batch(batch, (), True, keep_ids=False, unusual=CHAT_UNUSUAL)[0] == (
        b"data: " + b"\n\ndata: ".join(batch) + b"\n\n")  # nothing to swap: the engine's bytes


def test_a_chat_stream_without_a_move_goes_out_as_written_tool_calls_and_usage_too() -> None:
    """Only a move needs plain content and ids (migrate.ChatMove); without one, the relay sends a
    tool call and the usage as the engine wrote them, the client's id swapped in."""
    batch = [chat_chunk(0, "", tool_calls=[{"index": 0}]),
             json.dumps({"id": "chatcmpl-d", "created": 5, "model": "dm", "choices": [], "usage": {"total_tokens": 3}},
                        separators=(",", ":")).encode()]
    relay = StreamRelay(None, CHAT, None, True, None, ())  # type: ignore[arg-type]  # usual() writes nothing itself
    relay.learn(("chatcmpl-d", 5, "dm"), ("chatcmpl-p", 5, "dm"))
    out = relay.usual(batch)
    assert out == b"data: " + b"\n\ndata: ".join(batch).replace(b"chatcmpl-d", b"chatcmpl-p") + b"\n\n"


def test_plain_events_split_what_the_line_by_line_reader_splits() -> None:
    chunks = [chunk(0, "x"), chunk(1, "y\nz"), b"[DONE]"]  # a newline in a text is escaped
    whole = b"\n\n".join(b"data: " + c for c in chunks)
    assert plain_events(whole) == chunks
    assert plain_events(b"data: " + chunks[0]) == chunks[:1]


@pytest.mark.parametrize("whole", [
    b"data: {}\r\n\r\ndata: {}",  # carriage returns
    b"event: x\ndata: {}\n\ndata: {}",  # another field
    b'data: {}\n\ndata: {"error": {"message": "gone"}}',  # an error event: checked line by line
    b": keep-alive\n\ndata: {}",  # a comment
    b"data: " + chunk(1, "data: inside the text"),  # the prefix in a text: counted, so not split here
])
def test_plain_events_leave_the_rest_to_the_line_by_line_reader(whole: bytes) -> None:
    assert plain_events(whole) is None
