"""Failures mid-request, with stub engines (the proxy's logic; tests/e2e/test_migration_vllm.py runs
the same on real vLLM): a decode stream that breaks, dies or stalls continues on another decoder
with no duplicate, no gap and usage equal to what the client received."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from kvferry.proxy.openai.stream_relay import strip_token_ids, token_ids_in
from tests.polling import until
from tests.stub_procs import events, log, post, proxy, stubs

BODY = {"model": "stub", "prompt": "migrate this stream please", "max_tokens": 8, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": 1, "return_token_ids": True}


def _folded(ev: list) -> dict:
    """A stream folded: text, token ids, logprob tokens, the usage; no error events (the stubs'
    text offsets are not vLLM's: tests/e2e/test_migration_vllm.py compares those)."""
    assert ev[-1] == "[DONE]", ev
    chunks = ev[:-1]
    assert not any("error" in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    out = {"text": "", "token_ids": [], "tokens": [], "finish_reason": None}
    for c in chunks:
        for ch in c["choices"]:
            out["text"] += ch["text"]
            out["token_ids"] += ch.get("token_ids") or []
            if ch.get("logprobs"):
                out["tokens"] += ch["logprobs"]["tokens"]
            out["finish_reason"] = ch["finish_reason"] or out["finish_reason"]
    out["usage"] = chunks[-1]["usage"]
    return out


def _reference(ref, body: dict) -> dict:
    want = post(ref.url, "/v1/completions", dict(body, stream=False)).json()
    c = want["choices"][0]
    return {"text": c["text"], "token_ids": c["token_ids"], "tokens": (c["logprobs"] or {}).get("tokens", []),
            "finish_reason": c["finish_reason"], "usage": want["usage"]}


def test_token_ids_are_read_and_stripped_from_a_raw_chunk() -> None:
    raw = b'{"id":"x","choices":[{"index":0,"text":"a","token_ids":[5, 7],"prompt_token_ids":[1,2]}]}'
    assert token_ids_in(raw) == [5, 7]
    assert token_ids_in(b'{"choices":[{"prompt_token_ids":[1,2]}]}') is None
    assert token_ids_in(b'{"token_ids":[]}') == []
    assert strip_token_ids(raw) == raw.replace(b"[5, 7]", b"null")


def test_a_stream_whose_decoder_dies_migrates_with_no_gap_and_true_usage() -> None:
    """vLLM's error event mid-stream (EngineCore died): the stream goes on on the other decoder."""
    p0, d0, d1, ref = stubs(0, 0, 0, 0)
    px = proxy([p0], [d0, d1], "--policy", "round_robin", "--health-interval", "60")
    try:
        want = _reference(ref, BODY)
        httpx.post(d0.url + "/stub/fail", json={"die_mid_stream": True})
        for _ in range(2):  # round robin: one of these starts on d0, which dies after one token
            got = _folded(events(px.url, "/v1/completions", BODY))
            assert got == want
        moved = [q for q in log(d1)["requests"] if "kv_transfer_params" not in q]
        assert moved, "no continuation reached the other decoder"
        orig = log(d0)["requests"][0]  # the decode leg: prompt + first token, the transfer's id
        assert "kv_transfer_params" in orig
        sent = len(moved[-1]["prompt"]) - len(orig["prompt"])
        assert moved[-1]["prompt"][:len(orig["prompt"])] == orig["prompt"]
        assert moved[-1]["max_tokens"] == orig["max_tokens"] - sent
        assert 'kvferry_proxy_migrations_total{reason="stream_error"}' in httpx.get(px.url + "/metrics").text
    finally:
        for p in (px, p0, d0, d1, ref):
            p.stop()


@pytest.mark.parametrize("logprobs", [1, None], ids=["chunk_by_chunk", "direct_relay"])
def test_a_sigkilled_decoder_mid_stream_migrates(logprobs: int | None) -> None:
    """With logprobs each chunk's offsets are rewritten by the leg's task; without, the tokens
    that come a read at a time are relayed in the decoder connection's callback (StreamRelay.direct):
    either way the tokens the client got are kept, and the stream continues from them."""
    p0, d0, d1, ref = stubs(0, 0.2, 0.2, 0)
    px = proxy([p0], [d0, d1], "--policy", "round_robin", "--health-interval", "60")
    try:
        body = dict(BODY, max_tokens=10, logprobs=logprobs)
        want = _reference(ref, body)
        result: dict = {}

        def run() -> None:
            result["ev"] = events(px.url, "/v1/completions", body, each=lambda ev: result.update(n=len(ev)))
        t = threading.Thread(target=run)
        t.start()
        until(lambda: result.get("n", 0) >= 3, 60, "a few tokens out")  # on d0 (round robin starts there)
        assert log(d0)["requests"], "the stream did not start on d0"
        os.killpg(d0.proc.pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        assert _folded(result["ev"]) == want
    finally:
        for p in (px, p0, d0, d1, ref):
            p.stop()


def test_a_stalled_decoder_migrates_after_the_stall_timeout() -> None:
    p0, d0, d1, ref = stubs(0, 0.2, 0.2, 0)
    px = proxy([p0], [d0, d1], "--policy", "round_robin", "--health-interval", "60", "--stall-timeout", "1")
    stopped = False
    try:
        body = dict(BODY, max_tokens=10)
        want = _reference(ref, body)
        result: dict = {}

        def run() -> None:
            result["ev"] = events(px.url, "/v1/completions", body, each=lambda ev: result.update(n=len(ev)))
        t = threading.Thread(target=run)
        t.start()
        until(lambda: result.get("n", 0) >= 3, 60, "a few tokens out")
        assert log(d0)["requests"]
        os.killpg(d0.proc.pid, signal.SIGSTOP)
        stopped, t_stop = True, time.monotonic()
        t.join(60)
        assert not t.is_alive()
        assert _folded(result["ev"]) == want
        # The 1 s --stall-timeout ended the wait, not the default 60 s one (nor the client's 30 s read timeout).
        assert time.monotonic() - t_stop < 30
        assert 'kvferry_proxy_migrations_total{reason="stall"} 1.0' in httpx.get(px.url + "/metrics").text
    finally:
        if stopped:
            os.killpg(d0.proc.pid, signal.SIGCONT)
        for p in (px, p0, d0, d1, ref):
            p.stop()


def test_a_stalled_chat_stream_migrates_after_the_stall_timeout() -> None:
    p0, d0, d1, ref = stubs(0, 0.2, 0.2, 0)
    px = proxy([p0], [d0, d1], "--policy", "round_robin", "--health-interval", "60", "--stall-timeout", "1")
    stopped = False
    try:
        chat = {"model": "stub", "messages": [{"role": "user", "content": "stall this chat"}], "max_tokens": 10,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        want = post(ref.url, "/v1/chat/completions", dict(chat, stream=False)).json()
        result: dict = {}

        def run() -> None:
            result["ev"] = events(px.url, "/v1/chat/completions", chat, each=lambda ev: result.update(n=len(ev)))
        t = threading.Thread(target=run)
        t.start()
        until(lambda: result.get("n", 0) >= 4, 60, "a few tokens out")  # after the role's chunk
        assert log(d0)["requests"]
        os.killpg(d0.proc.pid, signal.SIGSTOP)
        stopped, t_stop = True, time.monotonic()
        t.join(60)
        # The 1 s --stall-timeout ended the wait, not the default 60 s one (nor the client's 30 s read timeout).
        assert not t.is_alive() and time.monotonic() - t_stop < 30
        ev = result["ev"]
        assert ev[-1] == "[DONE]" and not any("error" in c for c in ev[:-1]), ev
        chunks = ev[:-1]
        ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
        assert ids == want["choices"][0]["token_ids"] and chunks[-1]["usage"] == want["usage"]
        assert 'kvferry_proxy_migrations_total{reason="stall"} 1.0' in httpx.get(px.url + "/metrics").text
    finally:
        if stopped:
            os.killpg(d0.proc.pid, signal.SIGCONT)
        for p in (px, p0, d0, d1, ref):
            p.stop()


def test_a_chat_stream_served_locally_by_a_decoder_that_dies_moves_too(tiny_model_path) -> None:
    """A short prompt the decoder prefills itself (--local-prefill-tokens: one instance, no KV
    sent): its stream moves like a disaggregated one's."""
    p0, d0, d1, ref = stubs(0, 0, 0, 0)
    px = proxy([p0], [d0, d1], "--policy", "round_robin", "--health-interval", "60",
               "--local-prefill-tokens", "10000", "--tokenizer", str(tiny_model_path))
    try:
        chat = {"model": "stub", "messages": [{"role": "user", "content": "a local chat"}], "max_tokens": 8,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        want = post(ref.url, "/v1/chat/completions", dict(chat, stream=False, return_token_ids=True)).json()
        httpx.post(d0.url + "/stub/fail", json={"die_mid_stream": True})
        for _ in range(2):  # round robin: one of these starts on d0, which dies after one token
            ev = events(px.url, "/v1/chat/completions", chat)
            assert ev[-1] == "[DONE]" and not any("error" in c for c in ev[:-1]), ev
            chunks = ev[:-1]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert text == want["choices"][0]["message"]["content"] and chunks[-1]["usage"] == want["usage"]
            assert all(c["choices"][0].get("token_ids") is None for c in chunks if c["choices"])  # not asked for
        assert not log(p0)["requests"], "a local route sends nothing to the prefiller"
        assert 'kvferry_proxy_migrations_total{reason="stream_error"} 1.0' in httpx.get(px.url + "/metrics").text or \
            'kvferry_proxy_migrations_total{reason="stream_broken"} 1.0' in httpx.get(px.url + "/metrics").text
    finally:
        for p in (px, p0, d0, d1, ref):
            p.stop()


@pytest.mark.parametrize("first_token", ["prefiller", "decoder"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_served_locally_by_a_decoder_failing_before_its_first_chunk_runs_elsewhere(
        tiny_model_path, first_token: str, stream: bool) -> None:
    """A decoder serving a short prompt alone (--local-prefill-tokens) that fails (500) before
    anything reached the client: the conversation runs on another decoder, in either
    --first-token mode, streamed or not, sampled without a seed too (a stream nothing can continue)."""
    p0, d0, d1 = stubs(0, 0, 0)
    px = proxy([p0], [d0, d1], "--policy", "round_robin", "--health-interval", "60", "--first-token", first_token,
               "--local-prefill-tokens", "10000", "--tokenizer", str(tiny_model_path))
    try:
        chat = {"model": "stub", "messages": [{"role": "user", "content": "a local chat"}], "max_tokens": 6,
                "temperature": 0.7, "stream": stream}
        httpx.post(d0.url + "/stub/fail", json={"status": 500, "count": 1})
        texts = []
        for _ in range(2):  # round robin: one of these starts on d0
            if stream:
                ev = events(px.url, "/v1/chat/completions", chat)
                assert ev[-1] == "[DONE]" and not any("error" in c for c in ev[:-1]), ev
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in ev[:-1] if c["choices"])
            else:
                r = post(px.url, "/v1/chat/completions", chat)
                assert r.status_code == 200, r.text
                text = r.json()["choices"][0]["message"]["content"]
            texts.append(text)
        assert not log(p0)["requests"], "a local route sends nothing to the prefiller"
        assert len(log(d1)["requests"]) == 2, "d1 served its own request and the one d0 failed"
        assert 'kvferry_proxy_migrations_total{reason="upstream_5xx"} 1.0' in httpx.get(px.url + "/metrics").text
        # Unseeded samples differ between stubs: both answers are d1's.
        want = post(d1.url, "/v1/chat/completions", dict(chat, stream=False)).json()["choices"][0]
        assert texts == [want["message"]["content"]] * 2
    finally:
        for p in (px, p0, d0, d1):
            p.stop()


def test_no_migration_past_the_limit() -> None:
    """--max-migrations 0: a broken stream is an error event, as before, and usage counts what was sent."""
    p0, d0, ref = stubs(0, 0, 0)
    px = proxy([p0], [d0], "--health-interval", "60", "--max-migrations", "0")
    try:
        httpx.post(d0.url + "/stub/fail", json={"die_mid_stream": True})
        ev = events(px.url, "/v1/completions", BODY)
        assert ev[-1] == "[DONE]"
        assert ["failed mid-stream" in e["error"]["message"] for e in ev[:-1] if "error" in e] == [True]
        usage = [e for e in ev[:-1] if e.get("usage")][-1]["usage"]
        sent = sum(len(ch.get("token_ids") or []) for e in ev[:-1] if e.get("choices") for ch in e["choices"])
        assert usage["completion_tokens"] == sent >= 1  # what the client got, not the decoder's count
    finally:
        for p in (px, p0, d0, ref):
            p.stop()


def test_a_chat_stream_whose_decoder_dies_migrates_as_a_completion_of_what_was_sent() -> None:
    """Streamed chat: the continuation is a completion of the conversation's token ids plus the
    tokens sent, written back as chat chunks; content, token ids and usage as one engine's."""
    p0, d0, d1, ref = stubs(0, 0, 0, 0)
    px = proxy([p0], [d0, d1], "--policy", "round_robin", "--health-interval", "60")
    try:
        chat = {"model": "stub", "messages": [{"role": "user", "content": "move this chat"}], "max_tokens": 8,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        want = post(ref.url, "/v1/chat/completions", dict(chat, stream=False)).json()
        httpx.post(d0.url + "/stub/fail", json={"die_mid_stream": True})
        for _ in range(2):  # round robin: one of these starts on d0, which dies after one token
            ev = events(px.url, "/v1/chat/completions", chat)
            assert ev[-1] == "[DONE]" and not any("error" in c for c in ev[:-1]), ev
            chunks = ev[:-1]
            assert len({c["id"] for c in chunks}) == 1
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
            assert text == want["choices"][0]["message"]["content"]
            assert ids == want["choices"][0]["token_ids"]
            assert chunks[-1]["usage"] == want["usage"]
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        moved = [q for q in log(d1)["requests"] if "prompt" in q]
        assert moved and moved[-1]["max_tokens"] < 8
        # Without return_token_ids the client gets vLLM's nulls, never the ids the proxy asked for.
        ev = events(px.url, "/v1/chat/completions", dict(chat, return_token_ids=False))
        assert all(c["choices"][0].get("token_ids") is None for c in ev[:-1] if c["choices"]), ev
        assert all(c.get("prompt_token_ids") is None for c in ev[:-1])
    finally:
        for p in (px, p0, d0, d1, ref):
            p.stop()


def test_a_sampled_chat_stream_whose_decoder_fails_before_its_first_chunk_runs_whole_elsewhere() -> None:
    """Sampled without a seed, the client gets the decoder's own first token: a decode leg that
    fails before it sent anything runs again, whole and without the transfer, on another decoder,
    and can still move later (it asks for token ids)."""
    p0, d0, d1 = stubs(0, 0, 0)
    px = proxy([p0], [d0, d1], "--policy", "round_robin", "--health-interval", "60")
    chat = {"model": "stub", "messages": [{"role": "user", "content": "sample this chat"}], "max_tokens": 6,
            "temperature": 0.8, "stream": True}
    httpx.post(d0.url + "/stub/fail", json={"status": 500, "count": 1})
    for _ in range(2):  # round robin: one of these starts on d0
        ev = events(px.url, "/v1/chat/completions", chat)
        assert ev[-1] == "[DONE]" and not any("error" in c for c in ev[:-1]), ev
        assert len({c["id"] for c in ev[:-1]}) == 1
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in ev[:-1] if c["choices"])
    moved = [q for q in log(d1)["requests"] if "kv_transfer_params" not in q]
    assert len(moved) == 1 and moved[0]["messages"] == chat["messages"] and moved[0]["return_token_ids"] is True
    assert 'kvferry_proxy_migrations_total{reason="upstream_5xx"} 1.0' in httpx.get(px.url + "/metrics").text
