"""The offload tiers without vLLM: the standalone engine over the same index, tiers and copies the
connector uses. Byte equality, prefix lookups, size limits under eviction, restarts, corrupt and
truncated disk files, write-behind ordering, and the standalone CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvferry.common.config import ConfigError, load_config
from kvferry.engine.offload.index import TierIndex
from kvferry.engine.tiers.disk import HEADER_BYTES, DiskTier, scan
from kvferry.launcher.standalone import StandaloneEngine, parse_shape_spec

SHAPE = parse_shape_spec("(2,2,1024,2,16):float16:2")  # 4 layers, 1024 tokens; 256-token chunk = 64 KiB
CHUNK_BYTES = 4 * 2 * 256 * 2 * 16 * 2


def engine(tmp_path: Path, **keys) -> StandaloneEngine:
    cfg = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 1.0, **keys}
    return StandaloneEngine(load_config(cfg, env={}), SHAPE, "test-model")


def fill(eng: StandaloneEngine, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in eng.kv:
        t[:, :n] = torch.randn(t[:, :n].shape, generator=gen).to(t.dtype)
        out.append(t[:, :n].clone())
    return out


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wipe(eng: StandaloneEngine) -> None:
    for t in eng.kv:
        t.zero_()


def same(eng: StandaloneEngine, want: list[torch.Tensor], n: int) -> bool:
    return all(torch.equal(t[:, :n], w[:, :n]) for t, w in zip(eng.kv, want, strict=True))


def test_round_trip_through_the_cpu_tier_is_byte_exact(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    toks = tokens(700, 1)  # two full chunks and a partial one
    want = fill(eng, 700, 1)
    assert eng.lookup(toks) == 0
    assert eng.store(toks) == 700
    wipe(eng)
    assert eng.lookup(toks) == 700
    assert eng.retrieve(toks) == 700
    assert same(eng, want, 700)
    assert eng.store(toks) == 0  # nothing new: every chunk is held
    eng.close()


def test_lookup_returns_the_longest_cached_prefix_in_whole_chunks(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    a = tokens(700, 2)
    want = fill(eng, 700, 2)
    eng.store(a)
    b = a[:600] + tokens(300, 3)  # shares two full chunks (512 tokens), then differs inside chunk 3
    assert eng.lookup(b) == 512
    wipe(eng)
    assert eng.retrieve(b) == 512
    assert same(eng, want, 512)
    assert all(not t[:, 512:].any() for t in eng.kv)  # nothing past the hit was written
    assert eng.lookup(tokens(700, 4)) == 0
    eng.close()


def test_without_save_unfull_chunk_only_full_chunks_are_kept(tmp_path: Path) -> None:
    eng = engine(tmp_path, save_unfull_chunk=False)
    toks = tokens(700, 5)
    fill(eng, 700, 5)
    assert eng.store(toks) == 512
    assert eng.lookup(toks) == 512
    eng.close()


def test_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    disk = {"local_disk": f"file://{tmp_path}/kv/", "max_local_disk_size": 1.0}
    eng = engine(tmp_path, **disk)
    toks = tokens(900, 6)
    want = fill(eng, 900, 6)
    eng.store(toks)
    eng.close()  # waits for the writes
    assert len(scan(tmp_path / "kv" / "rank0")) == 4

    again = engine(tmp_path, **disk)  # CPU tier empty
    assert again.planner.index.by_name["cpu"].used == 0
    assert again.lookup(toks) == 900
    assert again.retrieve(toks) == 900
    assert same(again, want, 900)
    st = again.stats()
    assert st["hit_chunks|disk"] == 4 and st["disk_reads"] == 4
    # promoted: a second retrieve is served from the CPU tier
    wipe(again)
    assert again.retrieve(toks) == 900 and same(again, want, 900)
    assert again.stats()["hit_chunks|cpu"] == 4
    again.close()


def test_another_model_never_reads_the_files(tmp_path: Path) -> None:
    disk = {"local_disk": str(tmp_path / "kv"), "max_local_disk_size": 1.0}
    eng = engine(tmp_path, **disk)
    toks = tokens(512, 7)
    fill(eng, 512, 7)
    eng.store(toks)
    eng.close()
    other = StandaloneEngine(load_config({"chunk_size": 256, "local_cpu": False, **disk}, env={}), SHAPE, "other")
    assert other.lookup(toks) == 0
    other.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign"])
def test_a_damaged_disk_file_is_a_miss_with_a_warning_and_is_deleted(tmp_path: Path, kvf_logs, damage: str
                                                                      ) -> None:
    disk = {"local_disk": str(tmp_path / "kv"), "max_local_disk_size": 1.0}
    eng = engine(tmp_path, local_cpu=False, **disk)
    toks = tokens(512, 8)
    want = fill(eng, 512, 8)
    eng.store(toks)
    assert eng.flush(10)
    files = sorted((tmp_path / "kv" / "rank0").glob("*.kvf"), key=os.path.getmtime)
    victim = files[1]  # the second chunk
    raw = bytearray(victim.read_bytes())
    if damage == "flip":
        raw[HEADER_BYTES + 100] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "empty":
        raw = bytearray()
    else:  # another file's content under this name
        raw = bytearray(files[0].read_bytes())
    victim.write_bytes(bytes(raw))

    wipe(eng)
    assert eng.lookup(toks) == 512  # the index still lists it ...
    assert eng.retrieve(toks) == 0  # ... but the load refuses it: nothing is loaded
    assert "treated as a miss and deleted" in kvf_logs.text
    assert not victim.exists()
    assert eng.lookup(toks) == 256  # forgotten: the first chunk is still good
    assert eng.retrieve(toks) == 256 and same(eng, want, 256)
    assert eng.stats()["disk_corrupt"] == 1
    eng.close()


def test_tiers_stay_under_their_limits_under_a_stream_of_prompts(tmp_path: Path) -> None:
    # 5 chunks fit the CPU tier, 8 the disk tier.
    cpu_gb, disk_gb = 5 * CHUNK_BYTES / (1 << 30), 8 * (CHUNK_BYTES + HEADER_BYTES) / (1 << 30)
    eng = engine(tmp_path, max_local_cpu_size=cpu_gb, local_disk=str(tmp_path / "kv"), max_local_disk_size=disk_gb)
    cpu_cap, disk_cap = eng.planner.index.by_name["cpu"].capacity, eng.planner.index.by_name["disk"].capacity
    prompts = []
    for i in range(12):
        toks = tokens(512, 100 + i)
        fill(eng, 512, 100 + i)
        eng.store(toks)
        prompts.append(toks)
        assert eng.planner.index.by_name["cpu"].used <= cpu_cap
        assert eng.copier.cpu.used <= cpu_cap
        assert eng.flush(10)
        on_disk = sum(n for _, n in scan(tmp_path / "kv" / "rank0"))
        assert on_disk <= disk_cap
        assert on_disk == eng.planner.index.by_name["disk"].used  # index and files agree
        assert len(eng.copier.cpu) == len(eng.planner.index.by_name["cpu"])
    st = eng.stats()
    assert st["evicted_chunks|cpu"] == 24 - 5 and st["evicted_chunks|disk"] == 24 - 8
    assert eng.lookup(prompts[-1]) == 512  # the newest stay
    assert eng.lookup(prompts[0]) == 0  # the oldest went
    eng.close()


def test_a_chunk_is_readable_before_its_file_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real_write = DiskTier._write

    def held_write(self, key, data):  # the disk is "slow": nothing is written until the gate opens
        assert gate.wait(30)
        real_write(self, key, data)

    monkeypatch.setattr(DiskTier, "_write", held_write)
    eng = engine(tmp_path, local_cpu=False, local_disk=str(tmp_path / "kv"), max_local_disk_size=1.0)
    toks = tokens(512, 9)
    want = fill(eng, 512, 9)
    eng.store(toks)  # returns with the writer blocked: the forward pass never waits on the disk
    assert not scan(tmp_path / "kv" / "rank0")
    wipe(eng)
    assert eng.retrieve(toks) == 512 and same(eng, want, 512)
    gate.set()
    assert eng.flush(10) and len(scan(tmp_path / "kv" / "rank0")) == 2
    eng.close()


def test_disk_writes_and_deletes_apply_in_order(tmp_path: Path) -> None:
    d = DiskTier(tmp_path, b"layout")
    key = bytes(range(16))
    one, two = torch.full((1000,), 1, dtype=torch.uint8), torch.full((1000,), 2, dtype=torch.uint8)
    d.put(key, one)
    d.delete(key)
    d.put(key, two)
    assert d.flush(10)
    got = d.get(key, 1000)
    assert got is not None and torch.equal(got, two)
    d.delete(key)
    assert d.flush(10) and d.get(key, 1000) is None
    d.close()


def test_index_never_admits_past_its_capacity() -> None:
    t = TierIndex("cpu", 100)
    assert t.admit(b"a", 60) == (True, [])
    assert t.admit(b"b", 60) == (True, [b"a"])
    assert t.admit(b"c", 101) == (False, [])  # larger than the tier: rejected, nothing evicted
    assert t.used == 60 and list(t.entries) == [b"b"]
    assert t.admit(b"d", 100) == (True, [b"b"])  # exactly the capacity: everything else goes
    assert t.used == 100


def test_bad_setups_get_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tier"):
        engine(tmp_path, local_cpu=False)
    with pytest.raises(ConfigError, match="max_local_disk_size"):
        load_config({"local_disk": "/tmp/x"}, env={})
    with pytest.raises(ValueError, match="shape_spec"):
        parse_shape_spec("(2,2,256,4):float16")
    with pytest.raises(ValueError, match="torch dtype"):
        parse_shape_spec("(2,2,256,4,16):float99:1")
    eng = engine(tmp_path)
    with pytest.raises(ValueError, match="holds 1 to 1024"):
        eng.store(tokens(1025, 1))
    eng.close()


def test_standalone_cli_round_trip_with_the_readme_example(tmp_path: Path) -> None:
    cfg = Path(__file__).resolve().parents[2] / "examples" / "offload" / "kvferry-offload-config.yaml"
    cmd = [sys.executable, "-m", "kvferry.launcher.standalone", "--config", str(cfg), "--device", "cpu",
           "--model_name", "my_model", "--kvcache_shape_spec", "(2,2,256,4,16):float16:2"]
    env = {**os.environ, "KVFERRY_LOCAL_DISK": f"file://{tmp_path}/kv/"}  # env overrides the file's folder
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["retrieved_tokens"] == 256 and out["tiers"]["disk"]["chunks"] == 1
    assert "Retrieved 256 out of 256 required tokens" in r.stderr
    assert len(scan(tmp_path / "kv" / "rank0")) == 1
    bad = subprocess.run(cmd[:-1] + ["(2,2,256)"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "kvcache_shape_spec" in bad.stderr
