"""Traces on real vLLM: a `kvferry up` cluster (1 prefiller, 2 decoders) started with
--otlp-traces-endpoint (every vLLM with it, so the connector too), a second proxy in front of it with
tracing on and a short --stall-timeout, and kvferry.testing's OTLP receiver (gRPC, the real
protobuf). One request sent with a traceparent is one trace: the proxy's spans, both vLLMs'
`llm_request` spans and the connector's KV spans, each under the right parent, the transfer's
byte count equal to the prompt's KV bytes. A stream whose decoder freezes moves to the other
decoder, and both decode legs are in its trace.

KVFERRY_TEST_TRACE_DUMP=FILE writes the first test's trace there as JSON (benchmarks/trace_picture.py
draws docs/trace.svg from it)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.testing.otlp_receiver import OTLPReceiver, ReceivedSpan, dump
from tests.polling import until
from tests.up_cluster import second_proxy

pytestmark = pytest.mark.vllm

STALL_S = 3.0
CLIENT_SPAN = "b7ad6b7169203331"
PROXY = {"POST /v1/completions", "route", "prefill", "decode"}
KV_PREFILLER = {"kv.transfer", "kv.reserve", "kv.write"}
KV_DECODER = {"kv.arrival", "kv.load"}


@pytest.fixture(scope="module")
def cluster(kvferry_up) -> Iterator[dict]:
    rx = OTLPReceiver().start()
    try:
        up = kvferry_up("traces", "--num-prefillers", "1", "--num-decoders", "2",
                        "--otlp-traces-endpoint", rx.grpc_endpoint)
        tmp, state = up.tmp, up.state
        with second_proxy(tmp, state, "--stall-timeout", str(STALL_S), "--otlp-traces-endpoint",
                          rx.grpc_endpoint) as url:
            yield {"url": url, "rx": rx, "state": state, "log": tmp / "proxy.log"}
    finally:
        rx.stop()


def _spans(rx: OTLPReceiver, trace_id: str, want: dict[str, int], what: str) -> dict[str, list[ReceivedSpan]]:
    """The trace's spans by name once it holds at least `want[name]` of each (every process batches)."""
    def got() -> dict[str, list[ReceivedSpan]] | None:
        out: dict[str, list[ReceivedSpan]] = {}
        for s in rx.trace(trace_id):
            out.setdefault(s.name, []).append(s)
        return out if all(len(out.get(n, [])) >= k for n, k in want.items()) else None
    return until(got, 60, lambda: f"{what}: {sorted(want)}; got {[(s.name, s.service) for s in rx.trace(trace_id)]}",
                 every=0.2)


def _metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _kv_bytes_per_slot(model: Path) -> int:
    """One token's K and V in every layer of the tiny model (bf16)."""
    cfg = json.loads((model / "config.json").read_text())
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def _block_size(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=5).text
    line = next(li for li in text.splitlines() if li.startswith("vllm:cache_config_info{"))
    return int(line.split('block_size="')[1].split('"')[0])


def test_one_traced_request_is_one_trace_across_the_proxy_both_vllms_and_the_kv_transfer(
        cluster: dict, tiny_model_path: Path) -> None:
    rx, url = cluster["rx"], cluster["url"]
    prefiller = next(i for i in cluster["state"]["instances"] if i["role"] == "prefiller")
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "The history of the old kingdom by the sea begins with a storm", "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}, headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01",
                                                        "X-Request-Id": "trace-e2e-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-e2e-1", r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    spans = _spans(rx, trace_id, {**dict.fromkeys(PROXY | KV_PREFILLER | KV_DECODER, 1), "llm_request": 2},
                   "the proxy's, vLLM's and the connector's spans")
    if os.environ.get("KVFERRY_TEST_TRACE_DUMP"):
        dump(rx.trace(trace_id), os.environ["KVFERRY_TEST_TRACE_DUMP"])
    every = [s for v in spans.values() for s in v]
    assert len({s.span_id for s in every}) == len(every), "two spans of one trace share an id"
    one = {n: v[0] for n, v in spans.items()}
    req, prefill, decode = one["POST /v1/completions"], one["prefill"], one["decode"]
    assert req.parent_id == CLIENT_SPAN and req.attributes["kvferry.request_id"] == "trace-e2e-1"
    for s in (one["route"], prefill, decode):
        assert s.parent_id == req.span_id
    # vLLM's own request spans, each under its leg (vLLM read the leg's traceparent header).
    vllm = {s.parent_id: s for s in spans["llm_request"]}
    assert vllm.keys() == {prefill.span_id, decode.span_id}, [(s.service, s.parent_id) for s in spans["llm_request"]]
    assert vllm[prefill.span_id].service == "vllm-prefiller-0"
    assert vllm[decode.span_id].service.startswith("vllm-decoder-")
    assert "trace-e2e-1" in vllm[prefill.span_id].attributes["gen_ai.request.id"]  # X-Request-Id reached vLLM
    # The connector's, under the legs' traceparent from kv_transfer_params.
    transfer = one["kv.transfer"]
    assert transfer.parent_id == prefill.span_id and transfer.service == "kvferry-prefiller"
    assert transfer.attributes["kvferry.transfer_id"] == prefill.attributes["kvferry.transfer_id"]
    for s in (*spans["kv.reserve"], *spans["kv.write"]):
        assert s.parent_id == transfer.span_id and s.status != 2
    for n in KV_DECODER:
        assert one[n].parent_id == decode.span_id and one[n].service == "kvferry-decoder"
    for s in (transfer, one["kv.load"]):  # vLLM's request id, which holds the X-Request-Id
        assert "trace-e2e-1" in s.attributes["kvferry.vllm_request_id"]
    assert transfer.start_ns < one["kv.write"].end_ns <= transfer.end_ns <= one["kv.load"].end_ns
    # Its bytes: the prompt's KV in whole blocks (pd_chunk_format block), from the model's shape and vLLM's block size.
    bs = _block_size(prefiller["url"])
    want = -(-prompt_tokens // bs) * bs * _kv_bytes_per_slot(tiny_model_path)
    assert transfer.attributes["kvferry.kv.bytes"] == want
    assert transfer.attributes["kvferry.kv.tokens"] == prompt_tokens
    assert one["kv.load"].attributes["kvferry.kv.bytes"] == want  # the decoder copied the same KV into its cache


class _Stream(threading.Thread):
    def __init__(self, url: str, traceparent: str) -> None:
        super().__init__(daemon=True)
        self.url, self.traceparent = url, traceparent
        self.ids: list[int] = []
        self.lines: list[str] = []

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time in a quiet village there", "max_tokens": 160,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120,
                          headers={"traceparent": self.traceparent}) as r:
            for line in r.iter_lines():
                self.lines.append(line)
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices") or []:
                        self.ids += c.get("token_ids") or []


def _tail(log: Path, n: int = 30) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-n:] if log.exists() else []


def _running(url: str) -> float:
    return _metric(url, "vllm:num_requests_running")


def test_a_migrated_stream_shows_both_decode_legs_in_one_trace(cluster: dict) -> None:
    decoders = [i for i in cluster["state"]["instances"] if i["role"] == "decoder"]
    for attempt in range(3):  # a stream can end before its decoder is seen running it: another one then
        trace_id = f"{attempt + 1:02x}" * 16
        s = _Stream(cluster["url"], f"00-{trace_id}-{CLIENT_SPAN}-01")
        s.start()
        until(lambda s=s: len(s.ids) >= 4 or not s.is_alive(), 120, "4 tokens streamed", every=0.01)
        victim = next((d for d in decoders if _running(d["url"])), None)
        if victim is not None and s.is_alive():
            break
        s.join(120)
    else:
        raise AssertionError("3 streams ended before the decoder running one was seen")
    os.killpg(victim["pid"], signal.SIGSTOP)  # frozen: the proxy moves the stream after --stall-timeout
    try:
        s.join(120)
    finally:
        os.killpg(victim["pid"], signal.SIGCONT)
    errors = [line for line in s.lines if '"error"' in line]
    assert "data: [DONE]" in s.lines and not errors, (errors, s.lines[-3:], _tail(cluster["log"]))
    assert len(s.ids) == 160
    spans = _spans(cluster["rx"], trace_id, {"decode": 2, "migration": 1, "llm_request": 2},
                   "both decode legs, the migration and the vLLM spans")
    first, second = sorted(spans["decode"], key=lambda x: x.start_ns)
    mig, = spans["migration"]
    req, = spans["POST /v1/completions"]
    assert first.parent_id == second.parent_id == mig.parent_id == req.span_id
    assert first.attributes["server.address"] == victim["url"] and first.attributes["error.type"] == "stall"
    assert second.attributes["server.address"] != victim["url"] and second.status != 2
    assert mig.attributes["kvferry.migration.from"] == first.attributes["kvferry.instance"]
    assert mig.attributes["kvferry.migration.to"] == second.attributes["kvferry.instance"]
    assert first.end_ns <= second.start_ns
    # The decoder the stream moved to recorded its own request under the second leg.
    assert second.span_id in {x.parent_id for x in spans["llm_request"]}
