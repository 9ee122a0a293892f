"""The remote tier against a real mooncake_master (mooncakestore://, LMCache's Mooncake example): round trips
between two clients, per-rank keys, the example file's keys read and checked, a damaged or oversize value
as a counted miss, and a master killed then restarted: bounded misses, then hits again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvferry.common.config import ConfigError, load_config
from kvferry.engine.remote import mooncake_backend, mooncake_settings
from kvferry.engine.remote.backend import RemoteError
from kvferry.engine.remote.backends import parse_url
from kvferry.engine.remote.mooncake_backend import MooncakeClient, _name
from kvferry.engine.remote.serde import ChunkShape, Serde
from kvferry.engine.tiers.remote import RemoteTier
from kvferry.launcher.services import MooncakeMaster, mooncake_master_binary
from tests.polling import until

SHAPE = ChunkShape(torch.bfloat16, num_layers=2, num_kv_heads=2, head_size=16, layout_digest=b"M" * 16)
TOKENS = 64
NBYTES = 2 * 2 * TOKENS * 2 * 16 * 2

pytestmark = pytest.mark.skipif(mooncake_master_binary() is None, reason="mooncake_master not installed")


def chunk(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake"))
    try:
        yield m
    finally:
        mooncake_backend.close_all()  # while the master answers: a client of a dead one blocks exit
        m.stop()


def settings(m: MooncakeMaster, hostname: str = "127.0.0.1", **extra: object) -> mooncake_settings.MooncakeSettings:
    cfg = load_config({"remote_url": m.url, "extra_config": {**m.extra_config(64 << 20), "local_hostname": hostname,
                                                             **extra}}, env={})
    return mooncake_settings.from_config(cfg)


def tier(m: MooncakeMaster, rank: int = 0, timeout: float = 2.0, **extra: object) -> RemoteTier:
    return RemoteTier(m.url, timeout, Serde("naive", SHAPE), rank=rank, mooncake=settings(m, **extra))


def test_the_seed_keys_are_read_and_checked() -> None:
    seed = Path(__file__).resolve().parents[2] / "examples" / "lmcache-configs" / "mooncake-config.yaml"
    s = mooncake_settings.from_config(load_config(env={"LMCACHE_CONFIG_FILE": str(seed)}))
    assert (s.master, s.metadata_server, s.protocol, s.local_hostname) == (
        "localhost:50051", "http://localhost:8080/metadata", "tcp", "localhost")
    assert (s.global_segment_size, s.local_buffer_size, s.prefer_local_alloc) == (21474836480, 0, True)
    assert parse_url("mooncakestore://localhost:50051/")[1] == [("localhost", 50051)]
    for extra, fix in [({"protocol": "ib"}, "not one of tcp, rdma"),
                       ({"master_server_address": "other:1"}, "different masters"),
                       ({"global_segment_size": "20GB"}, "expected int"),
                       ({"transfer_timeout": 0}, "positive number of seconds")]:
        cfg = load_config({"remote_url": "mooncakestore://h:50051/", "extra_config": extra}, env={})
        with pytest.raises(ConfigError, match=fix):
            mooncake_settings.from_config(cfg)
    if not mooncake_settings.rdma_devices():
        cfg = load_config({"remote_url": "mooncakestore://h:50051/", "extra_config": {"protocol": "rdma"}}, env={})
        with pytest.raises(ConfigError, match="no RDMA device.*use protocol: tcp"):
            mooncake_settings.from_config(cfg)


def test_infinistore_is_refused_in_one_line() -> None:
    with pytest.raises(RemoteError, match="InfiniStore speaks RDMA only") as e:
        parse_url("infinistore://127.0.0.1:12345/?device=mlx5_1")
    assert "\n" not in str(e.value)


def test_round_trip_between_two_clients_and_ranks(master: MooncakeMaster) -> None:
    w0, w1 = tier(master), tier(master, rank=1)
    # Another process's client (its own hostname identity): what one puts, the other reads.
    other = RemoteTier(master.url, 2.0, Serde("naive", SHAPE), mooncake=settings(master, hostname="localhost"))
    a, b = chunk(1), chunk(2)
    assert w0.put(b"A" * 16, a, TOKENS) and w1.put(b"A" * 16, b, TOKENS)
    assert w0.flush(10) and w1.flush(10)
    assert torch.equal(other.get(b"A" * 16, TOKENS, NBYTES), a)
    assert torch.equal(w1.get(b"A" * 16, TOKENS, NBYTES), b)
    assert other.get(b"B" * 16, TOKENS, NBYTES) is None
    assert other.exists([b"A" * 16, b"B" * 16]) == [True, False]
    assert w0.stats()["stored_chunks|remote"] == 1 and other.stats()["remote_errors"] == 0
    for t in (w0, w1, other):
        t.close()


def raw(m: MooncakeMaster) -> MooncakeClient:
    """A client of the test's own, with Mooncake's internal buffer for plain put/get of bytes."""
    return MooncakeClient.shared(settings(m, local_buffer_size=16 << 20))


def raw_put(m: MooncakeMaster, key: bytes, value: bytes) -> None:
    client = raw(m)
    assert client.wait("put", 5, client.submit(lambda st: st.put(_name(key), value))) == 0


def test_a_damaged_or_oversize_value_is_a_counted_miss(master: MooncakeMaster) -> None:
    t = tier(master)
    assert t.put(b"D" * 16, chunk(3), TOKENS) and t.flush(10)
    client = raw(master)
    good = client.wait("get", 5, client.submit(lambda st: st.get(_name(b"D" * 16))))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    raw_put(master, b"E" * 16, bytes(bad))
    assert t.get(b"E" * 16, TOKENS, NBYTES) is None and t.stats()["remote_corrupt"] == 1
    raw_put(master, b"F" * 16, bytes(good) + bytes(4 * NBYTES))  # larger than the chunk can be: never read
    assert t.get(b"F" * 16, TOKENS, NBYTES) is None and t.stats()["remote_errors"] == 1
    t.close()


def round_trip(t: RemoteTier, key: bytes, value: torch.Tensor) -> bool:
    """A put then a get that hits; False while the tier backs off (a call past its timeout)."""
    if t.put(key, value, TOKENS) and t.flush(5):
        got = t.get(key, TOKENS, NBYTES)
        if got is not None:
            assert torch.equal(got, value)
            return True
    return False


def test_a_killed_master_is_bounded_misses_and_hits_resume_after_its_restart(master: MooncakeMaster) -> None:
    t = tier(master, timeout=1.0)
    a = chunk(5)
    # The first call also starts the tier's client (its segment mounted): on a loaded machine that
    # can pass the 1 s timeout, a miss and a back-off, so hits are waited for, not assumed.
    until(lambda: round_trip(t, b"K" * 16, a), 30, "a hit from the running master", every=0.5)
    master.kill()
    # 60 calls: were each to wait out its 1 s timeout (no back-off, or an unbounded call), they
    # would take a minute or more; a bounded call then the back-off makes them take about one.
    t0 = time.monotonic()
    for _ in range(30):
        assert t.get(b"K" * 16, TOKENS, NBYTES) is None
        assert t.exists([b"K" * 16]) == [False]
    assert time.monotonic() - t0 < 30, "a dead master must cost at most one bounded call, then back-off"
    assert t.stats()["remote_errors"] >= 1
    master.restart()
    b = chunk(6)
    # The tier retries after its back-off; the client rejoins the restarted master.
    until(lambda: round_trip(t, b"R" * 16, b), 60, "a hit within 60 s of the master's restart", every=0.5)
    t.close()
