"""kvferry's offload tiers in the routing view, without a vLLM server: the planner logs what its
CPU tier admits and evicts, the connector turns that into vLLM's own KV events (vLLM's structs
and msgpack encoding, as its publisher sends them), and the proxy's index counts those chunks
per medium, split into vLLM-sized blocks, with the GPU and CPU copies of the same tokens
removed independently."""

from __future__ import annotations

import msgspec
import pytest

from kvferry.common.config import load_config
from kvferry.engine.offload.ops import GB
from kvferry.engine.offload.planner import OffloadPlanner
from kvferry.engine.offload.tier_events import ChunkRemoved, ChunkStored, TierEventLog
from kvferry.proxy.instance_flags import InstanceSpec
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing.cache import CacheView, choose, effective
from kvferry.proxy.routing.instances import Instance
from kvferry.proxy.routing.kv_event_subscription import KVEventSubscription
from kvferry.proxy.routing.prefix_index import CPU, DISK, GPU, PrefixIndex, prefix_keys

kv = pytest.importorskip("vllm.distributed.kv_events")
to_vllm = pytest.importorskip("kvferry.connector.vllm_kv_events").to_vllm

BS, CHUNK, BLOCK_BYTES = 16, 32, 1024  # vLLM blocks of 16 tokens, kvferry chunks of two blocks
TOKENS = list(range(500, 500 + 2 * CHUNK + 5))  # two full chunks and a partial one


def planner(chunks_fit: float) -> OffloadPlanner:
    cfg = load_config({"local_cpu": True, "chunk_size": CHUNK,
                       "max_local_cpu_size": chunks_fit * 2 * BLOCK_BYTES / GB}, env={})
    return OffloadPlanner(cfg, b"salt", BS, BLOCK_BYTES, tier_events=True)


def gpu_stored(tokens: list[int], first_hash: int = 1) -> kv.BlockStored:
    n = len(tokens) // BS
    return kv.BlockStored(block_hashes=list(range(first_hash, first_hash + n)), parent_block_hash=None,
                          token_ids=tokens[:n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)


class Feed:
    """A proxy KVEventSubscription fed with batches encoded as vLLM's publisher encodes them."""

    def __init__(self) -> None:
        self.stream = KVEventSubscription("test", "ipc:///nonexistent", None, PrefixIndex(1000), stale_after=10.0)
        self.seq = 0
        self.enc = msgspec.msgpack.Encoder()

    def send(self, events: list) -> None:
        self.stream.apply(self.seq, self.enc.encode(kv.KVEventBatch(ts=0.0, events=events)))
        self.seq += 1

    def held(self) -> dict[str, int]:
        return self.stream.index.cached(prefix_keys(TOKENS, BS))


def test_the_planner_logs_whole_chunks_it_stores_and_every_chunk_it_evicts() -> None:
    plan = planner(chunks_fit=2.25)  # the partial third chunk (one block) evicts the first
    plan.store("r", TOKENS, list(range(5)))
    keys = plan.keys(TOKENS)
    evs = plan.take_events()
    assert evs == [ChunkStored("cpu", keys[0], None, tuple(TOKENS[:CHUNK])),
                   ChunkStored("cpu", keys[1], keys[0], tuple(TOKENS[CHUNK:2 * CHUNK])),
                   ChunkRemoved("cpu", keys[0])]  # the partial chunk is stored but not announced
    assert plan.take_events() == []
    plan.forget({"cpu": {keys[1]}})  # a worker found it missing
    assert plan.take_events() == [ChunkRemoved("cpu", keys[1])]
    quiet = OffloadPlanner(load_config({"local_cpu": True, "chunk_size": CHUNK}, env={}), b"salt", BS, BLOCK_BYTES)
    quiet.store("r", TOKENS, list(range(5)))
    assert quiet.take_events() == []  # vLLM publishes no KV events: nothing is recorded


def test_the_connector_announces_chunks_as_cpu_blocks_of_chunk_size_tokens() -> None:
    plan = planner(chunks_fit=4)
    plan.store("r", TOKENS, list(range(5)))
    keys = plan.keys(TOKENS)
    out = to_vllm(plan.take_events() + [ChunkRemoved("remote", keys[0])], CHUNK)
    assert [type(e).__name__ for e in out] == ["BlockStored", "BlockStored"]  # no medium for "remote"
    assert out[1].block_hashes == [keys[1]] and out[1].parent_block_hash == keys[0]
    assert out[1].token_ids == TOKENS[CHUNK:2 * CHUNK] and out[1].block_size == CHUNK and out[1].medium == "CPU"
    assert to_vllm([ChunkRemoved("disk", keys[0])], CHUNK)[0].medium == "DISK"


def test_the_proxy_counts_cpu_chunks_and_keeps_gpu_and_cpu_copies_apart() -> None:
    plan, feed = planner(chunks_fit=4), Feed()
    feed.send([gpu_stored(TOKENS)])  # vLLM's prefix cache: four blocks
    plan.store("r", TOKENS, list(range(5)))
    feed.send(to_vllm(plan.take_events(), CHUNK))  # the CPU tier: two chunks = the same four blocks
    assert feed.held() == {GPU: 4 * BS, CPU: 0, DISK: 0}
    feed.send([kv.BlockRemoved(block_hashes=[3, 4], medium="GPU")])  # the GPU evicts the second chunk's blocks
    assert feed.held() == {GPU: 2 * BS, CPU: 2 * BS, DISK: 0}  # ... its CPU copy still counts
    feed.send([kv.AllBlocksCleared()])  # vLLM's /reset_prefix_cache: its GPU cache only
    assert feed.held() == {GPU: 0, CPU: 4 * BS, DISK: 0}
    feed.send([gpu_stored(TOKENS, first_hash=10)])
    plan.forget({"cpu": set(plan.keys(TOKENS)[:2])})
    feed.send(to_vllm(plan.take_events(), CHUNK))  # the CPU copies go; the GPU's stay
    assert feed.held() == {GPU: 4 * BS, CPU: 0, DISK: 0}
    assert feed.stream.index.orphans == 0


def test_a_chunk_whose_size_does_not_split_into_the_instances_blocks_is_a_counted_bad_event() -> None:
    counts: dict[str, int] = {}
    feed = Feed()
    feed.stream.count = lambda result, n=1: counts.__setitem__(result, counts.get(result, 0) + n)
    feed.send([gpu_stored(TOKENS)])
    odd = kv.BlockStored(block_hashes=[b"k" * 16], parent_block_hash=None, token_ids=TOKENS[:24], block_size=24,
                         lora_id=None, medium="CPU", lora_name=None)
    feed.send([odd])
    assert counts == {"applied": 1, "bad": 1} and feed.held()[GPU] == 4 * BS


def test_a_tier_copy_is_worth_less_than_a_gpu_copy_but_more_than_nothing() -> None:
    assert effective({GPU: 100}) > effective({CPU: 100}) > effective({DISK: 100}) > effective({}) == 0
    assert effective({CPU: 100}) >= 50  # loading is cheap next to computing


def test_a_prompt_goes_to_a_gpu_copy_before_a_cpu_copy_and_to_a_cpu_copy_before_none() -> None:
    gpu, cpu, none = Feed(), Feed(), Feed()
    gpu.send([gpu_stored(TOKENS)])
    plan = planner(chunks_fit=4)
    plan.store("r", TOKENS, list(range(5)))
    cpu.send(to_vllm(plan.take_events(), CHUNK))
    none.send([])
    opts = ProxyOptions()
    view = CacheView(opts, None)  # type: ignore[arg-type]  # metrics are only used by add()
    view.streams = {"p0": gpu.stream, "p1": cpu.stream, "p2": none.stream, "d3": none.stream}

    def inst(iid: str, role: str = "prefiller", queued: int = 0) -> Instance:
        i = Instance(InstanceSpec(role, f"http://127.0.0.1:{1000 + int(iid[1:])}"), iid)
        i.queued_tokens = queued
        return i
    p0, p1, p2, d = inst("p0"), inst("p1"), inst("p2"), inst("d3", "decoder")
    for _ in range(5):
        assert choose(view, opts, [d], [p0, p1, p2], TOKENS, len(TOKENS)).prefiller is p0
        r = choose(view, opts, [d], [p1, p2], TOKENS, len(TOKENS))
        assert (r.prefiller, r.reason, r.predicted) == (p1, "cache_hit", 4 * BS)
    p0.queued_tokens = 10  # a little busier: loading from the CPU tier is cheaper than waiting
    assert choose(view, opts, [d], [p0, p1, p2], TOKENS, len(TOKENS)).prefiller is p1


def test_the_event_log_is_bounded() -> None:
    log = TierEventLog(max_pending=3)
    for i in range(5):
        log.removed("cpu", bytes([i]))
    assert len(log) == 3 and log.dropped == 2 and log.take()[0] == ChunkRemoved("cpu", bytes([2]))
