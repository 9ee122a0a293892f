import random, time, pickle
from pathlib import Path
import httpx, redis as R
from kvferry.testing.stores import start_redis
from kvferry.testing.vllm_servers import OffloadServer
work = Path("/tmp/cgq/work4"); work.mkdir(parents=True, exist_ok=True)
model = str(Path.home() / ".cache/kvferry/tiny-llama")
rds = [start_redis(work), start_redis(work)]
ss = []
try:
    for cores, serde, rd in (("0", "naive", rds[0]), ("1", "cachegen", rds[1])):
        ss.append(OffloadServer(model, work, cores, work, local_cpu=False, remote_url=f"redis://127.0.0.1:{rd.port}", remote_serde=serde).start())
    for s in ss: s.wait_ready()
    rng = random.Random(7)
    p = [rng.randrange(100, 2000) for _ in range(600)]
    for s in ss:
        httpx.post(f"{s.url}/v1/completions", json={"model": s.served_name, "prompt": p, "max_tokens": 1}, timeout=300)
    time.sleep(3)
    out = []
    for rd in rds:
        c = R.Redis(port=rd.port)
        out.append({k: c.get(k) for k in c.keys("*")})
    pickle.dump(out, open("/tmp/cgq/compare.pkl", "wb"))
    print([len(o) for o in out], sorted(out[0]) == sorted(out[1]))
finally:
    for s in ss: s.stop()
    for r in rds: r.stop()
