"""The proxy's cache view against vLLM's own KV event publisher (vllm.distributed.kv_events, real
ZMQ, no server): the index follows BlockStored / BlockRemoved / AllBlocksCleared, a restarted
publisher clears it, a stalled one is routed by load, hostile frames are counted and skipped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvferry.proxy.instance_flags import InstanceSpec, OptionError
from kvferry.proxy.options import ProxyOptions, parse
from kvferry.proxy.routing.cache import CacheView, choose, local_reason
from kvferry.proxy.routing.instances import Instance
from kvferry.proxy.routing.kv_event_subscription import KVEventSubscription
from kvferry.proxy.routing.prefix_index import PrefixIndex, prefix_keys
from tests.kv_event_helpers import replay_holds
from tests.polling import until_async

kv = pytest.importorskip("vllm.distributed.kv_events")

BS = 16
DOC = list(range(1000, 1000 + 5 * BS))  # five full blocks


def stored(tokens: list[int], first_hash: int = 1, parent: int | None = None) -> kv.BlockStored:
    n = len(tokens) // BS
    return kv.BlockStored(block_hashes=list(range(first_hash, first_hash + n)), parent_block_hash=parent,
                          token_ids=tokens[:n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)


def publisher(tmp: Path) -> kv.ZmqEventPublisher:
    return kv.ZmqEventPublisher(0, endpoint=f"ipc://{tmp}/ev.sock", replay_endpoint=f"ipc://{tmp}/replay.sock")


class Counts(dict):
    def __call__(self, result: str, n: int = 1) -> None:
        self[result] = self.get(result, 0) + n


@pytest.fixture
def stream(tmp_path: Path) -> Iterator[tuple[KVEventSubscription, Counts]]:
    counts = Counts()
    s = KVEventSubscription("prefiller test", f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock",
                    PrefixIndex(1000), stale_after=1.0, counter=counts)
    yield s, counts
    s.close()


def test_index_follows_stored_removed_and_cleared() -> None:
    idx = PrefixIndex(max_blocks=100)
    idx.stored(None, [11, 12], DOC[:2 * BS], BS)
    idx.stored(12, [13], DOC[2 * BS:3 * BS], BS)  # a child of block 12: the chain goes on
    keys = prefix_keys(DOC, BS)
    assert idx.cached_tokens(keys) == 3 * BS
    assert idx.cached_tokens(prefix_keys([7] + DOC, BS)) == 0  # another prefix shares nothing
    idx.removed([12])
    assert idx.cached_tokens(keys) == BS  # a hole ends the prefix
    assert idx.stored(999, [14], DOC[3 * BS:4 * BS], BS) == 0 and idx.orphans == 1  # unknown parent
    idx.clear()
    assert idx.cached_tokens(keys) == 0 and len(idx) == 0


def test_index_memory_is_bounded() -> None:
    idx = PrefixIndex(max_blocks=3)
    idx.stored(None, list(range(1, 6)), DOC, BS)
    assert len(idx) == 3
    with pytest.raises(ValueError):
        idx.stored(None, [1, 2], DOC[:BS], BS)  # fewer tokens than blocks: rejected, not applied


def test_events_from_vllms_publisher_fill_the_index_and_a_restart_clears_it(tmp_path: Path, stream) -> None:
    s, counts = stream

    async def go() -> None:
        pub = publisher(tmp_path)
        task = asyncio.ensure_future(s.run(probe_interval=0.2))
        try:
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored(DOC)]))
            await until_async(lambda: len(s.index) == 5)
            assert s.index.cached_tokens(prefix_keys(DOC, BS)) == 5 * BS
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[kv.BlockRemoved(block_hashes=[5], medium="GPU")]))
            await until_async(lambda: len(s.index) == 4)
            pub.shutdown()
            # The instance comes back empty: a new publisher, its seq from 0 again.
            pub = publisher(tmp_path)
            await until_async(lambda: len(s.index) == 0)
            assert counts.get("reset", 0) >= 1
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored(DOC[:2 * BS], 50)]))
            await until_async(lambda: len(s.index) == 2)
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[kv.AllBlocksCleared()]))
            await until_async(lambda: len(s.index) == 0)
            assert s.fresh
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.shutdown()
    asyncio.run(go())


def test_events_published_before_the_proxy_started_are_replayed(tmp_path: Path, stream) -> None:
    s, _ = stream

    async def go() -> None:
        pub = publisher(tmp_path)
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored(DOC)]))
        await until_async(lambda: replay_holds(f"ipc://{tmp_path}/replay.sock") == 1, what="the batch published")
        task = asyncio.ensure_future(s.run(probe_interval=0.2))
        try:
            await until_async(lambda: len(s.index) == 5)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.shutdown()
    asyncio.run(go())


def inst(iid: str, role: str = "prefiller", queued: int = 0) -> Instance:
    i = Instance(InstanceSpec(role, f"http://127.0.0.1:{1000 + int(iid[1:])}"), iid)
    i.queued_tokens = queued
    return i


def test_a_stalled_stream_is_routed_by_load(tmp_path: Path, stream) -> None:
    """p0 holds the prompt but is busier; while its events flow it wins on cost, once they stop
    it is routed by load (p1), with the reason counted."""
    s, _ = stream
    opts = ProxyOptions()
    p0, p1, d0 = inst("p0", queued=100), inst("p1", queued=50), inst("d2", "decoder")

    view_self = CacheView(opts, None)  # type: ignore[arg-type]  # metrics are only used by add()
    view_self.streams = {"p0": s}
    prompt = DOC + [5, 6, 7]

    async def go() -> None:
        pub = publisher(tmp_path)
        task = asyncio.ensure_future(s.run(probe_interval=0.2))
        try:
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored(DOC)]))
            await until_async(lambda: len(s.index) == 5)
            r = choose(view_self, opts, [d0], [p0, p1], prompt, len(prompt))
            assert (r.prefiller, r.reason, r.predicted) == (p0, "cache_hit", 5 * BS)
            pub.shutdown()  # the publisher stops answering: no events, no replay
            await until_async(lambda: not s.fresh, timeout=5)
            r = choose(view_self, opts, [d0], [p0, p1], prompt, len(prompt))
            assert (r.prefiller, r.reason) == (p1, "stale_events")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(go())


def test_hostile_frames_are_counted_and_skipped(tmp_path: Path, stream) -> None:
    s, counts = stream
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # a PUB that says when a subscription arrives: what it sends before is lost
    pub.bind(f"ipc://{tmp_path}/ev.sock")

    async def go() -> None:
        task = asyncio.ensure_future(s.run(probe_interval=0.2))
        try:
            await until_async(lambda: pub.poll(0), what="the subscription to reach the publisher")
            assert pub.recv() == b"\x01"  # subscribe to everything
            pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1garbage"])
            pub.send_multipart([b"one frame"])
            batch = [time.time(), [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                                    "token_ids": [1] * 3, "block_size": BS}]]  # fewer tokens than blocks
            pub.send_multipart([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
            good = [time.time(), [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                                   "token_ids": DOC[:BS], "block_size": BS, "lora_id": None, "medium": "GPU"}]]
            pub.send_multipart([b"", (2).to_bytes(8, "big"), msgspec.msgpack.encode(good)])
            await until_async(lambda: len(s.index) == 1)
            assert counts.get("bad", 0) >= 3
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.destroy(linger=0)
    asyncio.run(go())


def test_local_prefill_rules() -> None:
    opts = ProxyOptions(local_prefill_tokens=32)
    d = inst("d0", "decoder")
    assert local_reason(opts, d, None, list(range(20)), 20) == "local_short"
    assert local_reason(opts, d, 0, list(range(200)), 200) is None
    assert local_reason(opts, d, 192, list(range(200)), 200) == "local_short"  # 8 uncached tokens
    opts.local_prefill_tokens = 0
    assert local_reason(opts, d, 190, list(range(200)), 200) == "local_cached"  # >= 0.9 held
    assert local_reason(opts, d, 100, list(range(200)), 200) is None
    opts.local_prefill_fraction = 2.0
    assert local_reason(opts, d, 200, list(range(200)), 200) is None


def test_kv_events_flags_name_the_mistake() -> None:
    base = ["--prefiller", "http://127.0.0.1:7100", "--decoder", "http://127.0.0.1:7200,7300,7400"]
    o = parse(base + ["--kv-events", "http://127.0.0.1:7100=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"])
    assert o.kv_events == {"http://127.0.0.1:7100": ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")}
    assert o.policy == "cache"
    with pytest.raises(OptionError, match="not a --prefiller or --decoder"):
        parse(base + ["--kv-events", "http://127.0.0.1:9=tcp://127.0.0.1:5557"])
    with pytest.raises(OptionError, match="--kv-events: expected"):
        parse(base + ["--kv-events", "http://127.0.0.1:7100=tcp://*:5557"])
    with pytest.raises(OptionError, match="--local-prefill-tokens"):
        parse(base + ["--local-prefill-tokens", "-1"])


def test_a_closed_stream_ends_its_loop_quietly(tmp_path: Path) -> None:
    """An instance removed through /admin: its stream's loop ends instead of being restarted."""
    s = KVEventSubscription("decoder gone", f"ipc://{tmp_path}/none.sock", f"ipc://{tmp_path}/none-r.sock",
                    PrefixIndex(10), stale_after=1.0)

    async def go() -> None:
        task = asyncio.ensure_future(s.run(probe_interval=0.1))
        await asyncio.sleep(0.3)  # a sleep (pacing): the loop runs a few probes, then is closed under it
        s.close()
        await asyncio.wait_for(task, 5)  # returns: no exception for the supervisor to restart
    asyncio.run(go())


def test_long_prompts_are_tokenized_off_the_event_loop(tiny_model_path: Path) -> None:
    """A long text prompt's tokens for routing come from a thread (the loop serves others
    meanwhile); a short one's from the loop itself; the same tokens either way."""
    import threading

    from kvferry.proxy.routing.tokens import OFF_LOOP_CHARS, PromptTokens
    tok = PromptTokens(str(tiny_model_path))
    threads: list[int] = []
    real = tok._tok
    real_fast = tok._encode_fast  # encode_batch_fast where the tokenizers library has it

    class Spy:
        def encode(self, text: str, add_special_tokens: bool = True):
            threads.append(threading.get_ident())
            return real.encode(text, add_special_tokens=add_special_tokens)

    def fast(texts: list[str], add_special_tokens: bool = True):
        threads.append(threading.get_ident())
        return real_fast(texts, add_special_tokens=add_special_tokens)
    tok._tok = Spy()
    if real_fast is not None:
        tok._encode_fast = fast
    long_text, short_text = "word " * (OFF_LOOP_CHARS // 4), "a short prompt"

    async def run() -> tuple[list[int] | None, list[int] | None]:
        return await tok.completion_async(long_text), await tok.completion_async(short_text)
    long_ids, short_ids = asyncio.run(run())
    here = threading.get_ident()
    assert threads[0] != here and threads[1] == here
    tok._tok, tok._encode_fast = real, real_fast
    assert long_ids == tok.completion(long_text) and short_ids == tok.completion(short_text)
    # The fast path's ids are encode()'s, with and without special tokens.
    for text in (long_text, short_text, "émigré 中文 😀 <s> x"):
        assert tok.completion(text) == real.encode(text).ids
        assert list(tok._encode_text(text, False)) == real.encode(text, add_special_tokens=False).ids
