"""A minimal prefill-then-decode driver (the proxy's job, done by hand) and raw looks at a decoder's
receiver ports, for tests against real vLLM servers."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import zmq

from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.engine.pd.shared import KV_LAYOUT_NAMES
from kvferry.launcher.pd_instances import Decoder, Prefiller
from kvferry.launcher.vllm_proc import VLLMServer
from tests.polling import TimedOut, answers, until
from tests.transfer_helpers import abort_acked, next_answer


def completion(server: VLLMServer, prompt: list[int], max_tokens: int, client: httpx.Client | None = None,
               **extra) -> dict:
    body = {"model": server.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": 1, **extra}
    r = (client or httpx).post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_and_logprobs(resp: dict) -> tuple[list[int], list[float]]:
    choice = resp["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def plain(server: VLLMServer, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    return tokens_and_logprobs(completion(server, prompt, max_tokens))


# How far a batch moves a greedy logprob in bf16 on vLLM CPU: the logits are rounded to bf16, whose
# steps are 2^-5 to 2^-4 at this model's logit sizes (4 to 16), and a batch's other sums round a
# step or two differently. Measured on a 2-core AVX2 EPYC: plain vLLM, 16 cold prompts at once
# against each alone, 0.031 (and one greedy flip in 64 requests); through 2P2D, 0.061.
BATCH_NOISE = 0.1


def plain_with_margins(server: VLLMServer, prompt: list[int], max_tokens: int
                       ) -> tuple[list[int], list[float], list[float]]:
    """plain's tokens and logprobs, and per token its top-2 logprob margin (a near tie below BATCH_NOISE)."""
    resp = completion(server, prompt, max_tokens, logprobs=2)
    tops = [sorted(d.values(), reverse=True) for d in resp["choices"][0]["logprobs"]["top_logprobs"]]
    return (*tokens_and_logprobs(resp), [t[0] - t[1] if len(t) > 1 else 99.0 for t in tops])


def same_greedy_answer(got: tuple[list[int], list[float]], want: tuple[list[int], list[float], list[float]],
                       where: str) -> None:
    """`got` is plain_with_margins' answer up to batch noise: the same tokens up to a flip where plain's
    top two are a near tie (the rest then differs), the logprobs before it within BATCH_NOISE. Another
    request's KV or a wrong prompt changes tokens where the margin is large, logprobs by whole units."""
    toks, lps = got
    want_toks, want_lps, margins = want
    assert len(toks) == len(want_toks), f"{where}: {len(toks)} tokens, plain {len(want_toks)}"
    k = next((i for i, (a, b) in enumerate(zip(toks, want_toks, strict=True)) if a != b), len(toks))
    assert k == len(toks) or margins[k] < BATCH_NOISE, f"{where}: token {k} differs at a margin of {margins[k]}"
    diff = max((abs(a - b) for a, b in zip(lps[:k], want_lps[:k], strict=True)), default=0.0)
    assert diff <= BATCH_NOISE, f"{where}: logprobs differ by {diff}"


def same_answers(answers: list, tol: float = 1e-3) -> float:
    """Each ((tokens, logprobs), (plain tokens, plain logprobs)) pair: the same greedy tokens, logprobs
    within `tol` (float32 across TP sizes: the sums are rounded differently). Returns the largest
    logprob difference."""
    worst = 0.0
    for i, ((toks, lps), (want_toks, want_lps)) in enumerate(answers):
        assert toks == want_toks, f"prompt {i}: tokens differ: {toks} != {want_toks}"
        diff = max(abs(a - b) for a, b in zip(lps, want_lps, strict=True))
        assert diff < tol, f"prompt {i}: logprobs differ by {diff}"
        worst = max(worst, diff)
    return worst


def disagg(p: VLLMServer, d: Decoder, prompt: list[int], max_tokens: int, transfer_id: str | None = None,
           client: httpx.Client | None = None) -> tuple[list[int], list[float], dict]:
    """Prefill on `p` (max_tokens=1) with its KV sent to `d`, then decode the rest on `d`."""
    tid = transfer_id or uuid.uuid4().hex
    first = completion(p, prompt, 1, client, kv_transfer_params={
        "transfer_id": tid, "ret_first_tok": True, "disagg_spec": d.disagg_spec()})
    params = first.get("kv_transfer_params") or {}
    assert params.get("transfer_id") == tid, params
    toks, lps = tokens_and_logprobs(first)
    assert params["first_tok"] == toks[0]
    if max_tokens > 1:
        rest = completion(d, prompt + toks, max_tokens - 1, client, kv_transfer_params={"transfer_id": tid})
        t2, l2 = tokens_and_logprobs(rest)
        toks, lps = toks + t2, lps + l2
    return toks, lps, params


def source_tokens(server: VLLMServer) -> dict[str, float]:
    """vllm:prompt_tokens_by_source_total by source."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            src = line.split('source="', 1)[1].split('"', 1)[0]
            out[src] = float(line.rsplit(" ", 1)[1])
    return out


def prom(server: VLLMServer, name: str) -> dict[str, float]:
    """Every sample of metric `name` on the server's /metrics, keyed by its label text ('' without labels)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = line[len(name):].rsplit(" ", 1)[0]
            out[labels] = float(line.rsplit(" ", 1)[1])
    return out


def tier_value(server: VLLMServer, name: str, tier: str) -> float:
    """A kvferry:* sample for one tier (0 when absent)."""
    return sum(v for k, v in prom(server, name).items() if f'tier="{tier}"' in k)


def tiny_fingerprint(model_path: Path) -> m.LayoutFingerprint:
    """The tiny Llama's fingerprint on this machine's vLLM CPU (bf16, blocks of 128)."""
    import torch

    from kvferry.connector.cpu_isa import attention_isa
    from kvferry.kernels.layout import KVLayout
    c = json.loads((model_path / "config.json").read_text())
    heads, hd, layers = c["num_key_value_heads"], c["head_dim"], c["num_hidden_layers"]
    isa = attention_isa(KVLayout("cpu", 1, 128, heads, hd, torch.bfloat16), "auto")
    return m.LayoutFingerprint(model=model_path.name, dtype="bfloat16", num_layers=layers, num_kv_heads=heads,
                               head_size=hd, block_size=128, kv_layout=f"{KV_LAYOUT_NAMES['cpu']} isa={isa}",
                               chunk_format="block", chunk_size=256, tp_size=1,
                               page_bytes=layers * 256 * heads * hd * 2 * 2)


class RawPeer:
    """A bare ZMQ peer of a decoder's receiver: handshake, alloc and abort, no NIXL write."""

    def __init__(self, d: Decoder, fp: m.LayoutFingerprint, name: str = "raw-test-peer") -> None:
        self.d, self.fp, self.name = d, fp, name
        self.ctx = zmq.Context()
        s = self._sock(d.init_port)
        s.send(m.encode(m.Hello(peer_id=name, agent_name=name, agent_metadata=b"-", fingerprint=fp)))
        assert s.poll(10000), "no handshake reply"
        reply = m.decode(s.recv(), expect=(m.Welcome, m.ErrorReply))
        s.close()
        assert isinstance(reply, m.Welcome), reply
        self.epoch, self.num_pages = reply.epoch, reply.region.num_pages
        self.alloc_sock = self._sock(d.alloc_port)

    def _sock(self, port: int) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{self.d.host}:{port}")
        return s

    def alloc(self, tid: str, chunks: int, timeout: float = 30) -> m.Msg:
        """The receiver's answer. An AbortTransfer of another transfer that comes first (the receiver
        telling the writer that someone else dropped it: a decoder request that ended) is read past
        and not answered, as by a prefiller that died: its pages wait for the lease."""
        keys = [uuid.uuid4().bytes for _ in range(chunks)]
        self.alloc_sock.send(m.encode(m.AllocRequest(transfer_id=tid, sender_id=self.name, epoch=self.epoch,
                                                     chunk_keys=keys, num_tokens=chunks * 256)))
        deadline = time.monotonic() + timeout
        reply = next_answer(self.alloc_sock, int(timeout * 1000))
        while isinstance(reply, m.AbortTransfer) and reply.transfer_id != tid:
            reply = next_answer(self.alloc_sock, max(1, int((deadline - time.monotonic()) * 1000)))
        assert isinstance(reply, (m.AllocResponse, m.ErrorReply)), f"no alloc reply: {reply!r}"
        return reply

    def abort(self, tid: str, generation: int, final: bool = True) -> None:
        """`final`: this peer wrote nothing into the pages (it never does), so they are free at once;
        returns once the receiver acknowledged it."""
        abort_acked(self.alloc_sock, tid, generation, final=final)

    def fully_free(self, timeout: float = 20) -> bool:
        """True once an alloc of every page succeeds (it is handed back at once)."""
        def all_at_once() -> bool:
            tid = f"probe-{uuid.uuid4().hex}"
            reply = self.alloc(tid, self.num_pages)
            if isinstance(reply, m.AllocResponse):
                self.abort(tid, reply.generation)
                return True
            assert reply.code == "buffer_full", reply
            return False
        try:
            return until(all_at_once, timeout, every=0)
        except TimedOut:
            return False

    def close(self) -> None:
        self.ctx.destroy(linger=0)



def every_rank_free(d: Decoder, fp: m.LayoutFingerprint, name: str) -> None:
    """Every rank of a TP>1 decoder has all of its pd_buffer pages free (a raw handshake per rank asks)."""
    for rank in range(len(d.init_ports)):
        addr = SimpleNamespace(host=d.host, init_port=d.init_ports[rank], alloc_port=d.alloc_ports[rank])
        peer = RawPeer(addr, fp, name=f"{name}-{rank}")  # host and ports are all it reads of a Decoder
        try:
            assert peer.fully_free(), f"decoder rank {rank}: pd_buffer pages still held"
        finally:
            peer.close()

@contextlib.contextmanager
def running_proxy(prefillers: list[Prefiller], decoders: list[Decoder], proxy_port: int | None = None,
                  extra: tuple[str, ...] = ()) -> Iterator[str]:
    """kvferry's proxy (its own process) in front of these instances; yields its URL once healthy.
    `proxy_port`: its KV-arrived notification port (the decoders' pd_proxy_port); `extra`: more flags."""
    port = free_port()
    args = [sys.executable, "-m", "kvferry.proxy", "--port", str(port), *extra]
    if proxy_port:
        args += ["--proxy-host", "127.0.0.1", "--proxy-port", str(proxy_port)]
    for p in prefillers:
        args += ["--prefiller", p.url]
    for d in decoders:
        args += ["--decoder", f"{d.url},{d.init_port},{d.alloc_port}"]
    px = subprocess.Popen(args, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        until(answers(url + "/health", px), 30, "the proxy to be healthy", every=0.2)
        yield url
    finally:
        px.terminate()
        px.wait(10)


@contextlib.contextmanager
def serving(*servers: Any) -> Iterator[tuple[Any, ...]]:
    """Start every server at once, wait for each (10 minutes at most: TP=2 on 2 cores is slow),
    and stop them all when the block ends, however it ends."""
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_ready(timeout=600)
        yield servers
    finally:
        for s in servers:
            s.stop()
