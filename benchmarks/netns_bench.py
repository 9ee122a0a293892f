"""TTFT through the proxy across network namespaces, with and without 1 ms added on every link, and
the request/response exchanges one request makes on each link.

    python benchmarks/netns_bench.py --json [--requests 30] [--prompt-tokens 64] [--delay-ms 1]

One prefiller, one decoder and one proxy, each in a Linux network namespace of its own
(tests/netns.py; needs root and `ip`), NIXL on TCP over the veths (`UCX_TLS=tcp`), the cluster
secret on, static instance flags. Every TCP port the cluster opens to another namespace is reached
through a delay relay (tests/delay_relay.py, in this process): the prefiller's and decoder's HTTP,
the decoder's receiver init/alloc ports, and the proxy's own HTTP port (the client -> proxy link).
The relay's delay is switched per request between 0 and --delay-ms each way, so both sides take
the same path and the same machine state. Not delayed: UCX's own connections (NIXL's data plane
dials the address in the decoder's agent metadata on UCX's ports; this kernel has neither netem nor
iptables to divert them): the KV bytes themselves, and UCX's completion round trip.

The client (this process, on the bridge) sends unique random prompts one at a time, streaming
with `max_tokens` 4: TTFT is the first token (the prefiller's, which the proxy streams as soon as
the prefiller answers), `second_token` the first one the decoder produced.
`extra_round_trips_*` = (delayed - direct p50) / (2 x delay): the delayed round trips on that
path. `exchanges` counts, for one request, the request/response exchanges on each relayed link
(a response chunk after a request chunk on one connection). The decoder's link bytes (its veth's
rx while the requests ran) are compared with the KV the prompts amount to (`kv_bytes`: tokens x
every layer's K and V).
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
from tests.delay_relay import RelayThread  # noqa: E402
from tests.netns import NetnsCluster, unavailable_reason  # noqa: E402
from tests.netns_pd import (  # noqa: E402
    NsProxy,
    decoder_flag,
    kv_bytes_per_token,
    ns_env,
    place,
    prefiller_url,
    relay_pairs,
)

PROXY, PREFILLER, DECODER = range(3)


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
    ap.add_argument("--requests", type=int, default=30, help="per side (delayed, not delayed)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--delay-ms", type=float, default=1.0)
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (their folder on stderr)")
    args = ap.parse_args()
    if (why := unavailable_reason()) is not None:
        sys.exit(f"netns_bench: {why}")
    model = tiny_model.ensure()
    secret = secrets.token_urlsafe(32)
    log_dir = Path(tempfile.mkdtemp(prefix="netns-bench-"))
    net = NetnsCluster(3).up()
    servers: list = []
    proxy = relay = None
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
        # health checks once a minute: they would add exchanges to the count
        proxy = NsProxy(net, PROXY, log_dir / "proxy.log", [prefiller_url(net, p, True)], [decoder_flag(net, d, True)],
                        secret, ["--health-interval", "60"])
        links = {"client-proxy": (PROXY, [proxy.port]), "proxy-prefiller": (PREFILLER, [p.port]),
                 "proxy-decoder": (DECODER, [d.port]), "decoder receiver (init)": (DECODER, [d.init_port]),
                 "decoder receiver (alloc)": (DECODER, [d.alloc_port])}
        pairs = [pair for i, ports_ in links.values() for pair in relay_pairs(net, i, ports_)]
        relay = RelayThread(0.0, pairs)
        proxy.wait_ready()
        url = f"http://{net.delay_addr(PROXY)}:{proxy.port}"
        rng = random.Random(7)

        def one(client: httpx.Client) -> tuple[float, float, float]:
            return stream(client, url, [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)], 4)

        out: dict[str, list[tuple[float, float, float]]] = {"direct": [], "delayed": []}
        with httpx.Client() as client:
            for _ in range(3):  # warm: connections, the receiver handshake, UCX's connection
                one(client)
            relay.set_delay(args.delay_ms)
            exchanges = []
            for _ in range(3):  # one request at a time, counted alone
                relay.reset()
                one(client)
                time.sleep(0.3)  # the decoder's pages come back after the stream ends
                exchanges.append({name: relay.links[k].exchanges for k, name in enumerate(links)})
            rx0 = net.veth_bytes(DECODER)[0]
            loaded0 = prompt_tokens(d, "external_kv_transfer")
            for _ in range(args.requests):
                for name, delay in (("direct", 0.0), ("delayed", args.delay_ms)):
                    relay.set_delay(delay)
                    out[name].append(one(client))
            rx = net.veth_bytes(DECODER)[0] - rx0
            loaded = prompt_tokens(d, "external_kv_transfer") - loaded0
        tokens = 2 * args.requests * args.prompt_tokens
        kv = tokens * kv_bytes_per_token(model)
        p50 = {n: [statistics.median(x[k] for x in v) for k in range(3)] for n, v in out.items()}
        rt = 2 * args.delay_ms / 1000
        result = {
            "bench": "netns", "requests_per_side": args.requests, "prompt_tokens": args.prompt_tokens,
            "delay_ms_each_way": args.delay_ms, "ucx_tls": "tcp",
            "ttft_direct_p50_ms": round(p50["direct"][0] * 1000, 2),
            "ttft_delayed_p50_ms": round(p50["delayed"][0] * 1000, 2),
            "second_token_direct_p50_ms": round(p50["direct"][1] * 1000, 2),
            "second_token_delayed_p50_ms": round(p50["delayed"][1] * 1000, 2),
            "total_direct_p50_ms": round(p50["direct"][2] * 1000, 2),
            "total_delayed_p50_ms": round(p50["delayed"][2] * 1000, 2),
            "extra_round_trips_ttft": round((p50["delayed"][0] - p50["direct"][0]) / rt, 2),
            "extra_round_trips_second_token": round((p50["delayed"][1] - p50["direct"][1]) / rt, 2),
            "exchanges_one_request": exchanges[-1], "exchanges_all": exchanges,
            "decoder_link_rx_bytes": rx, "kv_bytes": kv, "link_over_kv": round(rx / kv, 3),
            "prompt_tokens_loaded": loaded, "prompt_tokens_sent": tokens,
            "decoder_computed_prompt_tokens": prompt_tokens(d, "local_compute"),
        }
    finally:
        if relay is not None:
            relay.stop()
        if proxy is not None:
            proxy.stop()
        for s in servers:
            s.stop(timeout=5)
        net.close()
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    if args.keep_logs:
        print(f"logs: {log_dir}", file=sys.stderr)
    else:
        import shutil
        shutil.rmtree(log_dir, ignore_errors=True)


def prompt_tokens(server, source: str) -> float:  # noqa: ANN001 - a VLLMServer
    """vllm:prompt_tokens_by_source_total for one source."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("vllm:prompt_tokens_by_source_total{") and f'source="{source}"' in ln)


if __name__ == "__main__":
    main()
