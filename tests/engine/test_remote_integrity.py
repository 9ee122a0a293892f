"""Bad data from a remote store is a counted miss, never an exception and never a big allocation:
mixed remote_serde settings, the cluster-secret MAC (forged, untagged, another key's or another
rank's chunk), values, replies and zstd frames larger than the chunk, and a store answering
lookups for the wrong number of keys. Against a real redis-server and real (or hostile) lm://
servers."""

from __future__ import annotations

import socket
import struct
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis
import torch
import zstandard

from kvferry.common import secret
from kvferry.common.wire import messages as m
from kvferry.engine.remote.lm.lm_client import LMClient
from kvferry.engine.remote.serde import HEADER_BYTES, ChunkShape, ForgedError, Serde, SerdeError
from kvferry.engine.tiers.remote import PREFIX, RemoteTier
from kvferry.launcher.services import Proc
from kvferry.testing.store_servers import start_lm_server, start_redis

SHAPE = ChunkShape(torch.bfloat16, num_layers=2, num_kv_heads=2, head_size=16, layout_digest=b"L" * 16)
TOKENS = 64
NBYTES = 2 * 2 * TOKENS * 2 * 16 * 2  # layers, K/V, tokens, heads, head size, bf16
SECRET = secret.from_text("a-cluster-secret-of-32-characters", "test")
OTHER_SECRET = secret.from_text("another-cluster-secret-of-32-chars", "test")


def chunk(seed: int, n: int = NBYTES) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def compressible(seed: int) -> torch.Tensor:
    data = torch.zeros(NBYTES, dtype=torch.uint8)
    data[seed % 7::7] = seed
    return data


@pytest.fixture(scope="module")
def rds(tmp_path_factory: pytest.TempPathFactory, redis_available) -> Iterator[Proc]:
    p = start_redis(tmp_path_factory.mktemp("integrity"))
    try:
        yield p
    finally:
        p.stop()


def tier(p: Proc, serde: str = "naive", secret_: secret.ClusterSecret | None = None) -> RemoteTier:
    return RemoteTier(f"redis://{p.url_hostport}", 2.0, Serde(serde, SHAPE), secret=secret_)


def stored(t: RemoteTier, key: bytes, data: torch.Tensor) -> None:
    assert t.put(key, data, TOKENS) and t.flush(10)
    assert t.stats()["stored_chunks|remote"] >= 1


# ---- mixed remote_serde ----

@pytest.mark.parametrize("writer,reader", [("zstd", "naive"), ("naive", "zstd")])
def test_a_reader_decodes_chunks_of_the_other_serde(rds: Proc, writer: str, reader: str) -> None:
    """The header names the format that wrote it, so mixed settings share chunks (a hit, never
    the AttributeError a naive reader raised on a zstd value)."""
    w, r = tier(rds, writer), tier(rds, reader)
    key, data = f"mixed-{writer}".encode().ljust(16, b"."), compressible(3)
    stored(w, key, data)
    got = r.get(key, TOKENS, NBYTES)
    assert got is not None and torch.equal(got, data)
    assert r.stats()["remote_corrupt"] == 0 and r.stats()["remote_errors"] == 0
    w.close()
    r.close()


@pytest.mark.parametrize("field,value", [("format", 9), ("version", 1), ("version", 3)])
def test_an_unknown_format_or_version_is_a_counted_miss(rds: Proc, field: str, value: int, kvf_logs) -> None:
    t = tier(rds)
    key = f"fmt-{field}{value}".encode().ljust(16, b".")
    stored(t, key, chunk(4))
    r = redis.Redis(port=rds.port)
    head = bytearray(r.get(PREFIX + key + b":h"))
    head[{"version": 4, "format": 5}[field]] = value
    r.set(PREFIX + key + b":h", bytes(head))
    assert t.get(key, TOKENS, NBYTES) is None
    assert t.stats()["remote_corrupt"] == 1 and t.stats()["remote_errors"] == 0
    assert "rejected (a miss, recomputed)" in kvf_logs.text
    t.close()


# ---- sizes bounded before allocating ----

def test_a_header_claiming_a_huge_chunk_is_refused_before_any_work() -> None:
    s = Serde("zstd", SHAPE)
    head, payload = s.encode(chunk(5), TOKENS)
    fields = list(struct.unpack("<4sBBBB4IQQQ16s16s", head))
    fields[9] = 1 << 40  # raw bytes
    with pytest.raises(SerdeError, match="expected"):
        s.decode(struct.pack("<4sBBBB4IQQQ16s16s", *fields), payload, TOKENS, NBYTES)


@pytest.mark.parametrize("content_size", [True, False])
def test_a_zstd_bomb_is_a_miss_without_its_size_allocated(content_size: bool) -> None:
    """A 64 MiB frame of a few KiB under a header that claims the expected chunk: zstd would size
    its output by the frame (or read on); the reader stops at the chunk size."""
    s = Serde("zstd", SHAPE)
    head, _ = s.encode(compressible(1), TOKENS)
    bomb = zstandard.ZstdCompressor(level=1, write_content_size=content_size).compress(bytes(64 << 20))
    fields = list(struct.unpack("<4sBBBB4IQQQ16s16s", head))
    fields[10] = len(bomb)  # stored bytes: consistent with the bomb
    head = struct.pack("<4sBBBB4IQQQ16s16s", *fields)
    tracemalloc.start()
    try:
        with pytest.raises(SerdeError, match="zstd"):
            s.decode(head, bomb, TOKENS, NBYTES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated for a {NBYTES}-byte chunk"


def test_a_lookup_reads_no_values_from_redis(rds: Proc) -> None:
    """The scheduler's lookup asks EXISTS: a store holding a 64 MiB 'header' sends none of it."""
    t = tier(rds)
    key = b"bighead".ljust(16, b".")
    r = redis.Redis(port=rds.port)
    r.set(PREFIX + key + b":h", b"\0" * (64 << 20))
    sent0 = r.info("stats")["total_net_output_bytes"]
    assert t.exists([key, b"absent".ljust(16, b".")]) == [True, False]
    assert r.info("stats")["total_net_output_bytes"] - sent0 < 1 << 20
    t.close()


def test_an_oversize_redis_value_is_a_miss_read_only_up_to_the_chunk_size(rds: Proc) -> None:
    """Redis sends at most the expected size (GETRANGE): a 64 MiB value under a chunk's key is
    neither transferred nor allocated."""
    t = tier(rds)
    key = b"oversize".ljust(16, b".")
    stored(t, key, chunk(6))
    r = redis.Redis(port=rds.port)
    r.set(PREFIX + key + b":d", b"\0" * (64 << 20))
    sent0 = r.info("stats")["total_net_output_bytes"]
    assert t.get(key, TOKENS, NBYTES) is None
    sent = r.info("stats")["total_net_output_bytes"] - sent0
    assert sent < 1 << 20, f"redis sent {sent} bytes for a {NBYTES}-byte chunk"
    assert t.stats()["remote_corrupt"] == 1
    t.close()


# ---- the cluster-secret MAC ----

def test_with_the_secret_chunks_round_trip_and_a_reader_without_it_ignores_the_tag(rds: Proc) -> None:
    w, r, plain = tier(rds, secret_=SECRET), tier(rds, "zstd", SECRET), tier(rds)
    key, data = b"mac-ok".ljust(16, b"."), chunk(7)
    stored(w, key, data)
    assert torch.equal(r.get(key, TOKENS, NBYTES), data)
    assert torch.equal(plain.get(key, TOKENS, NBYTES), data)  # documented: no secret, no MAC check
    assert r.stats()["remote_forged"] == 0
    for t in (w, r, plain):
        t.close()


@pytest.mark.parametrize("attack", ["tag_bit", "payload_bit", "payload_bit_fixed_checksum", "no_tag",
                                    "other_key", "other_secret", "other_rank"])
def test_a_forged_chunk_is_a_counted_miss(rds: Proc, attack: str, kvf_logs) -> None:
    reader = tier(rds, secret_=SECRET)
    key, data = f"forge-{attack}".encode()[:16].ljust(16, b"."), chunk(8)
    writer = tier(rds, secret_={"no_tag": None, "other_secret": OTHER_SECRET}.get(attack, SECRET))
    r = redis.Redis(port=rds.port)
    if attack == "other_key":  # the store answers key B with key A's perfectly good chunk
        other = key[:-1] + b"A"
        stored(writer, other, chunk(9))
        for part in (b":h", b":d"):
            r.set(PREFIX + key + part, r.get(PREFIX + other + part))
    elif attack == "other_rank":  # rank 1's shard served as rank 0's
        rank1 = RemoteTier(f"redis://{rds.url_hostport}", 2.0, Serde("naive", SHAPE), rank=1, secret=SECRET)
        stored(rank1, key, chunk(9))
        rank1.close()
        for part in (b":h", b":d"):
            r.set(PREFIX + key + part, r.get(PREFIX + key + b"@1" + part))
    else:
        stored(writer, key, data)
    head, payload = bytearray(r.get(PREFIX + key + b":h")), bytearray(r.get(PREFIX + key + b":d"))
    if attack == "tag_bit":
        head[-1] ^= 1
    elif attack.startswith("payload_bit"):
        payload[100] ^= 1
        if attack.endswith("fixed_checksum"):  # a forger who also mends the checksum
            import xxhash
            head[HEADER_BYTES - 40:HEADER_BYTES - 32] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(payload)))
    r.set(PREFIX + key + b":h", bytes(head))
    r.set(PREFIX + key + b":d", bytes(payload))
    assert reader.get(key, TOKENS, NBYTES) is None
    st = reader.stats()
    assert st["remote_forged"] == 1 and st["remote_corrupt"] == 0 and st["remote_errors"] == 0
    assert "MAC" in kvf_logs.text
    writer.close()
    reader.close()


def test_forged_error_is_a_serde_error() -> None:
    """RemoteTier and any other caller catching SerdeError treat a forged chunk as bad data."""
    assert issubclass(ForgedError, SerdeError)


# ---- a store answering lookups for the wrong number of keys ----

class LyingLM:
    """A hostile lm:// server (no secret): answers every lookup with `extra` more (or fewer)
    found_keys than asked, and every get with a reply of `get_nbytes` bytes it never sends."""

    def __init__(self, extra: int, get_nbytes: int = 0) -> None:
        self.extra, self.get_nbytes = extra, get_nbytes
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @staticmethod
    def _send(c: socket.socket, msg: m.Msg) -> None:
        body = m.encode(msg)
        c.sendall(len(body).to_bytes(4, "big") + body)

    @staticmethod
    def _recv(c: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = c.recv(n - len(buf))
            if not got:
                raise ConnectionError
            buf += got
        return buf

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c: socket.socket) -> None:
        try:
            self._send(c, m.ServerHello(auth=False))
            while True:
                msg = m.decode(self._recv(c, int.from_bytes(self._recv(c, 4), "big")))
                if isinstance(msg, m.RemoteExists):
                    n = max(0, len(msg.keys) + self.extra)
                    self._send(c, m.RemoteReply(found_keys=[True] * n))
                elif isinstance(msg, m.RemoteGet):
                    self._send(c, m.RemoteReply(found=True, nbytes=self.get_nbytes))
                    if self.get_nbytes < 1 << 20:
                        c.sendall(bytes(self.get_nbytes))
        except (OSError, ConnectionError, msgspec.MsgspecError, m.MessageError):
            c.close()

    def close(self) -> None:
        # shutdown first: close() alone does not wake the threads blocked in accept() / recv().
        for s in (self.sock, *self.conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # never connected, or the peer already went
            s.close()


@pytest.mark.parametrize("extra", [1, -1])
def test_lying_found_keys_are_all_misses_counted_and_the_scheduler_goes_on(extra: int) -> None:
    from kvferry.common.config import load_config
    from kvferry.engine.offload.planner import OffloadPlanner

    liar = LyingLM(extra)
    try:
        url = f"lm://127.0.0.1:{liar.port}"
        t = RemoteTier(url, 1.0)
        assert t.exists([b"A" * 16, b"B" * 16, b"C" * 16]) == [False] * 3
        assert t.stats()["remote_errors"] == 1
        t.close()
        cfg = load_config({"local_cpu": False, "chunk_size": 16, "remote_url": url}, env={})
        plan = OffloadPlanner(cfg, b"salt", 16, 1024)
        assert plan.match("r", list(range(40)), 0) == 0  # zip(strict=True) raised here before
        assert plan.stats()["remote_errors"] == 1
        plan.close()
    finally:
        liar.close()


@pytest.mark.parametrize("nbytes", [HEADER_BYTES + NBYTES + 4096, 1 << 30])
def test_an_lm_reply_larger_than_the_chunk_is_a_miss_without_its_size_allocated(nbytes: int) -> None:
    """The reply's header claims `nbytes`: the tier asks for at most a chunk's worth, so the
    client refuses the reply before allocating (or reading) it."""
    liar = LyingLM(0, get_nbytes=nbytes)
    try:
        t = RemoteTier(f"lm://127.0.0.1:{liar.port}", 1.0, Serde("naive", SHAPE))
        tracemalloc.start()
        try:
            assert t.get(b"A" * 16, TOKENS, NBYTES) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"{peak} bytes allocated for a {NBYTES}-byte chunk"
        assert t.stats()["remote_errors"] == 1
        t.close()
    finally:
        liar.close()


def test_the_lm_store_carries_tags_and_refuses_a_forged_chunk(tmp_path: Path) -> None:
    """lm:// stores header and payload as one value: the MAC covers it the same way."""
    path = tmp_path / "secret"
    secret.write_file(str(path), "a-cluster-secret-of-32-characters")
    p = start_lm_server(tmp_path, secret_file=path)
    try:
        url = f"lm://{p.url_hostport}"
        w = RemoteTier(url, 2.0, Serde("zstd", SHAPE), secret=SECRET)
        stored(w, b"A" * 16, compressible(2))
        stored(w, b"B" * 16, compressible(5))
        assert torch.equal(w.get(b"A" * 16, TOKENS, NBYTES), compressible(2))
        # A client holding the secret (so the server lets it in) that is not a kvferry writer:
        c = LMClient("127.0.0.1", p.port, 2.0, SECRET)
        c.put(b"A" * 16, bytes(c.get(b"B" * 16)))  # B's good chunk under A
        c.close()
        assert w.get(b"A" * 16, TOKENS, NBYTES) is None and w.stats()["remote_forged"] == 1
        w.close()
    finally:
        p.stop()
