"""Cache-aware routing on a real `kvferry up` cluster (2 prefillers, 1 decoder, vLLM CPU, KV events
on): a shared prefix goes back to the prefiller that holds it and only the new tokens are
computed (vLLM's own counters prove it); a prefiller that dropped its cache is not chosen for
it; a short prompt is served by the decoder alone, with plain vLLM's greedy tokens."""

from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.pd_helpers import source_tokens
from tests.polling import until

pytestmark = pytest.mark.vllm

BLOCK = 128  # vLLM-CPU's block size for the tiny model


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["river", "stone", "lamp", "orange", "quiet", "seven", "north", "paper", "glass",
                                "winter", "market", "silver", "garden", "engine", "cloud"]) for _ in range(n))


@pytest.fixture(scope="module")
def cluster(kvferry_up) -> dict:
    # VLLM_SERVER_DEV_MODE: vLLM's /reset_prefix_cache, to drop a prefiller's cache
    return kvferry_up("routing", "--num-prefillers", "2", "--num-decoders", "1", "--local-prefill-tokens", "16",
                      env={"VLLM_SERVER_DEV_MODE": "1"}).state


def role(state: dict, r: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(**i) for i in state["instances"] if i["role"] == r]


def proxy_counters(state: dict, name: str) -> dict[str, float]:
    """The proxy's counter `name` by its one label's value."""
    out: dict[str, float] = {}
    for line in httpx.get(state["proxy"]["url"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            out[line.split('"', 2)[1]] = float(line.rsplit(" ", 1)[1])
    return out


def ask(state: dict, prompt: str, max_tokens: int = 4, stream: bool = False) -> dict:
    r = httpx.post(state["proxy"]["url"] + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def blocks_held(state: dict, url: str) -> int:
    for inst in httpx.get(state["proxy"]["url"] + "/health", timeout=10).json()["instances"]:
        if inst["url"] == url:
            assert inst["kv_events"]["fresh"], inst
            return inst["kv_events"]["blocks"]
    raise AssertionError(f"{url} not in /health")


def computed(servers: list[SimpleNamespace]) -> dict[str, dict[str, float]]:
    return {s.url: source_tokens(s) for s in servers}


def delta(after: dict, before: dict, url: str, source: str) -> float:
    return after[url].get(source, 0) - before[url].get(source, 0)


def test_a_shared_prefix_goes_where_it_was_computed_then_not_after_that_cache_is_dropped(cluster: dict) -> None:
    prefillers = role(cluster, "prefiller")
    doc = words(1, 500)
    q = [" Question: " + words(10 + i, 60) for i in range(3)]
    before = computed(prefillers)
    ask(cluster, doc + q[0])
    mid = computed(prefillers)
    p = max(prefillers, key=lambda s: delta(mid, before, s.url, "local_compute"))
    other = next(s for s in prefillers if s is not p)
    until(lambda: blocks_held(cluster, p.url) > 0, 30, "the prefiller's BlockStored events")
    routes0 = proxy_counters(cluster, "kvferry_proxy_routing_decisions_total")

    ask(cluster, doc + q[1])
    after = computed(prefillers)
    routes1 = proxy_counters(cluster, "kvferry_proxy_routing_decisions_total")
    assert routes1.get("cache_hit", 0) == routes0.get("cache_hit", 0) + 1, routes1
    hit, fresh = delta(after, mid, p.url, "local_cache_hit"), delta(after, mid, p.url, "local_compute")
    assert hit >= 3 * BLOCK, (hit, fresh)  # the document came from its prefix cache ...
    assert fresh < BLOCK + 150, (hit, fresh)  # ... and it computed about the new question only
    assert delta(after, mid, other.url, "local_compute") == 0  # the other prefiller saw nothing
    predicted = proxy_counters(cluster, "kvferry_proxy_predicted_cached_tokens_total")
    actual = proxy_counters(cluster, "kvferry_proxy_actual_cached_tokens_total")
    assert sum(predicted.values()) == sum(actual.values()) > 0, (predicted, actual)

    # The prefiller drops its cache (vLLM publishes AllBlocksCleared): no longer routed there for it.
    assert httpx.post(p.url + "/reset_prefix_cache", timeout=30).status_code == 200
    # vLLM publishes its events at the end of an engine step: one short request lets it step.
    httpx.post(p.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=60)
    until(lambda: blocks_held(cluster, p.url) == 0, 30, "the prefiller's AllBlocksCleared event")
    ask(cluster, doc + q[2])
    routes2 = proxy_counters(cluster, "kvferry_proxy_routing_decisions_total")
    assert routes2.get("cache_hit", 0) == routes1.get("cache_hit", 0), routes2
    assert routes2.get("cache_miss", 0) == routes1.get("cache_miss", 0) + 1, routes2


@pytest.mark.parametrize("stream", [False, True])
def test_a_short_prompt_is_served_by_the_decoder_alone_with_plain_greedy_tokens(cluster: dict, stream: bool) -> None:
    prefillers, decoders = role(cluster, "prefiller"), role(cluster, "decoder")
    prompt = f"Hello there, tell me about {'streams' if stream else 'rivers'}"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    # A prefiller asked directly is a plain vLLM on this build (no kv_transfer_params: no transfer).
    plain = httpx.post(prefillers[0].url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    before = computed(prefillers + decoders)
    served0 = proxy_counters(cluster, "kvferry_proxy_served_total")
    if stream:
        text = ""
        with httpx.stream("POST", cluster["proxy"]["url"] + "/v1/completions", json=dict(body, stream=True),
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += "".join(c.get("text") or "" for c in json.loads(line[6:])["choices"])
    else:
        text = ask(cluster, prompt, 12)["choices"][0]["text"]
    assert text == plain
    after = computed(prefillers + decoders)
    served1 = proxy_counters(cluster, "kvferry_proxy_served_total")
    assert served1.get("local", 0) == served0.get("local", 0) + 1
    assert served1.get("disaggregated", 0) == served0.get("disaggregated", 0)
    for p in prefillers:  # no prefill leg
        assert after[p.url] == before[p.url]
    d = decoders[0].url
    assert delta(after, before, d, "external_kv_transfer") == 0  # no transfer
    assert delta(after, before, d, "local_compute") > 0


def test_health_shows_each_instances_event_stream(cluster: dict) -> None:
    insts = httpx.get(cluster["proxy"]["url"] + "/health", timeout=10).json()["instances"]
    assert len(insts) == 3
    for inst in insts:
        ev = inst["kv_events"]
        assert ev["fresh"] and ev["last_heard_s_ago"] is not None and "endpoint" not in ev, inst
        if inst["role"] == "decoder":  # free KV, read from vLLM's metrics by the health checks
            assert 0.0 <= inst["kv_cache_usage"] <= 1.0, inst


def test_the_index_memory_and_routing_show_on_metrics(cluster: dict) -> None:
    text = httpx.get(cluster["proxy"]["url"] + "/metrics", timeout=10).text
    for series in ("kvferry_proxy_routing_decisions_total", "kvferry_proxy_served_total",
                   "kvferry_proxy_kv_events_total", "kvferry_proxy_prefix_index_blocks"):
        assert series in text, series


def test_chat_prompts_are_predicted_from_the_chat_template(cluster: dict) -> None:
    """The proxy renders the model's chat template itself: a second question on a shared system
    prompt is a cache hit, and the cached tokens it predicted are what vLLM reports."""
    doc = words(7, 400)
    url = cluster["proxy"]["url"] + "/v1/chat/completions"

    def chat(q: str) -> None:
        r = httpx.post(url, timeout=120, json={"model": "tiny", "max_tokens": 3, "temperature": 0, "messages": [
            {"role": "system", "content": doc}, {"role": "user", "content": q + " " + words(20, 60)}]})
        assert r.status_code == 200, r.text

    def held() -> int:
        return sum(i["kv_events"]["blocks"] for i in httpx.get(cluster["proxy"]["url"] + "/health",
                                                                timeout=10).json()["instances"])
    before = held()
    chat("first question")
    until(lambda: held() > before, 30, "the first question's BlockStored events")
    time.sleep(1)  # a sleep (window): the decode leg's BlockStored events, if it sends any, come within this
    routes0 = proxy_counters(cluster, "kvferry_proxy_routing_decisions_total")
    p0 = sum(proxy_counters(cluster, "kvferry_proxy_predicted_cached_tokens_total").values())
    a0 = sum(proxy_counters(cluster, "kvferry_proxy_actual_cached_tokens_total").values())
    chat("second question")
    routes1 = proxy_counters(cluster, "kvferry_proxy_routing_decisions_total")
    assert routes1.get("cache_hit", 0) == routes0.get("cache_hit", 0) + 1, routes1
    p1 = sum(proxy_counters(cluster, "kvferry_proxy_predicted_cached_tokens_total").values())
    a1 = sum(proxy_counters(cluster, "kvferry_proxy_actual_cached_tokens_total").values())
    assert p1 - p0 == a1 - a0 >= 2 * BLOCK, (p1 - p0, a1 - a0)
