"""Quick experiment: greedy answers from cachegen remote hits vs cold, tiny llama, 2 vLLMs on redis."""
import json, random, sys, time
from pathlib import Path
import httpx
from kvferry.testing.stores import start_redis
from kvferry.testing.vllm_servers import OffloadServer

work = Path("/tmp/cgq/work"); work.mkdir(parents=True, exist_ok=True)
model = str(Path.home() / ".cache/kvferry/tiny-llama")
serde = sys.argv[1] if len(sys.argv) > 1 else "cachegen"
redis = start_redis(work)
url = f"redis://127.0.0.1:{redis.port}"
servers = []
def comp(s, p, n=16):
    r = httpx.post(f"{s.url}/v1/completions", json={"model": s.served_name, "prompt": p, "max_tokens": n,
                   "temperature": 0, "return_token_ids": True, "logprobs": 1}, timeout=300)
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]
try:
    for cores in ("0", "1"):
        s = OffloadServer(model, work, cores, work, local_cpu=False, remote_url=url, remote_serde=serde)
        servers.append(s.start())
    for s in servers:
        s.wait_ready()
    rng = random.Random(7)
    match, n, worst = 0, 0, 0.0
    for i in range(8):
        p = [rng.randrange(100, 2000) for _ in range(rng.choice([300, 600, 1000]))]
        cold = comp(servers[0], p)
        time.sleep(2)  # puts are asynchronous
        hit = comp(servers[1], p)
        n += 1
        match += cold[0] == hit[0]
        k = 0
        while k < len(cold[0]) and cold[0][k] == hit[0][k]:
            k += 1
        d = max((abs(a - b) for a, b in zip(cold[1][:k], hit[1][:k])), default=0.0)
        worst = max(worst, d)
        print(json.dumps({"prompt": i, "len": len(p), "same": cold[0] == hit[0], "agree_prefix": k,
                          "max_logprob_diff_agreeing": round(d, 4)}), flush=True)
    log = servers[1].log_path.read_text(errors="replace")
    print("remote loads:", log.count("from remote"), "match", match, "/", n, "worst", worst)
finally:
    for s in servers:
        s.stop()
    redis.stop()
