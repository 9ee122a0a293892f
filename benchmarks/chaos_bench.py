"""Chaos soak: a `kvferry up` cluster under steady streamed load while clients leave and instances die.

    python benchmarks/chaos_bench.py --json [--requests 200] [--concurrency 6] [--disconnect 0.1]
        [--prefillers 1] [--decoders 2]

`kvferry up` starts the prefillers and decoders (real vLLM CPU servers, the tiny model) and its
proxy (defaults: cache-aware routing, migration on). The load: `--requests` streamed greedy
requests (chat and completions alternately, prompts of 8-200 words from a pool of 40, 24 output
tokens, `ignore_eos`), `--concurrency` at a time. A `--disconnect` fraction of them leave at a
random phase: during prefill (before the first token), right after the first token, or
mid-decode. At a third of the requests decoder 0 is SIGKILLed, at two thirds prefiller 0;
`kvferry up` starts each again. While every prefiller is dead the decoders serve prompts whole
(``degraded``); a request refused with 503 all the same is retried by its client after 0.5 s
(counted in ``unavailable_503``); one that never completes is ``failed``.

Reported (JSON, last line):

- ``requests``, ``ok``, ``failed``, ``disconnected``, ``migrated`` (the proxy's
  kvferry_proxy_migrations_total over the run), ``degraded`` (prompts its decoders served alone
  while no prefiller was usable: kvferry_proxy_served_total{mode="degraded"}), ``unavailable_503``;
- ``wrong``: completed answers whose tokens differ from the same prompt's answer on the quiet
  cluster before the chaos, where the reference's top-2 logprob margin at the first difference is
  at least ``--tie-margin``; ``near_tie``: differences at a smaller margin (vLLM CPU's prefix
  cache can flip a near-tie token: not wrong KV);
- ``stranded_pages``: decoder pd_buffer pages not free 3 s after the load (read from /metrics,
  live: common/live_gauges.py);
- ``abort_to_decoder_pages_p50_ms`` / ``_max_ms`` and ``abort_to_idle_p50_ms`` / ``_max_ms``: on
  the quiet cluster after the soak, a client leaves a 300-word request at each phase in turn
  (``--abort-trials`` in all; during prefill it closes its connection at a random point of the
  prefill, before any byte of the answer, as a client that gives up does); the time from its
  close until every decoder's pd_buffer pages are free with nothing in flight, and until every
  instance's are (a prefiller's staging pages too: they come back when its engine ends the
  request, after the step it is in) (kvferry's live gauges; vLLM shows no live per-request
  state: its running gauge waits for an engine step, and it does not count a client's abort in
  request_success_total). An engine cannot stop inside a step: ``prefill_step_ms`` is that
  prompt's undisturbed time to first token;
- ``restart_to_serving_s``: per killed role, from the SIGKILL until the proxy's health check
  routes to the instance again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

OUTPUT_TOKENS = 24
PHASES = ("prefill", "first_token", "mid_decode")


@dataclass
class Job:
    i: int
    chat: bool
    prompt: str
    leave: str | None  # a phase of PHASES, or None: the client stays


@dataclass
class Result:
    ok: bool = False
    ids: list[int] = field(default_factory=list)
    unavailable: int = 0
    error: str = ""


def words(rng: random.Random, n: int) -> str:
    vocab = ["river", "stone", "light", "market", "garden", "winter", "story", "engine", "silver", "north",
             "table", "letter", "window", "harbor", "forest", "signal", "paper", "village", "mountain", "song"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def body(job: Job, stream: bool, top: int = 0) -> dict:
    b = {"model": "tiny", "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True}
    if stream:
        b.update(stream=True, stream_options={"include_usage": True})
    if job.chat:
        b["messages"] = [{"role": "user", "content": job.prompt}]
        if top:
            b.update(logprobs=True, top_logprobs=top)
    else:
        b["prompt"] = job.prompt
        if top:
            b["logprobs"] = top
    return b


def path(job: Job) -> str:
    return "/v1/chat/completions" if job.chat else "/v1/completions"


def reference(url: str, job: Job) -> tuple[list[int], list[float]]:
    """The quiet cluster's answer and, per position, its top-2 logprob margin."""
    r = httpx.post(url + path(job), json=body(job, False, top=2), timeout=300)
    r.raise_for_status()
    ch = r.json()["choices"][0]
    if job.chat:
        tops = [[t["logprob"] for t in c["top_logprobs"]] for c in ch["logprobs"]["content"]]
    else:
        tops = [list(d.values()) for d in ch["logprobs"]["top_logprobs"]]
    margins = [(sorted(t, reverse=True)[0] - sorted(t, reverse=True)[1]) if len(t) > 1 else 1e9 for t in tops]
    return ch["token_ids"], margins


def run_one(url: str, job: Job, rng: random.Random, stop: threading.Event) -> Result:
    """One streamed request; leaves at its phase, retries a 503 (every prefiller dead)."""
    res = Result()
    while not stop.is_set():
        res.ids = []
        left = threading.Event()
        try:
            with httpx.stream("POST", url + path(job), json=body(job, True), timeout=180) as r:
                if r.status_code == 503:
                    res.unavailable += 1
                    r.read()
                    time.sleep(0.5)
                    continue
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                    return res
                if job.leave == "prefill":  # leave before the first token, whenever that comes
                    timer = threading.Timer(rng.uniform(0.01, 0.2), lambda left=left, r=r: (left.set(), r.close()))
                    timer.start()
                done = False
                for line in r.iter_lines():
                    if job.leave == "prefill" and line.startswith("data: "):
                        timer.cancel()
                        return res  # too late for the phase: it leaves at the first token instead
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        c = json.loads(line[6:])
                        if "error" in c:
                            res.error = f"error event: {c['error']}"
                            return res
                        for ch in c.get("choices") or []:
                            res.ids += ch.get("token_ids") or []
                        if job.leave == "first_token" and res.ids:
                            return res
                        if job.leave == "mid_decode" and len(res.ids) >= OUTPUT_TOKENS // 2:
                            return res
                if job.leave:
                    return res  # it finished before the phase came
                res.ok = done and len(res.ids) == OUTPUT_TOKENS
                if not res.ok:
                    res.error = f"stream ended after {len(res.ids)} tokens, [DONE] {done}"
                return res
        except (httpx.HTTPError, httpx.StreamError, RuntimeError) as e:
            if not left.is_set():
                res.error = f"{type(e).__name__}: {e}"
            return res
    res.error = "stopped"
    return res


def degraded(url: str) -> float:
    """Prompts the proxy served on a decoder alone as no prefiller was usable."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
               if line.startswith('kvferry_proxy_served_total{mode="degraded"}'))


def metrics(url: str) -> dict[str, float]:
    """Each series of `url`'s /metrics summed over its labels."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def pages_settled(state: dict, role: str | None = None) -> bool:
    """Every instance's (of `role`) pd_buffer pages free (a prefiller's staging, a decoder's
    receiving) and no transfer in flight: read live (common/live_gauges.py)."""
    for inst in state["instances"]:
        if role is not None and inst["role"] != role:
            continue
        m = metrics(inst["url"])
        if m.get("kvferry:pd_transfers_in_flight", 0) or \
                m.get("kvferry:pd_buffer_free_pages") != m.get("kvferry:pd_buffer_pages"):
            return False
    return True


def healthy(url: str, name: str) -> bool:
    try:
        instances = httpx.get(url + "/health", timeout=5).json()["instances"]
        return any(i.get("healthy") and i["url"] == name for i in instances)
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def start_cluster(log_dir: Path, prefillers: int, decoders: int) -> tuple[subprocess.Popen, dict]:
    port = int(os.environ.get("CHAOS_PORT", "0")) or _free_port()
    out = open(log_dir / "up.out", "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kvferry"), "up", "--port", str(port), "--log-dir",
                             str(log_dir), "--num-prefillers", str(prefillers), "--num-decoders", str(decoders)],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    state = log_dir / "cluster.json"
    deadline = time.monotonic() + 600
    while not state.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"kvferry up did not come up: {(log_dir / 'up.out').read_text()[-3000:]}")
        time.sleep(1)
    time.sleep(0.5)
    return proc, json.loads(state.read_text())


def _free_port() -> int:
    from kvferry.common.netutil import free_port
    return free_port()


def kill_and_time(state_file: Path, proxy: str, role: str, out: dict, stop: threading.Event) -> None:
    """SIGKILL the first instance of `role`; time until the proxy routes to it again."""
    inst = next(i for i in json.loads(state_file.read_text())["instances"] if i["role"] == role)
    killed = time.monotonic()
    os.killpg(inst["pid"], signal.SIGKILL)
    print(f"chaos: SIGKILLed {role} {inst['url']}", file=sys.stderr)
    while healthy(proxy, inst["url"]) and time.monotonic() - killed < 30:
        time.sleep(0.1)  # until the proxy has noticed the death
    while not stop.is_set():
        if healthy(proxy, inst["url"]):
            out[role] = round(time.monotonic() - killed, 1)
            return
        time.sleep(0.5)


def soak(args: argparse.Namespace, state: dict, state_file: Path, jobs: list[Job]) -> dict:
    proxy = state["proxy"]["url"]
    results: dict[int, Result] = {}
    lock = threading.Lock()
    todo = list(jobs)
    stop = threading.Event()
    restarts: dict[str, float] = {}
    kills = {} if args.no_kills else {len(jobs) // 3: "decoder", 2 * len(jobs) // 3: "prefiller"}
    killers: list[threading.Thread] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            with lock:
                if not todo:
                    return
                job = todo.pop(0)
                role = kills.pop(job.i, None)
            if role:
                t = threading.Thread(target=kill_and_time, args=(state_file, proxy, role, restarts, stop), daemon=True)
                t.start()
                killers.append(t)
            results[job.i] = run_one(proxy, job, rng, stop)

    m0, degraded0 = metrics(proxy), degraded(proxy)
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(args.seed + k,), daemon=True) for k in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    for t in killers:
        t.join(300)
    stop.set()
    m1 = metrics(proxy)
    mig = sum(v for k, v in m1.items() if k.startswith("kvferry_proxy_migrations_total")) - \
        sum(v for k, v in m0.items() if k.startswith("kvferry_proxy_migrations_total"))
    return {"results": results, "elapsed_s": round(elapsed, 1), "migrated": int(mig),
            "degraded": int(degraded(proxy) - degraded0), "restart_to_serving_s": restarts}


def leave_during_prefill(url: str, job: Job, after_s: float) -> None:
    """Send the streamed request, then close the connection `after_s` later, before any byte of the
    answer was read (headers come with the first token): the close a client that gives up makes."""
    u = httpx.URL(url)
    raw = json.dumps(body(job, True)).encode()
    with socket.create_connection((u.host, u.port or 80), timeout=10) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % (path(job).encode(), u.host.encode(), len(raw)) + raw)
        time.sleep(after_s)


def abort_trials(state: dict, n: int, rng: random.Random) -> dict:
    """On the quiet cluster: one client at a time leaves a 300-word request at a phase; the time
    from its close until every decoder's pd_buffer pages are free with nothing in flight, and until
    every instance's are."""
    proxy = state["proxy"]["url"]
    job = Job(-1, False, words(rng, 300), None)
    t0 = time.monotonic()
    with httpx.stream("POST", proxy + "/v1/completions", json=body(job, True), timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    step_s = time.monotonic() - t0
    to_decoders: dict[str, list[float]] = {p: [] for p in PHASES}
    to_idle: dict[str, list[float]] = {p: [] for p in PHASES}
    for k in range(n):
        deadline = time.monotonic() + 60
        while not pages_settled(state) and time.monotonic() < deadline:
            time.sleep(0.1)
        phase = PHASES[k % len(PHASES)]
        job = Job(-2 - k, False, words(rng, 300), phase)
        if phase == "prefill":
            leave_during_prefill(proxy, job, rng.uniform(0.0, 0.9 * step_s))
        else:
            run_one(proxy, job, rng, threading.Event())
        closed = time.monotonic()
        decoders = None
        while time.monotonic() - closed < 60:
            if decoders is None and pages_settled(state, "decoder"):
                decoders = time.monotonic()
            if pages_settled(state):
                break
            time.sleep(0.02)
        done = time.monotonic()
        to_decoders[phase].append(((decoders or done) - closed) * 1e3)
        to_idle[phase].append((done - closed) * 1e3)
    out: dict = {"prefill_step_ms": round(step_s * 1e3, 1), "abort_trials": n}
    for name, times in (("abort_to_decoder_pages", to_decoders), ("abort_to_idle", to_idle)):
        every = [t for ts in times.values() for t in ts]
        out.update({f"{name}_p50_ms": round(statistics.median(every), 1), f"{name}_max_ms": round(max(every), 1),
                    f"{name}_by_phase_ms": {p: [round(t) for t in ts] for p, ts in times.items()}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--disconnect", type=float, default=0.1, help="fraction of clients that leave early")
    ap.add_argument("--prefillers", type=int, default=1)
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--abort-trials", type=int, default=9)
    ap.add_argument("--tie-margin", type=float, default=0.05, help="logprob margin below which a flip is a near tie")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-kills", action="store_true", help="no SIGKILLs: clients leaving only")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    if args.requests < 3 or args.concurrency < 1 or not 0 <= args.disconnect <= 1:
        ap.error("--requests >= 3, --concurrency >= 1, 0 <= --disconnect <= 1")
    rng = random.Random(args.seed)
    pool = [words(rng, rng.randint(8, 200)) for _ in range(40)]
    jobs = [Job(i, i % 2 == 1, pool[i % len(pool)],
                rng.choice(PHASES) if rng.random() < args.disconnect else None) for i in range(args.requests)]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    proc, state = start_cluster(log_dir, args.prefillers, args.decoders)
    try:
        proxy = state["proxy"]["url"]
        deadline = time.monotonic() + 120
        while not all(healthy(proxy, i["url"]) for i in state["instances"]):
            if time.monotonic() > deadline:
                raise SystemExit("the cluster's instances did not all turn healthy within 120 s")
            time.sleep(1)
        refs = {}
        for j in jobs:
            key = (j.chat, j.prompt)
            if key not in refs:
                refs[key] = reference(proxy, j)
        print(f"chaos: {len(refs)} reference answers; soaking {len(jobs)} requests", file=sys.stderr)
        s = soak(args, state, log_dir / "cluster.json", jobs)
        state = json.loads((log_dir / "cluster.json").read_text())  # the restarted instances' pids
        time.sleep(3.0)
        stranded = 0
        for inst in state["instances"]:
            if inst["role"] == "decoder":
                m = metrics(inst["url"])
                stranded += int(m.get("kvferry:pd_buffer_pages", 0) - m.get("kvferry:pd_buffer_free_pages", 0))
        wrong = near = 0
        for j in jobs:
            r = s["results"][j.i]
            if not r.ok:
                continue
            want, margins = refs[(j.chat, j.prompt)]
            diff = next((k for k, (a, b) in enumerate(zip(r.ids, want, strict=False)) if a != b), None)
            if diff is not None:
                if margins[diff] < args.tie_margin:
                    near += 1
                else:
                    wrong += 1
        res = s["results"]
        out = {"requests": len(jobs), "ok": sum(r.ok for r in res.values()),
               "disconnected": sum(1 for j in jobs if j.leave),
               "failed": sum(1 for j in jobs if not j.leave and not res[j.i].ok),
               "migrated": s["migrated"], "degraded": s["degraded"],
               "unavailable_503": sum(r.unavailable for r in res.values()),
               "wrong": wrong, "near_tie": near, "stranded_pages": stranded,
               "restart_to_serving_s": s["restart_to_serving_s"], "elapsed_s": s["elapsed_s"],
               "errors": sorted({r.error for j in jobs if not j.leave and (r := res[j.i]).error})[:10]}
        out.update(abort_trials(state, args.abort_trials, rng))
        out["log_dir"] = str(log_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
