"""remote_serde cachegen on the tiny models' real KV: size, encode/decode speed, and answers.

    python benchmarks/cachegen_bench.py --json [--models llama,deepseek,llama-copy,deepseek-copy] [--prompts 8]
                                        [--reps 5]

The models: the random-weight tiny Llama and DeepSeek (MLA) of the tests, whose KV is what vLLM
computes but whose logits' margins are tiny (any KV error flips greedy answers), and llama-copy and
deepseek-copy, small GQA and MLA models trained here to continue a repeated 16-token pattern
(launcher/tiny_model.py), whose answers read the cached KV with a trained model's margins: they
are the ones that judge answers. The random models' prompts are random token ids; the copy
models' are their task's (a pattern repeated).

Per model, two kv_both vLLM servers (vLLM's prefix cache off, no CPU tier, one core each), each
with a Redis of its own: N writes ``remote_serde: naive``, C ``cachegen``. Each prompt (random
token ids, 300-1,000 tokens; 16 greedy tokens with their logprobs) goes

  to N        computed: the reference answer; its naive chunks hold the real KV vLLM wrote
  to C        computed, stored as cachegen chunks
  to C again  once C's store holds every chunk: a remote hit, all but the last token's KV
              decoded from cachegen (counted by C's kvferry:cache_hit_tokens_total{tier="remote"})

``greedy_match`` is the prompts whose hit answer equals the reference, over the prompts;
``max_logprob_diff`` the largest |difference| of the chosen tokens' logprobs over the positions
where the two answers still agree.

Then, offline on one core (torch.set_num_threads(1)), each naive chunk N stored, read back out of
its Redis, is encoded with cachegen and decoded again ``--reps`` times:

  ratio_vs_naive        naive stored bytes / cachegen stored bytes (headers included), from the
                        two stores' own values for the same prompts
  encode_gbps_per_core  KV bytes (the naive chunk's) coded per second, median over chunks of the
  decode_gbps_per_core  best of the reps; decode includes the checksum and writing the chunk
  store_get_gbps        one client reading the naive values out of Redis over loopback: the
                        store's own transfer a cachegen decode must beat to make a load faster
  max_group_rel_rms     the largest relative RMS error of one layer's K or V (or latent)

Reports ``{"models": {...}, "ratio_vs_naive", "encode_gbps_per_core", "decode_gbps_per_core",
"greedy_match", "max_logprob_diff", ...}``: the top-level sizes and rates are the worst over the
models; greedy_match and max_logprob_diff are the copy models' (those that ran), the models whose
answers can tell a good codec from a bad one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis
import torch

from kvferry.connector.cpu_isa import attention_isa
from kvferry.engine.remote.serde import HEADER_BYTES, ChunkShape, Serde, peek
from kvferry.kernels.layout import KVLayout
from kvferry.launcher import tiny_model
from kvferry.testing.store_servers import start_redis
from kvferry.testing.vllm_servers import OffloadServer

MAX_TOKENS = 16
# vLLM CPU's KV layout for each tiny model: its attention backend's layout and block size
LAYOUTS = {"llama": ("cpu", 128), "deepseek": ("mla", 16), "llama-copy": ("cpu", 128), "deepseek-copy": ("mla", 16)}


def complete(client: httpx.Client, server: OffloadServer, prompt: list[int]) -> tuple[list[int], list[float]]:
    r = client.post(f"{server.url}/v1/completions", timeout=600, json={
        "model": server.served_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "logprobs": 1})
    r.raise_for_status()
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def metric(client: httpx.Client, server: OffloadServer, name: str, label: str = "") -> float:
    text = client.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")) and label in line)


def wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def settled(stores: list[redis.Redis], at_least: int) -> bool:
    """Both stores hold the same number of chunks, at least `at_least` (puts are asynchronous; a
    chunk is two Redis keys, its header and its payload)."""
    n = [s.dbsize() for s in stores]
    return n[0] == n[1] >= 2 * at_least


def serve(model: str, work: Path, prompts: list[list[int]], progress: bool) -> dict:
    """Quality on real vLLM; returns the answers' agreement and the two stores' values."""
    stores = [start_redis(work, maxmemory_mb=2048), start_redis(work, maxmemory_mb=2048)]
    servers = [OffloadServer(model, work, core, work, local_cpu=False, remote_url=f"redis://127.0.0.1:{st.port}",
                             remote_serde=serde, server={"extra_args": ["--no-enable-prefix-caching"]})
               for core, serde, st in (("0", "naive", stores[0]), ("1", "cachegen", stores[1]))]
    clients = [redis.Redis(port=st.port, socket_timeout=30) for st in stores]
    naive, cg = servers
    rows = []
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(progress=progress)
        with httpx.Client() as http:
            chunks = 0
            for i, p in enumerate(prompts):
                ref = complete(http, naive, p)
                cold = complete(http, cg, p)
                chunks += -(-len(p) // 256)
                wait(lambda n=chunks: settled(clients, n), 120, f"both stores to hold {chunks} chunks")
                hits0 = metric(http, cg, "kvferry:cache_hit_tokens_total", 'tier="remote"')
                hit = complete(http, cg, p)
                want = hits0 + len(p) - 1
                wait(lambda w=want: metric(http, cg, "kvferry:cache_hit_tokens_total", 'tier="remote"') >= w,
                     30, "C to count the remote hit")
                agree = 0
                while agree < MAX_TOKENS and hit[0][agree] == ref[0][agree]:
                    agree += 1
                diff = max((abs(a - b) for a, b in zip(hit[1][:agree], ref[1][:agree], strict=True)), default=0.0)
                rows.append({"tokens": len(p), "match": hit[0] == ref[0], "agree": agree,
                             "cold_matches_reference": cold[0] == ref[0], "max_logprob_diff": round(diff, 4)})
                if progress:
                    print(f"  prompt {i + 1}/{len(prompts)}: {rows[-1]}", flush=True)
        values = [{k: c.get(k) for k in c.keys("*")} for c in clients]
    finally:
        for s in servers:
            s.stop()
        for st in stores:
            st.stop()
    return {"rows": rows, "naive": values[0], "cachegen": values[1]}


def best(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    out = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def offline(arch: str, values: dict[bytes, bytes], reps: int) -> dict:
    """Encode and decode every naive chunk on one core; the error of each layer's K and V."""
    layout, bs = LAYOUTS[arch]
    enc, dec, sizes, errors = [], [], [0, 0], []
    bins: tuple[int, ...] = ()
    for key in (k for k in values if k.endswith(b":h")):
        _, dtype, (layers, tokens, heads, head) = peek(values[key])
        value = values[key] + values[key[:-2] + b":d"]
        isa = attention_isa(KVLayout(layout, 1, bs, heads, head, dtype), "auto")  # as the vLLM that wrote it
        shape = ChunkShape(dtype, layers, heads, head, b"\0" * 16, layout, bs, isa)
        raw = torch.frombuffer(bytearray(value[HEADER_BYTES:]), dtype=torch.uint8)
        serde = Serde("cachegen", shape)
        assert serde.bins is not None
        bins = serde.bins.per_group
        head_, payload = serde.encode(raw, tokens)
        enc.append(raw.numel() / best(lambda: serde.encode(raw, tokens), reps))  # noqa: B023
        blob = bytes(payload)
        dec.append(raw.numel() / best(lambda: serde.decode(head_, blob, tokens, raw.numel()), reps))  # noqa: B023
        back = serde.decode(head_, blob, tokens, raw.numel())
        sizes[0] += len(value)
        sizes[1] += len(head_) + len(blob)
        want, got = shape.chunk_kv(raw, tokens), shape.chunk_kv(back, tokens)
        for layer in range(layers):
            for kind in range(len(want)):
                w = want[kind][layer].reshape(-1, heads * head)[:tokens].float()
                g = got[kind][layer].reshape(-1, heads * head)[:tokens].float()
                errors.append(float((g - w).norm() / w.norm()))
    return {"chunks": len(values) // 2, "bins": list(bins), "offline_ratio": round(sizes[0] / sizes[1], 3),
            "encode_gbps_per_core": round(statistics.median(enc) / 1e9, 3),
            "decode_gbps_per_core": round(statistics.median(dec) / 1e9, 3),
            "max_group_rel_rms": round(max(errors), 4)}


def store_get_gbps(work: Path, values: dict[bytes, bytes], reps: int) -> float:
    """One client reading the values back from a Redis over loopback, best of `reps` passes."""
    st = start_redis(work, maxmemory_mb=2048)
    try:
        c = redis.Redis(port=st.port, socket_timeout=30)
        for k, v in values.items():
            c.set(k, v)
        keys = list(values)
        return round(sum(map(len, values.values())) / best(lambda: [c.get(k) for k in keys], reps) / 1e9, 3)
    finally:
        st.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--models", default=",".join(LAYOUTS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvferry-cachegen-bench-"))
    per_model = {}
    for arch in args.models.split(","):
        if arch not in LAYOUTS:
            ap.error(f"--models: {arch!r} is not one of {', '.join(LAYOUTS)}")
        model = tiny_model.ensure(arch=arch)
        rng = random.Random(7)
        lengths = [rng.choice([300, 600, 1000]) for _ in range(args.prompts)]
        prompts = [tiny_model.copy_prompt(rng, n) if arch in tiny_model.COPY_RECIPES else
                   [rng.randrange(10, 4000) for _ in range(n)] for n in lengths]
        if not args.json:
            print(f"{arch}: serving {len(prompts)} prompts ...", flush=True)
        got = serve(str(model), work, prompts, not args.json)
        rows = got["rows"]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            res = offline(arch, got["naive"], args.reps)
        finally:
            torch.set_num_threads(threads)
        res.update({
            "ratio_vs_naive": round(sum(map(len, got["naive"].values())) / sum(map(len, got["cachegen"].values())), 3),
            "store_get_gbps": store_get_gbps(work, got["naive"], args.reps),
            "greedy_match": f"{sum(r['match'] for r in rows)}/{len(rows)}",
            "cold_matches_reference": f"{sum(r['cold_matches_reference'] for r in rows)}/{len(rows)}",
            "tokens_agreeing": f"{sum(r['agree'] for r in rows)}/{MAX_TOKENS * len(rows)}",
            "max_logprob_diff": max(r["max_logprob_diff"] for r in rows)})
        res["decode_vs_store_get"] = round(res["decode_gbps_per_core"] / res["store_get_gbps"], 3)
        per_model[arch] = res
        if not args.json:
            print(f"{arch}: {json.dumps(res)}", flush=True)
    ms = list(per_model.values())
    judges = [m for arch, m in per_model.items() if arch in tiny_model.COPY_RECIPES] or ms
    out = {"models": per_model, "prompts": args.prompts, "max_tokens": MAX_TOKENS,
           "ratio_vs_naive": min(m["ratio_vs_naive"] for m in ms),
           "encode_gbps_per_core": min(m["encode_gbps_per_core"] for m in ms),
           "decode_gbps_per_core": min(m["decode_gbps_per_core"] for m in ms),
           "decode_vs_store_get": min(m["decode_vs_store_get"] for m in ms),
           "greedy_match": f"{sum(int(m['greedy_match'].split('/')[0]) for m in judges)}/{args.prompts * len(judges)}",
           "max_logprob_diff": max(m["max_logprob_diff"] for m in judges)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
