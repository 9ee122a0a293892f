"""KVFerryConnector on real vLLM CPU servers: 1P1D and 2P2D, same tokens and logprobs as one plain
instance, the decoder computes one prompt token, and lost transfers end in bounded time."""

from __future__ import annotations

import concurrent.futures
import json
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kvferry.common.config import ConfigError
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.common.wire.transfer_params import (
    VERSION,
    DisaggSpec,
    ParamsError,
    PrefillAnswer,
    PrefillParams,
    answer,
    decode_leg_params,
    decode_params,
    prefill_answer,
    prefill_leg_params,
    prefill_params,
)
from kvferry.connector.roles import connector_config
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.vllm_proc import VLLMServer
from tests.pd_helpers import (
    RawPeer,
    completion,
    disagg,
    plain,
    plain_with_margins,
    prom,
    running_proxy,
    same_greedy_answer,
    source_tokens,
    tiny_fingerprint,
    tokens_and_logprobs,
)
from tests.polling import until

# Short bounds so the failure tests finish quickly; the defaults are in the README.
NOTE_PORT = free_port()  # the module proxy's --proxy-port: decoders push "KV arrived" there
DECODER_KEYS = {"pd_kv_ready_timeout": 6.0, "pd_lease_seconds": 15.0, "pd_alloc_timeout": 3.0,
                "pd_proxy_host": "127.0.0.1", "pd_proxy_port": NOTE_PORT}
VOCAB_LO, VOCAB_HI = 10, 4000
REPO = Path(__file__).resolve().parents[2]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


# ---- no vLLM server needed ----

def vllm_config(role: str | None, **extra) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=extra))


def test_kv_role_and_pd_role_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVFERRY_CONFIG_FILE", "LMCACHE_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    cfg, role = connector_config(vllm_config("kv_producer", enable_pd=True, pd_role="sender"))
    assert role == "kv_producer" and cfg.pd_role == "sender"
    with pytest.raises(ConfigError, match="pd_role: receiver"):
        connector_config(vllm_config("kv_consumer", enable_pd=True, pd_role="sender"))
    with pytest.raises(ConfigError, match="enable_pd: true"):
        connector_config(vllm_config("kv_producer"))
    with pytest.raises(ConfigError, match="kv_producer .* or kv_consumer"):
        connector_config(vllm_config("kv_decoder", enable_pd=True, pd_role="sender"))


def test_kv_both_needs_a_tier_and_no_pd(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVFERRY_CONFIG_FILE", "LMCACHE_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    cfg, role = connector_config(vllm_config("kv_both"))  # nothing else: the CPU tier's defaults
    assert role == "kv_both" and cfg.local_cpu and cfg.max_local_cpu_size == 5.0
    with pytest.raises(ConfigError, match="no tier"):
        connector_config(vllm_config("kv_both", local_cpu=False))
    with pytest.raises(ConfigError, match="enable_pd: false"):
        connector_config(vllm_config("kv_both", enable_pd=True, pd_role="sender"))
    with pytest.raises(ConfigError, match="kv_both"):
        connector_config(vllm_config("kv_everything"))


@pytest.mark.parametrize("name,role", [("kvferry-prefiller-config.yaml", "kv_producer"),
                                       ("kvferry-decoder-config.yaml", "kv_consumer")])
def test_example_configs_load_through_lmcache_env(monkeypatch: pytest.MonkeyPatch, name: str, role: str) -> None:
    monkeypatch.delenv("KVFERRY_CONFIG_FILE", raising=False)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(REPO / "examples" / "pd" / name))
    cfg, got = connector_config(vllm_config(role))
    assert got == role and cfg.enable_pd and cfg.transfer_channel == "nixl"


def test_transfer_params_parse_or_name_the_bad_field() -> None:
    spec = {"receiver_host": "d1", "receiver_init_port": [7300, 7301], "receiver_alloc_port": [7400, 7401]}
    p = prefill_params({"transfer_id": "t1", "ret_first_tok": True, "disagg_spec": spec})
    assert (p.tid, p.host, p.init_ports, p.alloc_ports, p.ret_first_tok) == \
        ("t1", "d1", (7300, 7301), (7400, 7401), True)
    # LMCache's proxy puts the id in disagg_spec.req_id, sends no version; a single port is one TP rank.
    p = prefill_params({"disagg_spec": {**spec, "req_id": "r9", "receiver_init_port": 7300,
                                        "receiver_alloc_port": 7400}})
    assert (p.tid, p.init_ports) == ("r9", (7300,))
    assert prefill_params(None) is None and prefill_params({"transfer_id": "x"}) is None
    assert decode_params({"transfer_id": "x"}).transfer_id == "x" and decode_params({}) is None
    # What the proxy writes is what the connector reads.
    d = DisaggSpec("d1", [7300], [7400])
    assert prefill_params(prefill_leg_params("t2", d)) == PrefillParams(d, "t2", True, VERSION)
    assert decode_params(decode_leg_params("t2")).transfer_id == "t2"
    assert prefill_answer(answer("t2", 9, 5)) == PrefillAnswer("t2", 9, 5, None, VERSION)
    for bad, field in [({"disagg_spec": spec}, "no transfer_id"),
                       ({"transfer_id": "t", "disagg_spec": {**spec, "receiver_host": ""}}, "receiver_host"),
                       ({"transfer_id": "t", "disagg_spec": {**spec, "receiver_init_port": [0]}}, "receiver_init_port"),
                       ({"transfer_id": "t", "disagg_spec": {**spec, "receiver_alloc_port": [7400]}}, "one port each"),
                       ({"transfer_id": 5, "disagg_spec": spec}, "kv_transfer_params.transfer_id"),
                       ({"transfer_id": "t", "disagg_spec": "d1:7300"}, "kv_transfer_params.disagg_spec"),
                       ({"transfer_id": "t" * 257, "disagg_spec": spec}, "transfer_id"),
                       ({"transfer_id": "t", "ret_first_tok": "yes", "disagg_spec": spec}, "ret_first_tok"),
                       ({"transfer_id": "t", "kvferry_version": 2, "disagg_spec": spec}, "version 2")]:
        with pytest.raises(ParamsError, match=field):
            prefill_params(bad)
    for bad, field in [({"transfer_id": ""}, "transfer_id"), ({"transfer_id": "x", "kvferry_version": 9}, "version 9")]:
        with pytest.raises(ParamsError, match=field):
            decode_params(bad)


# ---- real vLLM servers ----

@pytest.fixture(scope="module")
def pd(request: pytest.FixtureRequest, tiny_model_path: Path, log_dir: Path,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prefiller, Decoder, VLLMServer]]:
    """One prefiller on core 0, one decoder on core 1, and the plain server, loading together.

    Tests take the plain server from here, not as a fixture of their own: pytest would start a
    session fixture before this module one, and the three would load one after another."""
    tmp = tmp_path_factory.mktemp("pd")
    p = Prefiller(str(tiny_model_path), log_dir, "0", tmp)
    d = Decoder(str(tiny_model_path), log_dir, "1", tmp, **DECODER_KEYS)
    try:
        p.start()
        d.start()
        request.getfixturevalue("plain_vllm")
        p.wait_ready()
        d.wait_ready()
        yield p, d, request.getfixturevalue("plain_vllm")
    finally:
        p.stop()
        d.stop()


@pytest.fixture(scope="module")
def peer(pd, tiny_model_path: Path) -> Iterator[RawPeer]:
    r = RawPeer(pd[1], tiny_fingerprint(tiny_model_path))
    yield r
    r.close()


@pytest.mark.vllm
def test_1p1d_gives_the_same_tokens_and_logprobs_as_one_plain_instance(pd, peer) -> None:
    p, d, plain_vllm = pd
    # The decoder's very first request is a disaggregated one: on AMX CPUs that is the request
    # that dies of SIGILL unless the connector asked for AMX permission at start-up.
    assert sum(source_tokens(d).values()) == 0
    # 2,100 tokens: over vLLM CPU's 2,048-token step, so prefilled, and sent, in two pieces.
    for i, n in enumerate([5, 255, 256, 257, 1000, 2100]):
        pr = prompt(n, seed=n)
        want = plain(plain_vllm, pr, 8)
        toks, lps, params = disagg(p, d, pr, 8)
        assert toks == want[0], f"{n}-token prompt: tokens differ"
        assert lps == want[1], f"{n}-token prompt: logprobs differ"
        assert params["num_tokens"] == n
        if i == 0:
            assert d.proc.poll() is None, "the decoder died on its first (disaggregated) request"
    assert peer.fully_free(), "pd_buffer pages still held after all requests finished"


def pd_metrics(server: VLLMServer) -> dict[str, float]:
    """The PD path's kvferry:* series on `server`'s /metrics, each summed over its labels."""
    names = ["pd_sent_requests_total", "pd_sent_bytes_total", "pd_alloc_waits_total", "pd_alloc_wait_seconds_total",
             "pd_received_transfers_total", "pd_loaded_requests_total", "pd_received_bytes_total",
             "pd_arrival_waits_total", "pd_arrival_wait_seconds_total", "pd_send_failures_total",
             "pd_recomputed_requests_total", "pd_buffer_free_pages", "pd_buffer_pages", "pd_sent_early_requests_total",
             "pd_sent_pieces_total", "pd_transfers_in_flight"]
    return {n: sum(prom(server, f"kvferry:{n}").values()) for n in names}


@pytest.mark.vllm
def test_reserved_pages_show_on_the_decoders_metrics_at_once_between_engine_steps(pd, peer) -> None:
    # The decoder is idle: no engine step reports anything, yet a scrape sees the reservation.
    _, d, _ = pd
    total = sum(prom(d, "kvferry:pd_buffer_pages").values())
    until(lambda: sum(prom(d, "kvferry:pd_buffer_free_pages").values()) == total, 20, "an idle decoder")
    tid = f"live-{uuid.uuid4().hex}"
    reply = peer.alloc(tid, 3)
    assert isinstance(reply, m.AllocResponse), reply
    try:
        assert sum(prom(d, "kvferry:pd_buffer_free_pages").values()) == total - 3
        assert sum(prom(d, "kvferry:pd_transfers_in_flight").values()) == 1
    finally:
        peer.abort(tid, reply.generation)
    until(lambda: sum(prom(d, "kvferry:pd_buffer_free_pages").values()) == total, 60, "the pages back on /metrics")
    assert sum(prom(d, "kvferry:pd_transfers_in_flight").values()) == 0


@pytest.mark.vllm
def test_pd_metrics_count_one_transfer_on_both_sides(pd, peer, tiny_model_path: Path) -> None:
    p, d, _ = pd
    page_bytes = tiny_fingerprint(tiny_model_path).page_bytes
    # A send ends after the step that prefilled it: the prefiller's next step reports it.
    completion(p, prompt(5, seed=9002), 1)
    p0, d0 = pd_metrics(p), pd_metrics(d)
    pr = prompt(1000, seed=9001)  # 1000 tokens: 8 of 128-token blocks, 4 of 256-token chunks
    disagg(p, d, pr, 4)
    completion(p, prompt(5, seed=9003), 1)

    def moved(server: VLLMServer, before: dict[str, float], key: str) -> dict[str, float] | None:
        now = pd_metrics(server)
        return now if now[key] > before[key] and now["pd_buffer_free_pages"] == now["pd_buffer_pages"] > 0 else None

    p1 = until(lambda: moved(p, p0, "pd_sent_requests_total"), 30, "the prefiller's PD metrics")
    d1 = until(lambda: moved(d, d0, "pd_loaded_requests_total"), 30, "the decoder's PD metrics")
    dp = {k: p1[k] - p0[k] for k in p1}
    dd = {k: d1[k] - d0[k] for k in d1}
    assert dp["pd_sent_requests_total"] == 1 and dp["pd_sent_bytes_total"] == 4 * page_bytes, dp
    assert dp["pd_alloc_waits_total"] == 1 and dp["pd_alloc_wait_seconds_total"] > 0, dp
    assert dp["pd_send_failures_total"] == 0, dp
    # Its pages were reserved when it was first scheduled; one step computed it all (no pieces).
    assert dp["pd_sent_early_requests_total"] == 1 and dp["pd_sent_pieces_total"] == 0, dp
    assert dd["pd_received_transfers_total"] == 1 and dd["pd_loaded_requests_total"] == 1, dd
    assert dd["pd_received_bytes_total"] == 4 * page_bytes, dd
    assert dd["pd_arrival_waits_total"] == 1 and dd["pd_arrival_wait_seconds_total"] >= 0, dd
    assert dd["pd_recomputed_requests_total"] == 0, dd
    assert peer.fully_free()


def histograms(server: VLLMServer, names: list[str]) -> dict[str, float]:
    """Each kvferry:<name> histogram's _count, _sum and +Inf bucket on `server`, summed over its labels."""
    out = {}
    for n in names:
        for part in ("_count", "_sum"):
            out[n + part] = sum(prom(server, f"kvferry:{n}{part}").values())
        out[n + "_inf"] = sum(v for k, v in prom(server, f"kvferry:{n}_bucket").items() if 'le="+Inf"' in k)
    return out


@pytest.mark.vllm
def test_pd_transfer_histograms_count_every_transfer_on_both_sides(pd, peer) -> None:
    """Each transfer is one observation in the engines' histograms (not a sum): the prefiller's
    transfer time, bytes and alloc wait, the decoder's KV wait, load time and bytes; counts equal
    the transfers, byte sums the KV bytes the counters say were sent and loaded."""
    p, d, _ = pd
    sender = ["pd_transfer_seconds", "pd_transfer_bytes", "pd_alloc_latency_seconds"]
    loader = ["pd_kv_wait_seconds", "pd_load_seconds", "pd_load_bytes"]
    completion(p, prompt(5, seed=9102), 1)  # earlier sends reported (with the prefiller's next step)

    def now(server: VLLMServer, names: list[str]) -> dict[str, float]:
        return {**pd_metrics(server), **histograms(server, names)}
    p0, d0 = now(p, sender), now(d, loader)
    n = 4
    for i in range(n):
        disagg(p, d, prompt(200 + 150 * i, seed=9110 + i), 2)
    completion(p, prompt(5, seed=9103), 1)

    def moved(server: VLLMServer, names: list[str], before: dict[str, float]) -> dict[str, float] | None:
        after = now(server, names)
        delta = {k: after[k] - before[k] for k in after}
        return delta if all(delta[f"{x}_count"] == n for x in names) else None
    dp = until(lambda: moved(p, sender, p0), 30, "the prefiller's histograms to count the transfers")
    dd = until(lambda: moved(d, loader, d0), 30, "the decoder's histograms to count the loads")
    assert dp["pd_sent_requests_total"] == dp["pd_transfer_seconds_inf"] == n, dp
    assert dp["pd_transfer_bytes_sum"] == dp["pd_sent_bytes_total"] > 0, dp
    assert dp["pd_alloc_latency_seconds_count"] == dp["pd_alloc_waits_total"], dp
    assert dp["pd_alloc_latency_seconds_sum"] == pytest.approx(dp["pd_alloc_wait_seconds_total"]), dp
    assert 0 < dp["pd_transfer_seconds_sum"] < 30 * n, dp
    assert dd["pd_loaded_requests_total"] == dd["pd_load_seconds_inf"] == n, dd
    assert dd["pd_load_bytes_sum"] == dd["pd_received_bytes_total"] == dp["pd_sent_bytes_total"], (dd, dp)
    assert 0 < dd["pd_load_seconds_sum"] and 0 <= dd["pd_kv_wait_seconds_sum"] <= dd["pd_arrival_wait_seconds_total"]
    assert peer.fully_free()


@pytest.mark.vllm
def test_decoder_computes_only_the_last_prompt_token(pd, peer) -> None:
    p, d, plain_vllm = pd
    base = prompt(1000, seed=77)
    # The second prompt shares 384 tokens (3 blocks, inside chunk 1) with the first, which the
    # decoder's own prefix cache now holds: only the blocks after it are loaded.
    prompts = [base, base[:384] + prompt(300, seed=78), prompt(600, seed=79)]
    before = source_tokens(d)
    for pr in prompts:
        toks, lps, _ = disagg(p, d, pr, 4)
        assert (toks, lps) == plain(plain_vllm, pr, 4)
    after = source_tokens(d)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("local_compute", 0) == len(prompts), delta
    assert delta.get("external_kv_transfer", 0) + delta.get("local_cache_hit", 0) == sum(map(len, prompts)), delta
    assert delta.get("local_cache_hit", 0) == 384, delta
    assert peer.fully_free()


@pytest.mark.vllm
def test_decode_leg_may_repeat_the_whole_prompt(pd, peer) -> None:
    """A chat decode leg cannot append the first token; it sends the same prompt, loads all but
    its last token (aligned to a block boundary or not) and recomputes that one. The answer is
    plain vLLM's up to batch noise, not to the bit: on a CPU with AMX tiles vLLM's bf16 attention
    over cached KV rounds differently from one pass over the prompt (plain vLLM's own prefix cache
    moves a logprob of this prompt by 0.015 there), as any partial recompute does."""
    p, d, plain_vllm = pd
    for n in (129, 600):
        pr = prompt(n, seed=300 + n)
        want = plain_with_margins(plain_vllm, pr, 5)
        tid = uuid.uuid4().hex
        completion(p, pr, 1, kv_transfer_params={"transfer_id": tid, "disagg_spec": d.disagg_spec()})
        before = source_tokens(d)
        got = tokens_and_logprobs(completion(d, pr, 5, kv_transfer_params={"transfer_id": tid}))
        after = source_tokens(d)
        same_greedy_answer(got, want, f"{n} tokens")
        assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == n - 1
        assert after.get("local_compute", 0) - before.get("local_compute", 0) == 1
    assert peer.fully_free()


@pytest.fixture(scope="module")
def second_pair(pd, tiny_model_path: Path, log_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prefiller, Decoder]]:
    """A second prefiller (core 1) and decoder (core 0), started together once: the prefiller has a
    CPU tier and vLLM's own prefix cache off (a repeated prompt can only come from the tier); the
    2P2D test routes over both pairs."""
    tmp = tmp_path_factory.mktemp("pd2")
    p2 = Prefiller(str(tiny_model_path), log_dir, "1", tmp, local_cpu=True, max_local_cpu_size=0.5,
                   server={"extra_args": ["--no-enable-prefix-caching"]})
    d2 = Decoder(str(tiny_model_path), log_dir, "0", tmp, **DECODER_KEYS)
    try:  # a start that fails stops the one already started (stop() of one never started is a no-op)
        p2.start()
        d2.start()
        yield p2, d2
    finally:
        p2.stop()
        d2.stop()


@pytest.mark.vllm
def test_a_prefiller_with_a_cpu_tier_does_not_recompute_a_repeated_prompt(pd, peer, second_pair) -> None:
    _, d, plain_vllm = pd
    p2, _ = second_pair
    pr = prompt(1000, seed=400)
    want = plain(plain_vllm, pr, 6)
    p2.wait_ready()
    assert disagg(p2, d, pr, 6)[:2] == want
    before = source_tokens(p2)
    assert disagg(p2, d, pr, 6)[:2] == want  # the decoder still gets every chunk
    after = source_tokens(p2)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == 999
    assert after["local_compute"] - before["local_compute"] == 1
    assert peer.fully_free()


@pytest.mark.vllm
def test_kv_that_never_arrives_is_recomputed_within_the_timeout(pd, peer) -> None:
    _, d, plain_vllm = pd
    pr = prompt(400, seed=5)
    want = plain(plain_vllm, pr, 6)
    # A transfer id no prefiller will ever send: the decoder waits pd_kv_ready_timeout, then recomputes.
    got, waited = decode_timing_the_recompute(d, pr + want[0][:1], 5, f"never-{uuid.uuid4().hex}")
    assert got == want[0][1:]
    assert DECODER_KEYS["pd_kv_ready_timeout"] - 0.5 <= waited < DECODER_KEYS["pd_kv_ready_timeout"] + 5
    assert peer.fully_free()


@pytest.mark.vllm
def test_prefiller_gone_after_its_alloc_frees_pages_and_the_request_recomputes(pd, peer) -> None:
    _, d, plain_vllm = pd
    pr = prompt(700, seed=6)
    want = plain(plain_vllm, pr, 6)
    tid = f"doomed-{uuid.uuid4().hex}"
    reply = peer.alloc(tid, 3)  # what a prefiller does before its write; then it "dies"
    assert isinstance(reply, m.AllocResponse)
    got, waited = decode_timing_the_recompute(d, pr + want[0][:1], 5, tid)
    assert got == want[0][1:]
    # The request recomputes after pd_kv_ready_timeout, long before the reservation's lease ends;
    # the pages come back when it does.
    assert waited < DECODER_KEYS["pd_kv_ready_timeout"] + 5 < DECODER_KEYS["pd_lease_seconds"]
    assert peer.fully_free(timeout=DECODER_KEYS["pd_lease_seconds"] + 5)


def decode_timing_the_recompute(d: Decoder, pr: list[int], n: int, tid: str) -> tuple[list[int], float]:
    """A decode-only request whose KV never comes: (its tokens, seconds from sending it until the
    decoder gave up waiting, as the time of its log line says). Neither the recompute nor the
    metrics' way out is timed: the recompute counter reaches /metrics only with the outputs of the
    step that recomputes, seconds later on a loaded CPU."""
    before = pd_metrics(d)["pd_recomputed_requests_total"]
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        t0 = time.time()  # wall clock, as the log's timestamps
        fut = ex.submit(disagg_decode_only, d, pr, n, tid)
        until(lambda: pd_metrics(d)["pd_recomputed_requests_total"] > before or fut.done(), 60,
              "the decoder's recompute", every=0.1)
        assert pd_metrics(d)["pd_recomputed_requests_total"] == before + 1, fut.result()
        line = next((ln for ln in d.log_path.read_text(errors="replace").splitlines()
                     if f"transfer {tid} " in ln and "did not arrive within" in ln), None)
        assert line is not None, f"no timeout line for {tid} in {d.log_path}"
        logged = datetime.strptime(line[1:line.index("]")], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return fut.result(120), logged - t0


def disagg_decode_only(d: Decoder, pr: list[int], n: int, tid: str) -> list[int]:
    return completion(d, pr, n, kv_transfer_params={"transfer_id": tid})["choices"][0]["token_ids"]


@pytest.mark.vllm
def test_2p2d_sixteen_concurrent_requests(pd, peer, second_pair, tiny_model_path: Path) -> None:
    p1, d1, plain_vllm = pd
    p2, d2 = second_pair
    prompts = [prompt(60 + 12 * i, seed=50_000 + i) for i in range(16)]  # seeds no other test uses
    wants = [plain_with_margins(plain_vllm, pr, 6) for pr in prompts]
    p2.wait_ready()
    d2.wait_ready()
    before = [source_tokens(d).get("external_kv_transfer", 0) for d in (d1, d2)]
    # Through kvferry's proxy, which spreads them over the two prefillers and two decoders. One
    # worker: /health's `served` counts are each worker's own, so with two the one answering it
    # may have served few or none of these (seen: every count 0).
    with running_proxy([p1, p2], [d1, d2], extra=("--workers", "1")) as url, \
            httpx.Client(limits=httpx.Limits(max_connections=32)) as client, \
            concurrent.futures.ThreadPoolExecutor(16) as pool:
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "return_token_ids": True, "logprobs": 1}
        futs = [pool.submit(client.post, url + "/v1/completions", json=dict(body, prompt=pr), timeout=300)
                for pr in prompts]
        results = [tokens_and_logprobs(f.result(timeout=300).json()) for f in futs]
        served = {i["url"]: i["served"] for i in httpx.get(url + "/health").json()["instances"]}
    assert all(served[x.url] > 0 for x in (p1, p2, d1, d2)), served
    for i, (got, want) in enumerate(zip(results, wants, strict=True)):
        # Batched with others, vLLM's CPU kernels round differently than for one request alone
        # (a plain instance under the same load does too): equal up to that noise.
        same_greedy_answer(got, want, f"request {i}")
    loaded = sum(source_tokens(d).get("external_kv_transfer", 0) - b for d, b in zip((d1, d2), before, strict=True))
    assert loaded == sum(map(len, prompts)), "some prompts were recomputed instead of loaded"
    assert peer.fully_free()
    peer2 = RawPeer(d2, tiny_fingerprint(tiny_model_path))
    try:
        assert peer2.fully_free()
    finally:
        peer2.close()


@pytest.fixture(scope="module")
def pd_proxy(pd) -> Iterator[str]:
    """kvferry's proxy in front of the module's prefiller and decoder."""
    with running_proxy([pd[0]], [pd[1]], proxy_port=NOTE_PORT) as url:
        yield url


@pytest.mark.vllm
def test_through_the_proxy_completions_and_chat_equal_one_plain_instance(pd, pd_proxy, peer) -> None:
    _, _, plain_vllm = pd
    url = pd_proxy
    for n in (40, 700):
        body = {"model": "tiny", "prompt": prompt(n, seed=900 + n), "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}
        want = httpx.post(plain_vllm.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        got = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
        text = ""
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert text == want["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the river " * 20}],
            "max_tokens": 8, "temperature": 0}
    want = httpx.post(plain_vllm.url + "/v1/chat/completions", json=chat, timeout=120).json()
    got = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    content = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(chat, stream=True), timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    content += c["delta"].get("content") or ""
    assert content == want["choices"][0]["message"]["content"]
    assert peer.fully_free()


@pytest.mark.vllm
def test_transfer_wait_has_one_sample_per_transfer_through_the_proxy(pd, pd_proxy, peer) -> None:
    """The decoder's arrival notice usually beats the prefiller's answer (pages reserved early):
    every transfer still gets its kvferry_proxy_kv_transfer_wait_seconds sample."""
    for n in (30, 300, 600):
        body = {"model": "tiny", "prompt": prompt(n, seed=4000 + n), "max_tokens": 3, "temperature": 0}
        assert httpx.post(pd_proxy + "/v1/completions", json=body, timeout=120).status_code == 200

    def counts() -> tuple[float, float]:
        text = httpx.get(pd_proxy + "/metrics", timeout=10).text
        served = waits = 0.0
        for line in text.splitlines():
            if line.startswith('kvferry_proxy_served_total{mode="disaggregated"}'):
                served = float(line.split()[-1])
            elif line.startswith("kvferry_proxy_kv_transfer_wait_seconds_count"):
                waits = float(line.split()[-1])
        return served, waits
    until(lambda: (c := counts())[1] >= c[0], 60, "a wait sample for each transfer", every=0.1)
    served, waits = counts()
    assert served >= 3 and waits == served, f"{waits} wait samples for {served} transfers"
    assert peer.fully_free()


@pytest.mark.vllm
@pytest.mark.parametrize("backend,endpoint", [("openai", "/v1/completions"),
                                              ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_through_the_proxy(pd_proxy, tiny_model_path: Path, tmp_path: Path, backend: str,
                                            endpoint: str) -> None:
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "vllm_bench.py"), "serve", "--backend", backend,
                        "--base-url", pd_proxy, "--endpoint", endpoint, "--model", "tiny", "--tokenizer",
                        str(tiny_model_path), "--dataset-name", "random", "--random-input-len", "200",
                        "--random-output-len", "8", "--num-prompts", "8", "--max-concurrency", "4",
                        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["completed"] == 8 and res.get("failed", 0) == 0, res


@pytest.mark.parametrize("kind,p_tp,d_tp,want", [
    ("mla", 2, 1, {0: [0], 1: []}),  # one rank's copy of the latent travels
    ("mla", 1, 2, {0: [0, 1]}),  # the one prefiller rank feeds both decoder ranks
    ("mla", 2, 4, {0: [0, 2], 1: [1, 3]}),
    ("mha", 2, 2, {0: [0], 1: [1]}),
    # GQA (4 KV heads) with another TP size: each rank slices its heads (docs/pd.md, "Different TP")
    ("mha", 2, 1, {0: [(0, (2, 0))], 1: [(0, (2, 1))]}),  # both ranks write into decoder rank 0
    ("mha", 1, 2, {0: [(0, (1, 0)), (1, (1, 0))]}),  # the one rank feeds each decoder rank its heads
])
def test_hetero_tp_prefiller_ranks_address_these_decoder_ranks(kind: str, p_tp: int, d_tp: int,
                                                                want: dict[int, list]) -> None:
    from kvferry.connector.metadata import OpenOp
    from kvferry.connector.worker_side import WorkerSide

    op = OpenOp(req_id="r", transfer_id="t", host="d", init_ports=tuple(7300 + d for d in range(d_tp)),
                alloc_ports=tuple(7400 + d for d in range(d_tp)), token_ids=[1, 2], num_tokens=2)
    for rank in range(p_tp):
        w = object.__new__(WorkerSide)
        w.tp_rank, w.tp_size = rank, p_tp
        w.producer = SimpleNamespace(fp=SimpleNamespace(kv_kind=kind, tp_size=p_tp, total_kv_heads=4, slices=True))
        pairs = w._receivers(op)
        got = [a for a, _ in pairs]
        assert [(a.init_port - 7300, s.share) if s else a.init_port - 7300 for a, s in pairs] == want[rank], \
            (kind, p_tp, d_tp, rank)
        assert all(a.alloc_port - 7400 == a.init_port - 7300 and a.host == "d" for a in got)
