"""--first-token decoder: the decoder computes every token of the answer (as vLLM's own PD routers
do), neither leg asks for token ids, and the answers are those of one engine. With stub engines
(the proxy's logic); tests/e2e/test_openai_parity.py runs it on real vLLM with the KV sent."""

from __future__ import annotations

import httpx
import pytest

from kvferry.proxy.instance_flags import OptionError
from kvferry.proxy.options import parse
from tests.stub_procs import events, log, post, proxy, stubs

PROMPT = "the decoder computes the answer"
CHAT = [{"role": "user", "content": PROMPT}]


def _text(ev: list) -> str:
    assert ev[-1] == "[DONE]" and not any("error" in c for c in ev[:-1]), ev
    return "".join(c["choices"][0].get("text") or (c["choices"][0].get("delta") or {}).get("content") or ""
                   for c in ev[:-1] if c["choices"])


def test_first_token_must_be_prefiller_or_decoder() -> None:
    base = ["--prefiller", "http://127.0.0.1:8100", "--decoder", "http://127.0.0.1:8200,8300,8301"]
    assert parse(base).first_token == "prefiller"
    assert parse([*base, "--first-token", "decoder"]).first_token == "decoder"
    with pytest.raises(SystemExit):  # argparse names the choices
        parse([*base, "--first-token", "sideways"])


def test_first_token_from_a_config_file_is_checked(tmp_path) -> None:
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text("first_token: sideways\nprefiller: [http://127.0.0.1:8100]\n"
                   "decoder: ['http://127.0.0.1:8200,8300,8301']\n")
    with pytest.raises(OptionError, match="--first-token: 'sideways' is not one of prefiller, decoder"):
        parse(["--config", str(cfg)])


def test_decoder_first_legs_carry_no_token_ids_and_answers_are_one_engines() -> None:
    ref, p0, d0 = stubs(0, 0, 0)
    px = proxy([p0], [d0], "--first-token", "decoder")
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": 9, "temperature": 0}
    chat = {"model": "stub", "messages": CHAT, "max_tokens": 7, "temperature": 0}
    want = post(ref.url, "/v1/completions", body).json()
    want_chat = post(ref.url, "/v1/chat/completions", chat).json()
    got = post(px.url, "/v1/completions", body).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]
    assert "token_ids" not in got["choices"][0] and "prompt_token_ids" not in got["choices"][0]
    ev = events(px.url, "/v1/completions", dict(body, stream=True, stream_options={"include_usage": True}))
    assert _text(ev) == want["choices"][0]["text"] and ev[-2]["usage"] == want["usage"]
    assert len({c["id"] for c in ev[:-1]}) == 1
    got_chat = post(px.url, "/v1/chat/completions", chat).json()
    assert got_chat["choices"][0]["message"] == want_chat["choices"][0]["message"]
    ev = events(px.url, "/v1/chat/completions", dict(chat, stream=True))
    assert _text(ev) == want_chat["choices"][0]["message"]["content"]
    # A client that asks for token ids gets them: the decoder's, for its whole answer.
    ids = post(px.url, "/v1/completions", dict(body, return_token_ids=True)).json()["choices"][0]
    want_ids = post(ref.url, "/v1/completions", dict(body, return_token_ids=True)).json()["choices"][0]
    assert (ids["token_ids"], ids["prompt_token_ids"]) == (want_ids["token_ids"], want_ids["prompt_token_ids"])

    prefill, decode = log(p0)["requests"], log(d0)["requests"]
    assert len(prefill) == len(decode) == 5
    # No leg asks for token ids the client did not ask for: the prefill legs, one token each ...
    assert [q.get("return_token_ids") for q in prefill] == [None] * 4 + [True]
    assert all((q.get("max_tokens") == 1) and q["kv_transfer_params"]["transfer_id"].startswith("kvf-")
               for q in prefill)
    # ... the decode legs, the client's own request (its prompt, its max_tokens) with the KV's transfer id.
    assert [q.get("return_token_ids") for q in decode] == [None] * 4 + [True]
    assert [q.get("prompt") or q.get("messages") for q in decode] == [PROMPT, PROMPT, CHAT, CHAT, PROMPT]
    assert [q["max_tokens"] for q in decode] == [9, 9, 7, 7, 9]
    assert [q["kv_transfer_params"]["transfer_id"] for q in decode] == \
        [q["kv_transfer_params"]["transfer_id"] for q in prefill]
    # The decoder generated the whole answer, first token included.
    assert log(d0)["answers"][0] == want["choices"][0]["text"]
    assert "no_token_ids" not in httpx.get(px.url + "/metrics").text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_decoder_first_a_decoder_failing_before_its_first_token_is_replaced(path: str, stream: bool) -> None:
    """Nothing of the answer reached the client: the request runs whole on another decoder."""
    ref, p0, d0, d1 = stubs(0, 0, 0, 0)
    px = proxy([p0], [d0, d1], "--first-token", "decoder", "--policy", "round_robin")
    chat = path.endswith("chat/completions")
    body = {"model": "stub", "max_tokens": 6, "temperature": 0, "stream": stream,
            **({"messages": CHAT} if chat else {"prompt": PROMPT})}
    want = post(ref.url, path, dict(body, stream=False)).json()["choices"][0]
    want = want["message"]["content"] if chat else want["text"]
    httpx.post(d0.url + "/stub/fail", json={"status": 500, "count": 1})
    for _ in range(3):  # round robin: one of these tries d0 first
        if stream:
            assert _text(events(px.url, path, body)) == want
        else:
            r = post(px.url, path, body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert (c["message"]["content"] if chat else c["text"]) == want
    # The moved leg: the client's request without the transfer (d1 computes the prompt itself).
    moved = [q for q in log(d1)["requests"] if "kv_transfer_params" not in q]
    assert [(q.get("messages") or q.get("prompt"), q["max_tokens"]) for q in moved] == \
        [(CHAT if chat else PROMPT, 6)]
    assert 'kvferry_proxy_migrations_total{reason="upstream_5xx"} 1.0' in httpx.get(px.url + "/metrics").text


def test_decoder_first_a_decoder_dying_mid_stream_ends_the_stream_with_an_error() -> None:
    """Without token ids the proxy cannot continue an answer elsewhere: the client hears why.
    The decoders are told to die only once the client holds a token: a token and the error
    read together are nothing the client saw, and that stream may move (as a failure before the
    first token does)."""
    p0, d0, d1 = stubs(0, 0.05, 0.05)
    px = proxy([p0], [d0, d1], "--first-token", "decoder", "--policy", "round_robin")
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}

    def die_after_the_first(ev: list) -> None:
        if len(ev) == 1:
            assert ev[0]["choices"][0]["text"], ev
            for d in (d0, d1):
                httpx.post(d.url + "/stub/fail", json={"die_mid_stream": True})
    ev = events(px.url, "/v1/completions", body, die_after_the_first)
    assert ev[-1] == "[DONE]" and "error" in ev[-2], ev
    assert len(ev) < 40, ev  # the answer was cut short, not finished
    assert "kvferry_proxy_migrations_total{" not in httpx.get(px.url + "/metrics").text


def test_prefiller_first_is_the_default_and_asks_for_token_ids() -> None:
    """The contrast: by default both legs carry token ids and the decoder continues after the
    prefiller's token (max_tokens - 1, prompt ids + that token)."""
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0])
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": 9, "temperature": 0}
    assert post(px.url, "/v1/completions", body).status_code == 200
    (pq,), (dq,) = log(p0)["requests"], log(d0)["requests"]
    assert pq["return_token_ids"] is True and dq["max_tokens"] == 8 and isinstance(dq["prompt"], list)


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_a_penalty_on_output_tokens_makes_the_decoder_compute_the_first_token(penalty: str) -> None:
    """vLLM counts generated tokens only for these penalties: a decoder continuing from prompt +
    first token would not penalize the first one, so the decoder gets the client's own prompt
    and max_tokens and computes every token (as --first-token decoder does); the answer is the
    decoder's, once."""
    p0, d0 = stubs(0, 0)
    px = proxy([p0], [d0])
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": 9, "temperature": 0, penalty: 0.5}
    r = post(px.url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    (dq,) = log(d0)["requests"]
    assert dq["prompt"] == PROMPT and dq["max_tokens"] == 9 and dq[penalty] == 0.5, dq
    assert r.json()["usage"]["completion_tokens"] == 9
    events_ = events(px.url, "/v1/completions", dict(body, stream=True))
    assert len(_text(events_)) > 0
    assert log(d0)["requests"][-1]["prompt"] == PROMPT
