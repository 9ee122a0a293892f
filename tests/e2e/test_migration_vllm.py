"""Failures mid-request on real vLLM: a `kvferry up` cluster (1 prefiller, 2 decoders) behind a
proxy with a short --stall-timeout. A decoder SIGKILLed or SIGSTOPped with streams on it: the
streams finish on the other decoder with plain vLLM's greedy tokens, no error event, and usage
equal to the tokens the client received. Clients that leave, during the prefill or after the
first token, cost the decoders nothing past 2 s."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.pd_helpers import BATCH_NOISE
from tests.polling import until
from tests.up_cluster import second_proxy

pytestmark = pytest.mark.vllm

PROMPTS = ["The history of the old kingdom by the sea begins", "Once upon a time in a quiet village there"]
MAX_TOKENS = 96
STALL_S = 3.0


@pytest.fixture(scope="module")
def cluster(kvferry_up) -> Iterator[dict]:
    """kvferry up 1P2D, and a second proxy in front of it with --stall-timeout 3 s."""
    up = kvferry_up("migrate", "--num-prefillers", "1", "--num-decoders", "2",
                    f"--vllm-args=--max-num-batched-tokens {PREFILL_STEP}")
    tmp, state = up.tmp, up.state
    with second_proxy(tmp, state, "--stall-timeout", str(STALL_S)) as url:
        yield {"url": url, "state": state, "log": tmp / "proxy.log", "state_file": tmp / "logs" / "cluster.json",
               "decoders": [i for i in state["instances"] if i["role"] == "decoder"]}


def _body(prompt: str, chat: bool) -> dict:
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if chat:
        return dict(body, messages=[{"role": "user", "content": prompt}])
    return dict(body, prompt=prompt)


def _plain(plain_vllm, prompt: str, chat: bool = False) -> tuple[list[int], list[float]]:
    """Plain vLLM's greedy tokens and, per token, its top-2 logprob margin."""
    body = dict(_body(prompt, chat), **({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}))
    r = httpx.post(plain_vllm.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=300)
    c = r.json()["choices"][0]
    tops = ([[t["logprob"] for t in e["top_logprobs"]] for e in c["logprobs"]["content"]] if chat
            else [list(d.values()) for d in c["logprobs"]["top_logprobs"]])
    return c["token_ids"], [sorted(t)[-1] - sorted(t)[-2] if len(t) > 1 else 99.0 for t in tops]


# The moved request's continuation is computed from prompt + tokens sent in one prefill, the
# uninterrupted one token by token: vLLM CPU's bf16 numerics differ in the last bits (logprobs by
# a bf16 step or two: pd_helpers.BATCH_NOISE), which can flip a greedy near tie. A flip is accepted
# only where plain vLLM's own top-2 margin is below this; wrong KV or a wrong prompt differs where
# the margin is large.
NEAR_TIE = BATCH_NOISE


class Stream(threading.Thread):
    """One streamed completion read in the background: its token ids, chunks and errors."""

    def __init__(self, url: str, prompt: str, chat: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.chat = url, prompt, chat
        self.ids: list[int] = []
        self.chunks: list[dict] = []
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._read()
        except BaseException as e:  # shown by the test's assertion, not lost in a thread
            self.error = e

    def _read(self) -> None:
        body = dict(_body(self.prompt, self.chat), stream=True, stream_options={"include_usage": True})
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        with httpx.stream("POST", self.url + path, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    c = json.loads(line[6:])
                    self.chunks.append(c)
                    for ch in c.get("choices") or []:
                        self.ids += ch.get("token_ids") or []


def _healthy_decoders(url: str) -> int:
    return sum(1 for i in httpx.get(url + "/health", timeout=5).json()["instances"]
               if i["role"] == "decoder" and i["healthy"])


def _both_in_flight(cluster: dict) -> list[Stream]:
    """Two streams (round robin: one per decoder), each with 4 tokens out and neither finished.
    A stream lasts about a second here; one can finish before the other's prefill is done (it
    waits behind other work). Such a pair never reached the state the test needs: it runs to
    its end, and a new pair starts (at most 4 pairs)."""
    url = cluster["url"]
    for _ in range(4):
        streams = [Stream(url, PROMPTS[0]), Stream(url, PROMPTS[1], chat=True)]
        for s in streams:
            s.start()

        def stuck(streams: list[Stream] = streams) -> str:
            for s in streams:
                print("stream", s.chat, s.done, len(s.ids), repr(s.error), s.chunks[:3], s.chunks[-3:])
            print(_tail(cluster["log"]))
            return "4 tokens on each stream in 120 s"
        until(lambda streams=streams: all(len(s.ids) >= 4 for s in streams) or not all(s.is_alive() for s in streams),
              120, stuck, every=0.01)
        if all(s.is_alive() for s in streams):
            return streams
        for s in streams:  # one finished first: it must have finished well, and the other too
            s.join(120)
            assert s.done and s.error is None and not any("error" in c for c in s.chunks), (s.error, s.chunks[-3:])
    raise AssertionError("4 pairs of streams in a row: one finished before the other's 4th token")


def _run_and_break(cluster: dict, plain_vllm, sig: signal.Signals) -> list[Stream]:
    """Two streams in flight; then `sig` to the decoder that runs one of them."""
    url = cluster["url"]
    until(lambda: _healthy_decoders(url) >= 2, 60, "a decoder to come back", every=0.5)
    # The decoder running a stream (round robin puts one on each, unless earlier requests moved
    # its turn): a frozen or killed decoder with no stream would test nothing. A stream lasts about
    # a second: a pair may end between its 4th token and this look; then another pair.
    for _ in range(4):
        streams = _both_in_flight(cluster)
        d = next((d for d in cluster["decoders"] if _running(d["url"])), None)
        if d is not None:
            break
        for s in streams:
            s.join(120)
            assert s.done and s.error is None and not any("error" in c for c in s.chunks), (s.error, s.chunks[-3:])
    else:
        raise AssertionError("4 pairs of streams in a row ended before a decoder running one was seen")
    cluster["victim"] = d["url"]
    victim = d["pid"]
    os.killpg(victim, sig)
    try:
        for s in streams:
            s.join(120)
    finally:
        if sig == signal.SIGSTOP:
            os.killpg(victim, signal.SIGCONT)
    return streams


def _tail(log: Path, n: int = 4000) -> str:
    return Path(log).read_text(errors="replace")[-n:]


def _running(url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _check(streams: list[Stream], plain_vllm) -> None:
    for s in streams:
        assert s.done and not any("error" in c for c in s.chunks), (s.error, s.chunks[-3:])
        want, margins = _plain(plain_vllm, s.prompt, s.chat)
        k = next((i for i, (a, b) in enumerate(zip(s.ids, want, strict=False)) if a != b), None)
        # Greedy: the same tokens as one plain vLLM, up to a near tie.
        assert k is None or margins[k] < NEAR_TIE, (k, margins[k] if k is not None else None)
        assert len({c["id"] for c in s.chunks}) == 1
        assert s.chunks[-1]["usage"]["completion_tokens"] == len(s.ids) == MAX_TOKENS


def _migrations(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvferry_proxy_migrations_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _engine_idle(url: str) -> bool:
    text = httpx.get(url + "/metrics", timeout=5).text
    return all(float(line.rsplit(" ", 1)[1]) == 0 for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def test_client_leaves_right_after_the_first_token_nothing_is_recomputed(cluster: dict) -> None:
    """The decoder drops the request (vLLM aborts it when the proxy's connection closes) and its
    connector never loads nor recomputes the prompt for a client that is gone."""
    logs = {d["url"]: Path(d["log"]) for d in cluster["decoders"]}
    start = {u: p.stat().st_size for u, p in logs.items()}
    for i in range(4):
        body = {"model": "tiny", "prompt": f"{PROMPTS[i % 2]} {i}", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", cluster["url"] + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token: the client leaves
    until(lambda: not any(_pages(u)[0] != _pages(u)[1] or _pages(u)[2] for u in logs),  # the transfers aborted at once
          3.0, lambda: f"the pages back: {[_pages(u) for u in logs]}", every=0.05)
    until(lambda: all(_engine_idle(u) for u in logs), 15, "the decoders to drop the requests whose client left",
          every=0.2)
    time.sleep(1.0)  # a sleep (window): a recompute would be logged by now
    for u, p in logs.items():
        with open(p, "rb") as f:
            f.seek(start[u])
            new = f.read().decode(errors="replace")
        assert "cannot be loaded" not in new and "recomputing" not in new, new[-2000:]


# The cluster's --max-num-batched-tokens: a longer prompt is prefilled over several steps. Not vLLM
# CPU's default 2,048: a step of that many takes half a second on a fast CPU, too short for a
# client to leave while it computes; one of 6,144 takes seconds (and leaves room for a second
# step under the 8,192-token model length).
PREFILL_STEP = 6144
# How long a point waits for the decoders' pages: far from the milliseconds they take. What the
# test holds them to is the mechanism's own clock: back while the prefiller still computes the
# step the prompt is in (the prefiller logs the step's end), by the sender's final abort
# answering the receiver's drop (both log it; the lease's end frees them without either line).
PAGES_WAIT_S = 120.0
FREED_BY_ABORT = "wrote nothing; its"  # receiver/quarantine.py's line when a final abort frees pages
ANSWERED_DROP = "abort sent to receiver"  # sender/grant_ends.py's, answering a receiver's drop


class _Leaver:
    """One client of a streamed completion of `n` random token ids that leaves before any byte of
    the answer: its connection is reset (SO_LINGER 0), as a client process that dies or gives up
    with a reset does."""

    def __init__(self, url: str, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.n = n
        raw = json.dumps({"model": "tiny", "prompt": [rng.randrange(10, 4000) for _ in range(n)], "max_tokens": 8,
                          "temperature": 0, "stream": True}).encode()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % (host.encode(), len(raw)) + raw)

    def leave(self) -> float:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        return time.monotonic()


def _log_lines(logs: list[Path], marks: list[int], words: tuple[str, ...], most: int = 40) -> str:
    """The last `most` lines of each log past its mark that name one of `words`."""
    out = []
    for p, mark in zip(logs, marks, strict=True):
        with open(p, "rb") as f:
            f.seek(mark)
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if any(w in ln for w in words)]
        out.append(f"--- {p.name}:\n" + "\n".join(lines[-most:]))
    return "\n".join(out)


def _metric(url: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith(prefix))


def _prefill_legs(url: str) -> int:
    """Prefill legs the proxy has in flight."""
    return sum(i["in_flight"] for i in httpx.get(url + "/health", timeout=5).json()["instances"]
               if i["role"] == "prefiller")


def _decoders_held(cluster: dict) -> tuple[float, float]:
    """The decoders' pd_buffer pages not free, and their transfers in flight."""
    got = [_pages(d["url"]) for d in cluster["decoders"]]
    return sum(p[1] - p[0] for p in got), sum(p[2] for p in got)


def _decoders_free(cluster: dict) -> bool:
    return _decoders_held(cluster) == (0, 0)


def _reserved(cluster: dict) -> bool:
    """A decoder holds pages for a transfer: the prefiller scheduled a prompt (its first step runs)."""
    return any(_pages(d["url"])[2] for d in cluster["decoders"])


def test_trust_a_client_that_leaves_during_prefill_frees_the_decoders_pages_while_the_step_computes_at_every_point(
        cluster: dict) -> None:
    """A client leaves before the prefiller has its request, while it waits in the prefiller's
    queue, during the first step of a two-step prompt, and during the one step of a short prompt
    (the prefiller about to answer). Each time every decoder's pd_buffer comes to be free with
    nothing in flight; pages reserved for the prompt come back while the prefiller still computes
    the step it is in, freed by the prefiller's own final abort (not by the lease, 30 s, nor by the
    step's end). The two-step prompt stops at the end of
    the step it was in: it is neither computed to its end nor sent. (A 6,144-token step takes
    seconds on an AVX-512 CPU and a minute on an AVX2 one: this costs one such step and a short
    one. A prompt left between steps, with a piece already written, is
    tests/transfer/test_prefill_abort_trust.py's.)"""
    url = cluster["url"]
    prefiller = next(i for i in cluster["state"]["instances"] if i["role"] == "prefiller")
    plog = Path(prefiller["log"])
    logs = [Path(cluster["log"]), plog] + [Path(d["log"]) for d in cluster["decoders"]]
    marks = [p.stat().st_size for p in logs]  # where each log stood when the test began

    def pages_back(leave: Callable[[], float], point: str, others: tuple[float, float] = (0, 0),
                   prompt: int = 0) -> None:
        """The client leaves (`leave()`: when it closed), and the decoders come to hold only
        `others` (pages, transfers in flight). `prompt`: the tokens of a prompt that had pages;
        they came back by its sender's final abort, answering the receiver's drop, before the step
        the prompt was in ended (the prefiller logs that end)."""
        at = [p.stat().st_size for p in logs]  # before the client leaves: the lines its leaving makes come after
        closed = leave()

        def saw() -> str:
            return (f"{point}: every decoder's pages back; they hold {_decoders_held(cluster)} (pages, transfers "
                    f"in flight), not {others}, {time.monotonic() - closed:.2f} s after the client's close; the "
                    "logs since the test began:\n"
                    + _log_lines(logs, marks, ("transfer", "abort", "disconnect", "dropped", "ended after")))
        until(lambda: _decoders_held(cluster) == others, PAGES_WAIT_S, saw)
        took = time.monotonic() - closed
        if prompt:
            # A log line reaches its file after the gauge moved: wait for the two. The prefiller's
            # lines are one process's, in the order they happened: the answer to the drop comes
            # before the step's end, if that is logged yet.
            step_end = f"of its {prompt} prompt tokens"
            until(lambda: FREED_BY_ABORT in _log_lines(logs[2:], at[2:], (FREED_BY_ABORT,))
                  and ANSWERED_DROP in _log_lines(logs[1:2], at[1:2], (ANSWERED_DROP,)), 60,
                  lambda: f"{point}: the pages came back, not by the sender's answer to the drop\n" + saw())
            plines = _log_lines(logs[1:2], at[1:2], (ANSWERED_DROP, step_end))
            assert step_end not in plines.split(ANSWERED_DROP, 1)[0], \
                f"{point}: pages back only after the step ended\n" + saw()
        print(f"{point}: pages back {took:.3f} s after the client's close")

    def prefiller_idle() -> None:  # the step the prompt was in ends: then vLLM drops the request
        until(lambda: _engine_idle(prefiller["url"]) and _pages(prefiller["url"])[0] == _pages(prefiller["url"])[1],
              120, "the prefiller's engine idle and its staging pages back", every=0.2)

    until(lambda: _decoders_free(cluster) and _engine_idle(prefiller["url"]), 60, "a quiet cluster", every=0.2)
    # Before the prefiller has it: the proxy's abort comes before any alloc, and a late one is refused.
    pages_back(_Leaver(url, 50, 1).leave, "before the prefiller")
    prefiller_idle()
    # A computes its first step; B, sent then, waits behind it in the prefiller's queue. B leaves,
    # then A, before its first step ends.
    a = _Leaver(url, PREFILL_STEP + 52, 2)
    until(lambda: _reserved(cluster), 120, "A's pages reserved (its first step computes)", every=0.02)
    held = _decoders_held(cluster)
    b = _Leaver(url, 500, 3)
    # B's prefill leg is on its way to the prefiller (vLLM's own queue gauge moves only between
    # steps, after A's first one).
    until(lambda: _prefill_legs(url) >= 2, 30, "B's prefill leg sent", every=0.01)
    pages_back(b.leave, "B waiting in the prefiller's queue", others=held)
    pages_back(a.leave, "A in its first step", prompt=a.n)
    prefiller_idle()
    # D leaves during its one step: its pages are granted, nothing is written, the answer is next.
    # 4,000 tokens (one step, under PREFILL_STEP): a step of seconds, so the polls of both
    # decoders' /metrics see its pages reserved on a loaded machine too (400 took 3.5 s, and a
    # loaded run's polls missed it).
    d = _Leaver(url, 4000, 4)
    until(lambda: _reserved(cluster), 120, "D's pages reserved (its step computes)", every=0.02)
    pages_back(d.leave, "D in its only step", prompt=d.n)
    prefiller_idle()
    with open(plog, "rb") as f:
        f.seek(marks[1])
        log = f.read().decode(errors="replace")
    ended = {int(m): int(n) for n, m in re.findall(r"ended after (\d+) of its (\d+) prompt tokens", log)}
    assert ended.get(a.n) == PREFILL_STEP, (ended, log[-3000:])  # stopped when the step it was in ended
    assert f"stored {a.n} tokens" not in log and f"stored {b.n} tokens" not in log, log[-3000:]
    assert "is not sent" in log and "dropped it (client disconnected)" in log, log[-3000:]


def test_stall_a_sigstopped_decoders_streams_migrate_after_the_stall_timeout(cluster: dict, plain_vllm) -> None:
    before = _migrations(cluster["url"]).get("stall", 0)
    streams = _run_and_break(cluster, plain_vllm, signal.SIGSTOP)
    _check(streams, plain_vllm)
    # moved by the stall timer (its own label), not by the read timeout or a broken connection
    assert _migrations(cluster["url"]).get("stall", 0) >= before + 1
    assert "migrating a request from decoder" in Path(cluster["log"]).read_text()


def test_migrate_a_sigkilled_decoders_streams_finish_on_the_other(cluster: dict, plain_vllm) -> None:
    m0 = sum(_migrations(cluster["url"]).values())
    streams = _run_and_break(cluster, plain_vllm, signal.SIGKILL)
    _check(streams, plain_vllm)
    assert sum(_migrations(cluster["url"]).values()) >= m0 + 1


def test_restart_a_killed_decoder_is_started_again_and_serves(cluster: dict) -> None:
    """After the SIGKILL above, `kvferry up` starts the killed decoder again (cluster.json counts it) and
    the proxy routes to it again once it is healthy."""
    state_file = Path(cluster["state_file"])
    d0 = cluster["victim"]

    def victim() -> dict:
        return {i["url"]: i for i in json.loads(state_file.read_text())["instances"]}[d0]
    until(lambda: victim()["restarts"] >= 1 and _healthy_decoders(cluster["url"]) == 2, 300,
          lambda: f"the killed decoder restarted and healthy: {victim()}", every=1)
    served = 0
    for i in range(4):  # round robin over both decoders
        r = httpx.post(cluster["url"] + "/v1/completions", json={"model": "tiny", "prompt": f"again {i}",
                                                                 "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
    for line in httpx.get(d0 + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            served += float(line.rsplit(" ", 1)[1])
    assert served >= 1


def _pages(url: str) -> tuple[float, float, float]:
    """A decoder's (free pages, all pages, transfers in flight) as its /metrics says now."""
    got = {"kvferry:pd_buffer_free_pages": 0.0, "kvferry:pd_buffer_pages": 0.0, "kvferry:pd_transfers_in_flight": 0.0}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        name = line.split("{", 1)[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    return got["kvferry:pd_buffer_free_pages"], got["kvferry:pd_buffer_pages"], got["kvferry:pd_transfers_in_flight"]


def test_the_only_prefiller_killed_mid_prefill_its_decoder_serves_it_whole_and_the_pages_come_back_at_once(
        cluster: dict) -> None:
    """Last in this module: it leaves the prefiller restarting. A long prompt (about 7,700 tokens): its
    pages on the decoder were reserved when the prompt was scheduled; they come back when the
    prefiller's connection closes (a grace after, WRITER_GONE_GRACE_S), not at the lease's end,
    and the decoder's live /metrics says so while the decoder is still computing the whole prompt
    itself (degraded: no prefiller left), so neither the release nor the gauge waits for the
    decoder's engine step. The client gets its answer rather than a 503."""
    decoders = cluster["decoders"]
    urls = [d["url"] for d in decoders]
    until(lambda: _healthy_decoders(cluster["url"]) >= 2 and all(_pages(u)[0] == _pages(u)[1] for u in urls), 60,
          lambda: f"both decoders healthy, every page free: {[_pages(u) for u in urls]}", every=0.5)
    prefiller = next(i for i in cluster["state"]["instances"] if i["role"] == "prefiller")
    body = {"model": "tiny", "prompt": " ".join(f"word{i}" for i in range(1700)), "max_tokens": 32,
            "temperature": 0, "ignore_eos": True}
    out: dict = {}

    def ask() -> None:
        r = httpx.post(cluster["url"] + "/v1/completions", json=body, timeout=300)
        out["status"], out["text"] = r.status_code, r.text

    t = threading.Thread(target=ask, daemon=True)
    t.start()

    def reserved() -> bool:
        assert t.is_alive(), out
        return any(_pages(u)[2] for u in urls)
    until(reserved, 60, lambda: f"pages reserved, the prompt computing: {out}", every=0.02)
    degraded = _metric(cluster["url"], 'kvferry_proxy_served_total{mode="degraded"}')
    logs = {d["url"]: Path(d["log"]) for d in decoders}
    marks = {u: p.stat().st_size for u, p in logs.items()}
    os.killpg(prefiller["pid"], signal.SIGKILL)

    def free_while_computing() -> bool:
        free = all(_pages(u)[0] == _pages(u)[1] for u in urls)
        assert not free or t.is_alive(), ("the decoder finished the prompt before its /metrics showed the "
                                          f"pages free: {out.get('status')}")
        return free
    # A deadline far from the ~1.2 s measured (the close, the grace, a scrape); the lease is 30 s.
    until(free_while_computing, 30, "every decoder's pd_buffer pages back while it computes the prompt", every=0.05)
    freed_by_close = [u for u, p in logs.items()
                      if "a sender's connection closed" in p.read_bytes()[marks[u]:].decode(errors="replace")]
    assert freed_by_close, "the pages came back through the closed connection, not the lease"
    t.join(200)  # the decoder computes the whole prompt: its first long forward takes seconds on a CPU
    assert out.get("status") == 200, out
    assert json.loads(out["text"])["usage"]["completion_tokens"] == 32, out
    assert _metric(cluster["url"], 'kvferry_proxy_served_total{mode="degraded"}') == degraded + 1
