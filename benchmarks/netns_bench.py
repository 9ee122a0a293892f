"""TTFT through the proxy across network namespaces, with and without 1 ms added on every link.

    python benchmarks/netns_bench.py --json [--requests 20] [--prompt-tokens 200] [--delay-ms 1]

One prefiller, one decoder and two proxies, each vLLM server in a Linux network namespace of its
own (tests/netns.py; needs root and `ip`), NIXL on TCP over the veths (`UCX_TLS=tcp`), the cluster
secret on. Proxy `direct` (namespace 0) reaches the instances at their own addresses; proxy
`delayed` (namespace 3) at their delay addresses, where tests/delay_relay.py adds --delay-ms in
each direction to every TCP port the cluster opens to them: the prefiller's and decoder's HTTP,
the decoder's receiver init/alloc ports, and the delayed proxy's own HTTP port (the client -> proxy
link). Not delayed: UCX's own connections (NIXL's data plane; UCX dials the address in the
decoder's agent metadata on a port of its own and this kernel has no netem/iptables to divert it).

The client (this process, on the bridge) sends unique random prompts, one at a time, alternating
between the two proxies, streaming with `max_tokens` 4: TTFT is the first token (the prefiller's,
streamed as soon as it answers the proxy), `second_token` the first token the decoder produced.
`extra_round_trips_*` = (delayed - direct) / (2 x delay): how many delayed round trips sit on that
path. The decoder's link bytes (its veth's rx while the requests ran) are compared with the KV
the prompts amount to (`kv_bytes`: tokens x bytes per token of the tiny model, every layer's K and V).
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvferry.launcher import tiny_model  # noqa: E402
from kvferry.launcher.pd_instances import Decoder, Prefiller  # noqa: E402
from tests.delay_relay import start_relay  # noqa: E402
from tests.netns import NetnsCluster, unavailable_reason  # noqa: E402
from tests.netns_pd import (  # noqa: E402
    NsProxy,
    decoder_flag,
    kv_bytes_per_token,
    metric,
    ns_env,
    place,
    ports,
    prefiller_url,
    relay_pairs,
)

PROXY_DIRECT, PREFILLER, DECODER, PROXY_DELAYED = range(4)


def stream(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    """(first token, second token, end) seconds of one streaming completion through a proxy."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    marks: list[float] = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0].get("text"):
                    marks.append(time.perf_counter() - t0)
    assert len(marks) >= 2, f"{url}: {len(marks)} tokens streamed"
    return marks[0], marks[1], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=20, help="per proxy")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--delay-ms", type=float, default=1.0)
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (their folder on stderr)")
    args = ap.parse_args()
    if (why := unavailable_reason()) is not None:
        sys.exit(f"netns_bench: {why}")
    model = tiny_model.ensure()
    secret = secrets.token_urlsafe(32)
    log_dir = Path(tempfile.mkdtemp(prefix="netns-bench-"))
    net = NetnsCluster(4).up()
    servers, proxies, relays = [], [], []
    try:
        srv = {"env": ns_env(secret), "die_with_parent": True}
        p = place(Prefiller(str(model), log_dir, "0", log_dir, server=srv), net, PREFILLER)
        d = place(Decoder(str(model), log_dir, "1", log_dir, server=srv, host=net.addr(DECODER),
                          pd_kv_ready_timeout=6.0), net, DECODER)
        servers = [p, d]
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout=400)
        direct = NsProxy(net, PROXY_DIRECT, log_dir / "proxy-direct.log", [prefiller_url(net, p)],
                         [decoder_flag(net, d)], secret)
        delayed = NsProxy(net, PROXY_DELAYED, log_dir / "proxy-delayed.log", [prefiller_url(net, p, True)],
                          [decoder_flag(net, d, True)], secret)
        proxies = [direct, delayed]
        pairs = (relay_pairs(net, PREFILLER, ports(p)) + relay_pairs(net, DECODER, ports(d))
                 + relay_pairs(net, PROXY_DELAYED, [delayed.port]))
        relays.append(start_relay(args.delay_ms, pairs, log_dir / "relay.log"))
        for px in proxies:
            px.wait_ready()
        rng = random.Random(7)
        urls = {"direct": direct.url, "delayed": f"http://{net.delay_addr(PROXY_DELAYED)}:{delayed.port}"}
        out: dict[str, list[tuple[float, float, float]]] = {"direct": [], "delayed": []}
        with httpx.Client() as client:
            for url in urls.values():  # warm: handshakes, first NIXL connection, compile
                for _ in range(2):
                    stream(client, url, [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)], 4)
            rx0 = net.veth_bytes(DECODER)[0]
            loaded0 = metric(d, "vllm:prompt_tokens_by_source_total")
            for _ in range(args.requests):
                for name, url in urls.items():
                    pr = [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)]
                    out[name].append(stream(client, url, pr, 4))
            rx = net.veth_bytes(DECODER)[0] - rx0
        tokens = 2 * args.requests * args.prompt_tokens
        kv = tokens * kv_bytes_per_token(model)
        p50 = {n: [statistics.median(x[k] for x in v) for k in range(3)] for n, v in out.items()}
        rt = 2 * args.delay_ms / 1000
        result = {
            "bench": "netns", "requests_per_proxy": args.requests, "prompt_tokens": args.prompt_tokens,
            "delay_ms_each_way": args.delay_ms, "ucx_tls": "tcp",
            "ttft_direct_p50_ms": round(p50["direct"][0] * 1000, 2),
            "ttft_delayed_p50_ms": round(p50["delayed"][0] * 1000, 2),
            "second_token_direct_p50_ms": round(p50["direct"][1] * 1000, 2),
            "second_token_delayed_p50_ms": round(p50["delayed"][1] * 1000, 2),
            "total_direct_p50_ms": round(p50["direct"][2] * 1000, 2),
            "total_delayed_p50_ms": round(p50["delayed"][2] * 1000, 2),
            "extra_round_trips_ttft": round((p50["delayed"][0] - p50["direct"][0]) / rt, 2),
            "extra_round_trips_second_token": round((p50["delayed"][1] - p50["direct"][1]) / rt, 2),
            "decoder_link_rx_bytes": rx, "kv_bytes": kv, "link_over_kv": round(rx / kv, 3),
            "decoder_prompt_tokens_seen": metric(d, "vllm:prompt_tokens_by_source_total") - loaded0,
            "decoder_computed_prompt_tokens": 0.0,
        }
        src = httpx.get(f"{d.url}/metrics", timeout=10).text
        result["decoder_computed_prompt_tokens"] = sum(
            float(ln.rsplit(" ", 1)[1]) for ln in src.splitlines()
            if ln.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in ln)
    finally:
        for r in relays:
            r.kill()
            r.wait(5)
        for px in proxies:
            px.stop()
        for s in servers:
            s.stop(timeout=5)
        net.close()
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    if args.keep_logs:
        print(f"logs: {log_dir}", file=sys.stderr)
    else:
        import shutil
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
