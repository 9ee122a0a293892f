"""The remote tier against real stores (redis-server, Redis Sentinel, kvferry-server): the
naive and zstd serde, round trips, per-rank keys, and a store that is down, slow, damaged or
failing over, which must turn into bounded misses, never an error or a wait."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvferry.common import secret
from kvferry.common.netutil import free_port
from kvferry.engine.remote.backends import parse_url
from kvferry.engine.remote.serde import HEADER_BYTES, ChunkShape, Serde, SerdeError
from kvferry.engine.tiers.remote import PREFIX, RemoteError, RemoteTier
from kvferry.testing.store_servers import start_lm_server, start_redis, start_sentinel
from tests.polling import until

SHAPE = ChunkShape(torch.bfloat16, num_layers=2, num_kv_heads=2, head_size=16, layout_digest=b"L" * 16)
TOKENS = 64
NBYTES = 2 * 2 * TOKENS * 2 * 16 * 2  # layers, K/V, tokens, heads, head size, bf16


def chunk(seed: int, n: int = NBYTES) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["naive", "zstd"])
def test_serde_round_trip(name: str) -> None:
    s = Serde(name, SHAPE)
    data = torch.zeros(NBYTES, dtype=torch.uint8)
    data[::7] = 5  # compressible
    head, payload = s.encode(data, TOKENS)
    assert len(head) == HEADER_BYTES
    if name == "zstd":
        assert len(payload) < NBYTES / 4
    assert torch.equal(s.decode(head, bytes(payload), TOKENS, NBYTES), data)


@pytest.mark.parametrize("damage", ["payload_bit", "truncated", "other_layout", "other_shape", "other_dtype",
                                    "not_kvferry", "short_header"])
def test_serde_rejects_what_is_not_this_readers_chunk(damage: str) -> None:
    s = Serde("naive", SHAPE)
    data = chunk(1)
    head, payload = s.encode(data, TOKENS)
    payload = bytearray(payload)
    reader, tokens = s, TOKENS
    if damage == "payload_bit":
        payload[100] ^= 1
    elif damage == "truncated":
        payload = payload[:-1]
    elif damage == "other_layout":
        reader = Serde("naive", ChunkShape(torch.bfloat16, 2, 2, 16, b"M" * 16))
    elif damage == "other_shape":
        reader = Serde("naive", ChunkShape(torch.bfloat16, 2, 4, 8, b"L" * 16))
    elif damage == "other_dtype":
        reader = Serde("naive", ChunkShape(torch.float16, 2, 2, 16, b"L" * 16))
    elif damage == "not_kvferry":
        head = b"XXXX" + head[4:]
    elif damage == "short_header":
        head = head[:10]
    with pytest.raises(SerdeError):
        reader.decode(head, bytes(payload), tokens, NBYTES)


def test_zstd_damage_is_a_serde_error() -> None:
    s = Serde("zstd", SHAPE)
    head, payload = s.encode(chunk(2), TOKENS)
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(SerdeError):
        s.decode(head, bytes(bad), TOKENS, NBYTES)


@pytest.mark.parametrize("url,fix", [
    ("infinistore://h:1", "RDMA only"), ("memcache://h:1", "use redis://"), ("redis://nohost", "not host:port"),
    ("redis://a:1,b:2", "takes one host:port"), ("lm://h:70000", "not host:port")])
def test_bad_urls_name_the_fix(url: str, fix: str) -> None:
    with pytest.raises(RemoteError, match=fix):
        parse_url(url)


@pytest.fixture(params=["redis", "lm"])
def store(request, tmp_path: Path, redis_available) -> Iterator[str]:
    """A real store; yields its remote_url."""
    p = start_redis(tmp_path) if request.param == "redis" else start_lm_server(tmp_path)
    try:
        yield f"{request.param}://{p.url_hostport}"
    finally:
        p.stop()


def test_round_trip_exists_and_ranks(store: str) -> None:
    w0 = RemoteTier(store, 2.0, Serde("naive", SHAPE), rank=0)
    w1 = RemoteTier(store, 2.0, Serde("naive", SHAPE), rank=1)
    sched = RemoteTier(store, 1.0)  # the scheduler's: lookups only
    a, b = chunk(1), chunk(2)
    assert w0.put(b"A" * 16, a, TOKENS) and w1.put(b"A" * 16, b, TOKENS)
    assert w0.flush(10) and w1.flush(10)
    assert torch.equal(w0.get(b"A" * 16, TOKENS, NBYTES), a)
    assert torch.equal(w1.get(b"A" * 16, TOKENS, NBYTES), b)  # each rank its own shard
    assert w0.get(b"B" * 16, TOKENS, NBYTES) is None
    assert sched.exists([b"A" * 16, b"B" * 16]) == [True, False]
    assert w0.stats()["stored_chunks|remote"] == 1 and w0.stats()["remote_errors"] == 0
    for t in (w0, w1, sched):
        t.close()


def test_lm_with_the_cluster_secret_and_clients_without_it(tmp_path: Path, kvf_logs) -> None:
    path = tmp_path / "secret"
    secret.write_file(str(path), "a-cluster-secret-of-32-characters")
    p = start_lm_server(tmp_path, secret_file=path)
    url = f"lm://{p.url_hostport}"
    good = RemoteTier(url, 2.0, Serde("naive", SHAPE), secret=secret.from_file(str(path), "test"))
    plain = RemoteTier(url, 2.0, Serde("naive", SHAPE))
    try:
        assert good.put(b"A" * 16, chunk(1), TOKENS) and good.flush(10)
        assert torch.equal(good.get(b"A" * 16, TOKENS, NBYTES), chunk(1))
        # Without the secret: misses and a counted error naming the fix, never the data.
        assert plain.exists([b"A" * 16]) == [False]
        assert plain.stats()["remote_errors"] == 1
        assert "set cluster_secret_file" in kvf_logs.text
        time.sleep(1.1)  # a sleep (pacing): past the 1 s back-off the test set, its put is tried, and refused
        assert plain.put(b"B" * 16, chunk(2), TOKENS) and plain.flush(10)
        assert plain.stats()["stored_chunks|remote"] == 0 and plain.stats()["remote_errors"] == 2
        assert good.exists([b"A" * 16, b"B" * 16]) == [True, False]
    finally:
        good.close()
        plain.close()
        p.stop()


def test_a_damaged_value_is_a_counted_miss(tmp_path: Path, redis_available) -> None:
    p = start_redis(tmp_path)
    try:
        t = RemoteTier(f"redis://{p.url_hostport}", 2.0, Serde("naive", SHAPE))
        t.put(b"K" * 16, chunk(3), TOKENS)
        assert t.flush(10)
        r = redis.Redis(port=p.port)
        data = bytearray(r.get(PREFIX + b"K" * 16 + b":d"))
        data[5] ^= 1
        r.set(PREFIX + b"K" * 16 + b":d", bytes(data))
        assert t.get(b"K" * 16, TOKENS, NBYTES) is None
        assert t.stats()["remote_corrupt"] == 1
        t.close()
    finally:
        p.stop()


def test_a_dead_store_is_misses_without_waiting_then_comes_back(tmp_path: Path, redis_available, kvf_logs) -> None:
    """53 calls against a closed port: each is a miss at once (the timeout, 60 s, is far from what
    they take), and the back-off (1 s, then 2, 4, ...) keeps nearly all of them from trying."""
    port = free_port()
    t = RemoteTier(f"redis://127.0.0.1:{port}", 60.0, Serde("naive", SHAPE))
    t0 = time.monotonic()
    assert t.exists([b"A" * 16]) == [False]
    assert t.get(b"A" * 16, TOKENS, NBYTES) is None  # backed off: not even tried
    assert not t.put(b"A" * 16, chunk(1), TOKENS)
    for _ in range(50):
        t.exists([b"A" * 16])
    assert time.monotonic() - t0 < 30.0  # no call waited for the store's 60 s timeout
    s = t.stats()
    # One try per back-off period: one, unless this thread stalled past the first second.
    assert 1 <= s["remote_errors"] <= 3 and s["remote_put_dropped"] == 1, s
    warnings = [r for r in kvf_logs.records if "treating it as empty" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited to one per 10 s
    p = start_redis(tmp_path, port=port)
    try:
        # Puts are dropped until the back-off ends; then one is taken.
        until(lambda: t.put(b"A" * 16, chunk(1), TOKENS), 60, "a put taken once the store is back", every=0.2)
        assert t.flush(10)
        assert t.exists([b"A" * 16]) == [True]
        assert any("answers again" in r.getMessage() for r in kvf_logs.records)
        t.close()
    finally:
        p.stop()


def test_a_silent_store_is_a_miss_within_the_timeout() -> None:
    """A store that accepts connections and never answers (a hung server, a black-holed route)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    port = lsock.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except TimeoutError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        for scheme in ("redis", "lm"):
            # 0.5 s is the test's own timer; a get without it would wait for ever, so the wait
            # for its miss is bounded far from 0.5 s.
            t = RemoteTier(f"{scheme}://127.0.0.1:{port}", 0.5, Serde("naive", SHAPE))
            got: list[object] = []
            call = threading.Thread(target=lambda t=t, got=got: got.append(t.get(b"A" * 16, TOKENS, NBYTES)),
                                    daemon=True)
            call.start()
            call.join(60)  # a daemon thread: a get that never returns fails here and leaves nothing to wait for
            assert not call.is_alive() and got == [None], got
            assert t.stats()["remote_errors"] == 1
            t.close()
    finally:
        stop.set()
        th.join(2)
        for s in held:
            s.close()
        lsock.close()


def test_a_failed_put_drops_the_put_threads_connection_not_the_getters(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error that is not the client's own leaves a connection possibly mid-reply: the one that
    failed is closed and reopened, and the other thread's (in use, maybe at that moment) is kept."""
    from kvferry.engine.tiers import remote as remote_store

    opened: list[FakeBackend] = []

    class FakeBackend:
        def __init__(self) -> None:
            self.closed = False
            opened.append(self)

        def put_many(self, items: list) -> None:
            raise ValueError("a reply cut off half-way")

        def get(self, key: bytes, max_bytes: int) -> None:
            return None

        def exists(self, keys: list) -> list[bool]:
            return [False] * len(keys)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(remote_store, "open_backend", lambda *a, **kw: FakeBackend())
    t = RemoteTier("redis://127.0.0.1:1", 1.0, Serde("naive", SHAPE))
    assert t.exists([b"A" * 16]) == [False]  # the getters' connection
    assert t.put(b"B" * 16, chunk(7), TOKENS) and t.flush(10)
    assert t.stats()["remote_errors"] == 1
    getter, putter = opened
    assert putter.closed and not getter.closed
    t.close()


def test_puts_beyond_the_queue_limit_are_dropped_not_waited_for(tmp_path: Path) -> None:
    p = start_lm_server(tmp_path)
    try:
        t = RemoteTier(f"lm://{p.url_hostport}", 2.0, Serde("naive", SHAPE), max_queued_bytes=3 * NBYTES)
        results = [t.put(bytes([i]) * 16, chunk(i), TOKENS) for i in range(20)]
        assert t.flush(10)
        assert not all(results) and results[:3] == [True] * 3
        assert t.stats()["remote_put_dropped"] == results.count(False)
        assert t.stats()["stored_chunks|remote"] == results.count(True)
        t.close()
    finally:
        p.stop()


def test_sentinel_failover_is_followed(tmp_path: Path, redis_available) -> None:
    procs = [start_redis(tmp_path)]
    try:  # started one at a time: a failed start still stops the ones before it
        master = procs[0]
        procs.append(replica := start_redis(tmp_path, replicaof=master.port))
        for _ in range(3):
            procs.append(start_sentinel(tmp_path, master.port))
        sentinels = procs[2:]
        url = "redis-sentinel://" + ",".join(s.url_hostport for s in sentinels)
        # The replica's first sync (a full copy) ends at its own pace on a loaded machine: only then
        # can WAIT see it acknowledge a write.
        primary = redis.Redis(port=master.port)
        until(lambda: primary.info("replication").get("slave0", {}).get("state") == "online", 60,
              "the replica to finish its first sync")
        t = RemoteTier(url, 1.0, Serde("naive", SHAPE))
        a = chunk(7)
        assert t.put(b"S" * 16, a, TOKENS) and t.flush(10)
        assert redis.Redis(port=master.port).wait(1, 30000) == 1  # the replica has it
        master.kill()
        misses = 0

        def hit() -> list[torch.Tensor] | None:
            nonlocal misses
            got = t.get(b"S" * 16, TOKENS, NBYTES)
            misses += got is None
            return None if got is None else [got]
        (got,) = until(hit, 60, "a hit after the failover", every=0.2)
        assert torch.equal(got, a), "no hit after the failover"
        assert misses > 0 and t.stats()["remote_errors"] >= 1
        assert redis.Redis(port=replica.port).info("replication")["role"] == "master"
        b = chunk(8)
        assert t.put(b"T" * 16, b, TOKENS) and t.flush(10)
        assert torch.equal(t.get(b"T" * 16, TOKENS, NBYTES), b)
        t.close()
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("keys,fix", [
    ({"remote_url": "infinistore://h:12345/?device=mlx5_1"}, "RDMA only"),
])
def test_unsupported_remote_settings_stop_the_planner_with_the_fix(keys: dict, fix: str) -> None:
    """The connector turns these into vLLM's one-line start-up ConfigError."""
    from kvferry.common.config import load_config
    from kvferry.engine.offload.planner import OffloadPlanner

    cfg = load_config({"local_cpu": True, **keys}, env={})
    with pytest.raises((ValueError, RemoteError), match=fix):
        OffloadPlanner(cfg, b"salt", 16, 1024)


def test_a_chunk_the_store_lost_after_the_lookup_is_not_matched_again(tmp_path: Path) -> None:
    """The worker reports a remote chunk it could not get; the request's cached lookup forgets it."""
    from kvferry.common.config import load_config
    from kvferry.engine.offload.planner import OffloadPlanner

    p = start_lm_server(tmp_path)
    try:
        cfg = load_config({"local_cpu": False, "chunk_size": 16, "remote_url": f"lm://{p.url_hostport}"}, env={})
        plan = OffloadPlanner(cfg, b"salt", 16, 1024)
        tokens = list(range(40))
        keys = plan.keys(tokens)
        w = RemoteTier(cfg.remote_url, 2.0, Serde("naive", SHAPE))
        for k in keys:
            w.put(k, chunk(0), TOKENS)
        assert w.flush(10)
        assert plan.match("r", tokens, 0) == 39  # all three chunks (the last partial), minus one
        plan.forget({"remote": {keys[1]}})
        assert plan.match("r", tokens, 0) == 16  # only the chunk before the lost one
        w.close()
    finally:
        p.stop()
