"""proxy/streaming.plain_batch: a batch of a decoder's chunks rewritten whole equals each chunk
rewritten alone (id and created the client's, token ids kept and stripped), and anything unusual
is left to the chunk-by-chunk path."""

from __future__ import annotations

import json

import pytest

from kvferry.proxy.streaming import plain_batch

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


@pytest.mark.parametrize("batch", [
    [chunk(0), chunk(1, usage={"prompt_tokens": 3})],  # a usage: its own path
    [chunk(0), chunk(1, prompt_token_ids=[1, 2])],  # prompt ids on a chunk
    [chunk(0), chunk(1).replace(b'"token_ids":[1]', b'"token_ids":null')],  # a chunk without its ids
    [chunk(0), chunk(1).replace(b'"id":"cmpl-d"', b'"id":"cmpl-other"')],  # another id
    [chunk(0), chunk(1).replace(b'"created":5', b'"created": 5')],  # not compact
])
def test_an_unusual_chunk_is_left_to_the_chunk_by_chunk_path(batch: list[bytes]) -> None:
    assert plain_batch(batch, SWAP, False, keep_ids=True) is None
