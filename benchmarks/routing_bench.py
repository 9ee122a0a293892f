"""Routing policies side by side on one `kvferry up` cluster: a long-document Q&A workload (as
LMCache's long_doc_qa: D documents, Q questions each, questions interleaved across documents),
the prefix-cache hit rate and TTFT per policy.

    python benchmarks/routing_bench.py --json                      # 8 documents x 1,500 tokens, 4 questions
    python benchmarks/routing_bench.py --documents 4 --doc-tokens 600 --questions 3 --json

`kvferry up` starts 2 prefillers and 1 decoder (KV events on) with its proxy (policy `cache`,
conditional disaggregation at its defaults); each other policy gets a proxy of its own in front
of the same instances, as LMCache's proxy would route (no local prefill). Each policy gets
documents of its own, so no policy profits from another's cache.

Hit rate = 1 - tokens the engines computed (vllm:prompt_tokens_by_source{source="local_compute"},
all instances) / the prompts' tokens. Ideal = the block-aligned part of each prompt that an
earlier prompt of the same run shares (one cache that never forgets).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvferry.common.netutil import free_port
from kvferry.launcher import tiny_model
from kvferry.proxy.routing.tokens import PromptTokens

VOCAB = ["river", "stone", "lamp", "orange", "quiet", "seven", "north", "paper", "glass", "winter", "market",
         "silver", "garden", "engine", "cloud", "harbor", "violet", "copper", "meadow", "signal"]


def text(rng: random.Random, tok: PromptTokens, target: int) -> str:
    """Words until the tokenizer counts about `target` tokens."""
    out: list[str] = []
    while len(tok.completion(" ".join(out)) or []) < target:
        out += [rng.choice(VOCAB) for _ in range(max(1, (target - len(tok.completion(" ".join(out)) or [])) // 2))]
    return " ".join(out)


def workload(seed: int, tok: PromptTokens, a: argparse.Namespace) -> list[str]:
    rng = random.Random(seed)
    docs = [text(rng, tok, a.doc_tokens) for _ in range(a.documents)]
    out = []
    for q in range(a.questions):  # round q: one question on every document
        order = list(range(a.documents))
        if a.order == "shuffled":
            rng.shuffle(order)
        out += [f"{docs[d]}\nQuestion {q}: {text(rng, tok, a.question_tokens)}?" for d in order]
    return out


def ideal_hit(prompts: list[list[int]], block: int) -> int:
    """Tokens a never-forgetting prefix cache would hold, over the run."""
    seen: list[list[int]] = []
    total = 0
    for p in prompts:
        best = 0
        for s in seen:
            n = 0
            for a, b in zip(p, s, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        total += min(best, len(p) - 1) // block * block
        seen.append(p)
    return total


def computed(urls: list[str]) -> float:
    n = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=30).text.splitlines():
            if line.startswith('vllm:prompt_tokens_by_source_total{') and 'source="local_compute"' in line:
                n += float(line.rsplit(" ", 1)[1])
    return n


def ttft(url: str, prompt: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=600,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True}) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
        if first is None:
            raise RuntimeError(f"no token streamed from {url}")
        return first


def run_policy(name: str, url: str, urls: list[str], prompts: list[str], tok: PromptTokens,
               a: argparse.Namespace) -> dict:
    ids = [tok.completion(p) or [] for p in prompts]
    before = computed(urls)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        ttfts = list(pool.map(lambda p: ttft(url, p, a.max_tokens), prompts))
    wall = time.perf_counter() - t0
    done = computed(urls) - before
    total = sum(len(i) for i in ids)
    ideal = ideal_hit(ids, a.block_size)
    hit = max(0.0, 1 - done / total)
    ideal_rate = ideal / total
    q = sorted(ttfts)
    return {"policy": name, "requests": len(prompts), "prompt_tokens": total, "computed_tokens": done,
            "hit_rate": round(hit, 4), "ideal_hit_rate": round(ideal_rate, 4),
            "hit_of_ideal": round(hit / ideal_rate, 4) if ideal_rate else None,
            "mean_ttft_s": round(statistics.fmean(ttfts), 4), "p90_ttft_s": round(q[int(0.9 * (len(q) - 1))], 4),
            "wall_s": round(wall, 2)}


def proxy_for(state: dict, policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "kvferry.proxy", "--port", str(port), "--policy", policy,
            "--local-prefill-fraction", "2", "--cluster-secret-file", state["cluster_secret_file"]]
    for i in state["instances"]:
        args += ["--prefiller", i["url"]] if i["role"] == "prefiller" else \
            ["--decoder", f"{i['url']},{i['init_port']},{i['alloc_port']}"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the {policy} proxy did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--question-tokens", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--order", choices=("shuffled", "cycle"), default="shuffled",
                    help="documents' order in each round of questions (a fixed cycle over an even number of "
                         "documents gives round robin perfect affinity with 2 prefillers, by accident)")
    ap.add_argument("--policies", default="round_robin,load,cache")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's block size (128 on the CPU build)")
    ap.add_argument("--up-timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    model = tiny_model.ensure()
    tok = PromptTokens(str(model))
    log_dir = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "kvferry.launcher", "up", "--num-prefillers", "2", "--num-decoders",
                           "1", "--port", str(port), "--log-dir", str(log_dir / "logs")],
                          stdout=open(log_dir / "up.out", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    results, extra = [], []
    try:
        state_file = log_dir / "logs" / "cluster.json"
        deadline = time.monotonic() + a.up_timeout
        while not state_file.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvferry up did not come up:\n{(log_dir / 'up.out').read_text()[-3000:]}")
            time.sleep(1)
        time.sleep(0.5)
        state = json.loads(state_file.read_text())
        urls = [i["url"] for i in state["instances"]]
        for k, policy in enumerate(a.policies.split(",")):
            if policy == "cache":
                url = state["proxy"]["url"]
            else:
                proc, url = proxy_for(state, policy)
                extra.append(proc)
            ttft(url, "warm up", 2)
            results.append(run_policy(policy, url, urls, workload(1000 + k, tok, a), tok, a))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    finally:
        for p in extra:
            p.terminate()
            p.wait(10)
        up.terminate()
        up.wait(60)
    by = {r["policy"]: r for r in results}
    out = {"workload": {"documents": a.documents, "doc_tokens": a.doc_tokens, "questions": a.questions,
                        "question_tokens": a.question_tokens, "max_tokens": a.max_tokens,
                        "concurrency": a.concurrency, "order": a.order, "cluster": "kvferry up: 2 prefillers, 1 "
                                                                                   "decoder"},
           "policies": results}
    if "cache" in by and "round_robin" in by:
        out["cache_vs_round_robin_mean_ttft"] = round(by["cache"]["mean_ttft_s"] / by["round_robin"]["mean_ttft_s"], 3)
    print(json.dumps(out, indent=None if a.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
