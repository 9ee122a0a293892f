"""A real kv_both vLLM CPU server with kvferry's CPU tier and KV events on: the connector's
`take_events` rides vLLM's own event stream, and the proxy's event stream and prefix index
(kvferry.proxy, real ZMQ) count the prompt's chunks as held in the CPU tier, which outlive a
reset of vLLM's own prefix cache."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.proxy.routing.kv_event_subscription import KVEventSubscription
from kvferry.proxy.routing.prefix_index import CPU, GPU, PrefixIndex, prefix_keys
from kvferry.testing.vllm_servers import OffloadServer
from tests.pd_helpers import completion
from tests.polling import until_async

pytestmark = pytest.mark.vllm

BLOCK, CHUNK = 128, 256  # vLLM-CPU's block size for the tiny model; kvferry's chunk
PROMPT = [random.Random(23).randrange(10, 4000) for _ in range(600)]  # two full chunks, four full blocks


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    tmp = tmp_path_factory.mktemp("tier-events")
    pub, replay = f"ipc://{tmp}/ev.sock", f"ipc://{tmp}/replay.sock"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    s = OffloadServer(str(tiny_model_path), log_dir, "1", tmp, local_cpu=True, max_local_cpu_size=0.15,
                      chunk_size=CHUNK, server={"extra_args": ["--kv-events-config", json.dumps(events)],
                                                "env": {"VLLM_SERVER_DEV_MODE": "1"}})
    s.start()
    try:
        s.wait_ready()
        yield s, pub, replay
    finally:
        s.stop()


def test_the_cpu_tiers_chunks_reach_the_proxys_index_and_outlive_a_prefix_cache_reset(server: tuple) -> None:
    s, pub, replay = server
    counts: dict[str, int] = {}
    stream = KVEventSubscription("kv_both test", pub, replay, PrefixIndex(10_000), stale_after=30.0,
                         counter=lambda r, n=1: counts.__setitem__(r, counts.get(r, 0) + n))
    keys = prefix_keys(PROMPT, BLOCK)

    def held(what: str):
        return lambda: f"{what}: {stream.index.cached(keys)} {counts}"

    async def main() -> None:
        task = asyncio.create_task(stream.run(probe_interval=1.0))
        try:
            await asyncio.to_thread(completion, s, PROMPT, 2)
            await until_async(lambda: (h := stream.index.cached(keys))[GPU] == 4 * BLOCK and h[CPU] == 0, 30.0,
                              held("the GPU blocks and CPU chunks"), every=0.1)
            assert stream.index.block_size == BLOCK  # chunks were split into vLLM's blocks
            assert len(stream.index) == 4  # the GPU and the CPU copies of the same tokens share keys
            r = await asyncio.to_thread(httpx.post, s.url + "/reset_prefix_cache", timeout=30)
            assert r.status_code == 200
            # vLLM publishes a step's events at its end: one short request lets it step.
            await asyncio.to_thread(completion, s, [7, 8, 9], 1)
            await until_async(lambda: (h := stream.index.cached(keys))[GPU] == 0 and h[CPU] == 2 * CHUNK, 30.0,
                              held("the GPU reset, the CPU copies kept"), every=0.1)
            assert counts.get("bad", 0) == 0 and stream.index.orphans == 0, counts
        finally:
            stream.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
