"""The official `openai` client gets the same answers through `kvferry up` (1 prefiller, 1
decoder, the proxy) as from one plain vLLM, for every request shape the proxy accepts; greedy, so
texts, finish reasons and usage must match exactly. The cluster runs `--first-token decoder`; a
second proxy with the launcher's arguments serves the default mode. The module's last test stops
the cluster with SIGTERM: nothing may be left running."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from kvferry.common.netutil import free_port, port_is_free
from tests.pd_helpers import BATCH_NOISE, source_tokens
from tests.polling import alive, until
from tests.stub_procs import Proc
from tests.up_cluster import assert_the_cluster_has_a_secret_nobody_else_sees, tree

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.vllm

PROMPT = "The history of the old kingdom by the sea begins"
CHAT = [{"role": "user", "content": "Tell me about the old kingdom by the sea."}]


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def up(kvferry_up) -> SimpleNamespace:
    """One 1P1D `kvferry up --first-token decoder` cluster for the whole module (its last test
    stops it): the launcher's process, its cluster.json, and its folder."""
    return kvferry_up("parity", "--num-prefillers", "1", "--num-decoders", "1", "--first-token", "decoder")


@pytest.fixture(scope="module")
def cluster(up: SimpleNamespace) -> dict:
    return up.state


def _proxy_args(cluster: dict) -> list[str]:
    """The arguments `kvferry up` started its proxy with (after the interpreter)."""
    with open(f"/proc/{cluster['proxy']['pid']}/cmdline", "rb") as f:
        return f.read().rstrip(b"\0").decode().split("\0")[1:]


@pytest.fixture(scope="module")
def default_proxy(cluster: dict) -> Iterator[str]:
    """A second proxy with the launcher's own arguments but the default --first-token prefiller: its URL."""
    args, port = _proxy_args(cluster), free_port()
    args[args.index("--port") + 1] = str(port)
    args[args.index("--first-token") + 1] = "prefiller"
    px = Proc(args, f"http://127.0.0.1:{port}", "/metrics")
    try:
        yield px.url
    finally:
        px.stop()


@pytest.fixture(scope="module")
def clients(default_proxy: str, plain_vllm) -> tuple:
    """(through the proxy, plain vLLM)."""
    return _client(default_proxy), _client(plain_vllm.url)


@pytest.fixture(scope="module")
def decoder_first(cluster: dict) -> tuple[str, str]:
    """`kvferry up`'s own proxy, with --first-token decoder: (its URL, the decoder's)."""
    return cluster["proxy"]["url"], next(i["url"] for i in cluster["instances"] if i["role"] == "decoder")


def _completion(client, stream: bool, **kw) -> dict:
    """A completion as plain data; a stream is folded into the non-streamed shape (texts and
    logprobs joined per choice, the final usage), with the chunks' ids and [DONE] checked."""
    kw = {"model": "tiny", "prompt": PROMPT, "temperature": 0, **kw}
    if not stream:
        out = client.completions.create(**kw).model_dump()
        return {"choices": [_choice(c) for c in out["choices"]], "usage": _usage(out["usage"])}

    def add(d: dict, ch) -> None:
        d["text"] += ch.text
        if ch.logprobs is not None:
            lp = d["logprobs"] = d["logprobs"] or {"tokens": [], "text_offset": []}
            lp["tokens"] += ch.logprobs.tokens
            lp["text_offset"] += ch.logprobs.text_offset
    return _fold(client.completions.create(stream=True, **kw), "text", add)


def _fold(chunks, text: str, add) -> dict:
    """Streamed chunks folded per choice: `add(d, choice)` joins a chunk's `text` field and
    logprobs into d; finish_reason and the final usage are taken here, and the ids checked."""
    chunks = list(chunks)
    assert len({c.id for c in chunks}) == 1
    by: dict[int, dict] = {}
    usage = None
    for c in chunks:
        if c.usage is not None:
            usage = _usage(c.usage.model_dump())
        for ch in c.choices:
            d = by.setdefault(ch.index, {"index": ch.index, text: "", "finish_reason": None, "logprobs": None})
            add(d, ch)
            d["finish_reason"] = ch.finish_reason or d["finish_reason"]
    return {"choices": [by[i] for i in sorted(by)], "usage": usage}


def _choice(c: dict) -> dict:
    lp = c.get("logprobs")
    return {"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
            "logprobs": None if lp is None else {"tokens": lp["tokens"], "text_offset": lp["text_offset"]}}


def _usage(u: dict | None) -> dict | None:
    return None if u is None else {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _chat(client, stream: bool, **kw) -> dict:
    kw = {"model": "tiny", "messages": CHAT, "temperature": 0, **kw}
    if not stream:
        out = client.chat.completions.create(**kw).model_dump()
        return {"choices": [{"index": c["index"], "content": c["message"]["content"],
                             "finish_reason": c["finish_reason"],
                             "logprobs": None if not c.get("logprobs") else
                             [t["token"] for t in c["logprobs"]["content"]]} for c in out["choices"]],
                "usage": _usage(out["usage"])}

    def add(d: dict, ch) -> None:
        d["content"] += ch.delta.content or ""
        if ch.logprobs is not None and ch.logprobs.content:
            d["logprobs"] = (d["logprobs"] or []) + [t.token for t in ch.logprobs.content]
    return _fold(client.chat.completions.create(stream=True, **kw), "content", add)


COMPLETIONS = {
    "max_tokens 16": (False, {"max_tokens": 16}),
    "max_tokens 1": (False, {"max_tokens": 1}),
    "no max_tokens": (False, {}),
    "stream, include_usage": (True, {"max_tokens": 16, "stream_options": {"include_usage": True}}),
    "stream, no usage": (True, {"max_tokens": 16}),
    "stream, max_tokens 1, include_usage": (True, {"max_tokens": 1, "stream_options": {"include_usage": True}}),
    "stream, max_tokens 1": (True, {"max_tokens": 1}),
    "echo": (False, {"max_tokens": 6, "echo": True}),
    "echo, max_tokens 1": (False, {"max_tokens": 1, "echo": True}),
    "echo, stream": (True, {"max_tokens": 6, "echo": True}),
    "echo, logprobs": (False, {"max_tokens": 6, "echo": True, "logprobs": 1}),
    "logprobs": (False, {"max_tokens": 8, "logprobs": 2}),
    "logprobs, stream": (True, {"max_tokens": 8, "logprobs": 2}),
    "token id prompt": (False, {"max_tokens": 8, "prompt": [791, 3925, 315, 279, 2362, 2613, 555, 279, 1581]}),
    "token id prompt, echo": (False, {"max_tokens": 4, "echo": True, "prompt": [791, 395, 315, 279, 2362]}),
    "batch of two": (False, {"max_tokens": 6, "prompt": [PROMPT, "Once upon a time"]}),
    "top_p, user, logit_bias": (False, {"max_tokens": 8, "top_p": 0.9, "user": "u1", "logit_bias": {"11": -100}}),
    "presence and frequency penalty": (False, {"max_tokens": 12, "presence_penalty": 0.5,
                                               "frequency_penalty": 0.5}),
    "seed": (False, {"max_tokens": 8, "seed": 3}),
    "return_token_ids, min_tokens (vLLM)": (False, {"max_tokens": 8, "extra_body": {"return_token_ids": True,
                                                                                     "min_tokens": 4}}),
}


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_completions_match_one_vllm(clients, name: str) -> None:
    proxy, plain = clients
    stream, kw = COMPLETIONS[name]
    assert _completion(proxy, stream, **kw) == _completion(plain, stream, **kw)


def test_a_stop_string_matches(clients) -> None:
    proxy, plain = clients
    text = _completion(plain, False, max_tokens=16)["choices"][0]["text"]
    stop_at = text[len(text) // 2:len(text) // 2 + 3]
    assert stop_at.strip(), text
    for stream in (False, True):
        want = _completion(plain, stream, max_tokens=16, stop=[stop_at])
        assert want["choices"][0]["finish_reason"] == "stop"
        assert _completion(proxy, stream, max_tokens=16, stop=[stop_at]) == want


CHATS = {
    "max_tokens 16": (False, {"max_tokens": 16}),
    "max_completion_tokens": (False, {"max_completion_tokens": 10}),
    "max_tokens 1": (False, {"max_tokens": 1}),
    "stream, include_usage": (True, {"max_tokens": 16, "stream_options": {"include_usage": True}}),
    "stream, no usage": (True, {"max_tokens": 16}),
    "stream, max_tokens 1, include_usage": (True, {"max_tokens": 1, "stream_options": {"include_usage": True}}),
    "logprobs": (False, {"max_tokens": 8, "logprobs": True, "top_logprobs": 2}),
    "stop": (False, {"max_tokens": 16, "stop": ["\n\n"]}),
    "seed, top_p, penalties": (False, {"max_tokens": 10, "seed": 5, "top_p": 0.9, "presence_penalty": 0.3,
                                       "frequency_penalty": 0.3}),
}


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_matches_one_vllm(clients, name: str) -> None:
    proxy, plain = clients
    stream, kw = CHATS[name]
    assert _chat(proxy, stream, **kw) == _chat(plain, stream, **kw)


def test_n_2(clients) -> None:
    """Greedy n=2 is vLLM's 400 on both; sampled n=2 gives two samples, indexed and counted as
    vLLM does (the samples themselves differ: a decode leg restarts the seeded generator)."""
    proxy, plain = clients
    for c in (proxy, plain):
        with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
            c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, temperature=0)
        with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
            c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, n=2, temperature=0)
    kw = {"max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 3, "extra_body": {"ignore_eos": True}}
    got, want = _completion(proxy, False, **kw), _completion(plain, False, **kw)
    assert [c["index"] for c in got["choices"]] == [c["index"] for c in want["choices"]] == [0, 1]
    assert got["usage"] == want["usage"] == {"prompt_tokens": want["usage"]["prompt_tokens"],
                                             "completion_tokens": 12, "total_tokens": want["usage"]["total_tokens"]}
    got, want = _chat(proxy, False, **kw), _chat(plain, False, **kw)
    assert [c["index"] for c in got["choices"]] == [0, 1] and got["usage"] == want["usage"]


def test_refusals_are_the_same_errors(clients) -> None:
    """A request vLLM refuses is refused through the proxy too, with vLLM's status."""
    proxy, plain = clients
    for kw in ({"max_tokens": -1}, {"max_tokens": 4, "stream_options": {"include_usage": True}}):
        codes = []
        for c in (proxy, plain):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model="tiny", prompt=PROMPT, **kw)
            codes.append(e.value.status_code)
        assert codes == [400, 400], kw


def test_models_list_the_same_model(clients) -> None:
    proxy, plain = clients
    assert [m.id for m in proxy.models.list()] == [m.id for m in plain.models.list()] == ["tiny"]



def _raw_chunks(client, path: str, body: dict) -> list[dict]:
    """A stream's chunks exactly as sent, less the id and creation time (each server's own)."""
    out = []
    with httpx.stream("POST", f"{client.base_url}{path}", json=dict(body, stream=True), timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        c = json.loads(ln[6:])
        assert c.pop("id") and c.pop("created")
        if c.get("usage"):  # kvferry up's engines report cached prompt tokens; the plain one does not
            c["usage"].pop("prompt_tokens_details", None)
        if "system_fingerprint" in c:  # a hash of each engine's own configuration
            c["system_fingerprint"] = "vllm"
        out.append(c)
    return out


CHAT_PARITY = {
    "logprobs, top_logprobs, return_token_ids, include_usage": {
        "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "stream_options": {"include_usage": True}},
    "return_token_ids": {"return_token_ids": True},
    "logprobs": {"logprobs": True},
    "plain": {},
}


def _same(got, want, tol: float, where: str = "") -> None:
    """`got` == `want` field for field; a float (in these chunks: logprobs) within `tol`."""
    if isinstance(want, float) and isinstance(got, float):
        assert abs(got - want) <= tol, f"{where}: {got} vs {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: {got} != {want}"
        for k in want:
            _same(got[k], want[k], tol, f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, tol, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _coalesced(chunks: list[dict]) -> list[dict]:
    """Chunks with choices that follow one another merged into one, as vLLM merges them itself:
    an API server that lags its engine sends the tokens made meanwhile in one chunk (v1's
    RequestOutputCollector adds a request's deltas until they are read), so where chunk
    boundaries fall after the first token is timing, on a plain vLLM as behind the proxy. A
    usage chunk (no choices) stays apart."""
    out: list[dict] = []
    for c in chunks:
        if out and c.get("choices") and out[-1].get("choices"):
            out[-1] = _merge("", out[-1], c)
        else:
            out.append(c)
    return out


def _merge(key: str, a, b):
    """`b`, a later chunk's part, added to `a`: texts and lists joined, a choice by its index,
    anything else the later value (a finish_reason once the stream ends)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(k, a[k], b[k]) if k in a and k in b else b.get(k, a.get(k)) for k in {**a, **b}}
    if key == "choices":
        assert [c["index"] for c in a] == [c["index"] for c in b], (a, b)
        return [_merge("", x, y) for x, y in zip(a, b, strict=True)]
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if key in ("content", "text") and isinstance(a, str) and isinstance(b, str):
        return a + b
    return a if b is None else b


def _first_token(chunks: list[dict]) -> dict:
    """The first choice's first token: its token id and logprobs entries (chat's `content` list,
    a completion's lists), the rest of its chunk's fields less text, logprobs and token ids."""
    choice = dict(chunks[0]["choices"][0])
    lp, ids = choice.pop("logprobs", None), choice.pop("token_ids", None)
    choice.pop("text", None)
    choice.pop("delta", None)
    return {"chunk": {k: v for k, v in chunks[0].items() if k != "choices"}, "choice": choice,
            "logprobs": lp and {k: v[:1] for k, v in lp.items()}, "token_ids": ids and ids[:1]}


def _same_tokens(got: list[dict], want: list[dict], where: str) -> None:
    """Two streams' chunks from the first token on: the first token's id and logprobs exactly
    (the prefiller's, through the proxy), all the chunks coalesced field for field, later
    logprobs within LATER_LOGPROB_TOL."""
    g, w = _coalesced(got), _coalesced(want)
    _same(g, w, LATER_LOGPROB_TOL, f"{where} chunks")
    assert _first_token(g) == _first_token(w), where


# The decoder's tokens after the first are computed on KV from another instance, whose prompt may
# have been computed in other batch shapes (prefix-cache hits of earlier tests): vLLM CPU's bf16
# KV then differs in its last bits and a logprob by a bf16 step or two (pd_helpers.BATCH_NOISE).
# Bit-exact KV is test_connector's (a cold prompt, exact logprobs); this test is about the fields.
LATER_LOGPROB_TOL = BATCH_NOISE


@pytest.mark.parametrize("name", list(CHAT_PARITY))
def test_chat_parity_streamed_first_token_field_for_field(clients, name: str) -> None:
    """Streamed chat through the proxy (the prefiller's first token at once, with its logprobs
    and token id) is plain vLLM's stream field for field: the role chunk and the first token
    exactly, later tokens' logprobs within LATER_LOGPROB_TOL (chunk boundaries after the role
    chunk are vLLM's timing: _coalesced)."""
    proxy, plain = clients
    body = {"model": "tiny", "messages": CHAT, "temperature": 0, "max_tokens": 6, **CHAT_PARITY[name]}
    got, want = _raw_chunks(proxy, "chat/completions", body), _raw_chunks(plain, "chat/completions", body)
    assert got[:1] == want[:1], (got[:1], want[:1])  # the role chunk
    _same_tokens(got[1:], want[1:], name)


def test_completion_parity_streamed_token_ids_and_logprobs_field_for_field(clients) -> None:
    proxy, plain = clients
    for extra in ({"return_token_ids": True, "logprobs": 1, "stream_options": {"include_usage": True}},
                  {"logprobs": 2, "stream_options": {"include_usage": True}}):
        body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 6, **extra}
        got, want = _raw_chunks(proxy, "completions", body), _raw_chunks(plain, "completions", body)
        _same_tokens(got, want, str(extra))


# --first-token decoder: the decoder computes every token (its prompt's KV but the last token's
# sent from the prefiller), so the answers are plain vLLM's from the first token on.
DECODER_FIRST = ["max_tokens 16", "stream, include_usage", "echo, stream", "logprobs, stream",
                 "return_token_ids, min_tokens (vLLM)"]


@pytest.mark.parametrize("name", DECODER_FIRST)
def test_decoder_first_completions_match_one_vllm(decoder_first, clients, name: str) -> None:
    url, _ = decoder_first
    stream, kw = COMPLETIONS[name]
    assert _completion(_client(url), stream, **kw) == _completion(clients[1], stream, **kw)


@pytest.mark.parametrize("name", ["max_tokens 16", "stream, include_usage", "logprobs"])
def test_decoder_first_chat_matches_one_vllm(decoder_first, clients, name: str) -> None:
    url, _ = decoder_first
    stream, kw = CHATS[name]
    assert _chat(_client(url), stream, **kw) == _chat(clients[1], stream, **kw)


def test_decoder_first_decoder_loads_the_prompts_kv_and_computes_one_token(decoder_first, clients) -> None:
    """The KV crossed: a prompt new to the decoder is all loaded from the prefiller but its last
    token, which the decoder computes to make the first token itself."""
    url, decoder_url = decoder_first

    def sources() -> dict[str, float]:
        return source_tokens(SimpleNamespace(url=decoder_url))

    prompt = "A ledger of the first token, kept by the decoder alone, says"
    before = sources()
    got = _completion(_client(url), True, prompt=prompt, max_tokens=8, stream_options={"include_usage": True})
    after = sources()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    n = got["usage"]["prompt_tokens"]
    assert delta.get("external_kv_transfer", 0) == n - 1 and delta.get("local_compute", 0) == 1, (n, delta)
    assert got == _completion(clients[1], True, prompt=prompt, max_tokens=8, stream_options={"include_usage": True})


def test_kvferry_up_passes_its_flags_keeps_its_secret_and_sigterm_leaves_nothing(up: SimpleNamespace) -> None:
    """Last in the module: it stops the cluster the tests above shared."""
    state, proc = up.state, up.proc
    assert "--first-token decoder" in " ".join(_proxy_args(state))
    out = (up.tmp / "up.out").read_text()
    url = state["proxy"]["url"]
    assert url in out and "curl -s" in out and all(i["log"] in out for i in state["instances"])
    assert httpx.get(url + "/health").status_code == 200
    pids = tree(proc.pid)
    assert len(pids) >= 5  # launcher, proxy, and two vLLM servers with their engine processes
    assert_the_cluster_has_a_secret_nobody_else_sees(up.tmp, state)
    # kvferry up's stop is bounded (STOP_SECONDS, 15 s, then it kills what is left); one that hung
    # would never end. The bound sits far from both.
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    took = time.monotonic() - t0
    assert took < 60, f"stopping took {took:.1f}s"
    assert proc.returncode == 0
    until(lambda: not any(alive(p) for p in pids), 5, "every process of kvferry up to end", every=0.2)
    ports = [state["proxy"]["port"]] + [i["port"] for i in state["instances"]] + \
        [i[k] for i in state["instances"] if i["role"] == "decoder" for k in ("init_port", "alloc_port")]
    busy = [p for p in ports if not port_is_free(p)]
    assert not busy, f"ports still in use: {busy}"
