"""The disk tier under hostile files: a truncated, oversize, mislabelled, symlinked or FIFO chunk
file is a counted miss (and removed) read no further than its expected size; folders are 0700 and
files 0600 whatever the umask; writes never follow a link planted at a chunk's or a temporary
file's name."""

from __future__ import annotations

import os
import stat
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

from kvferry.engine.tiers.disk import HEADER_BYTES as DISK_HEADER
from kvferry.engine.tiers.disk import DiskTier, scan


def chunk(seed: int, n: int = 1000) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def disk_key(i: int) -> bytes:
    return bytes([i]) * 16


def written(d: DiskTier, key: bytes, data: torch.Tensor) -> Path:
    assert d.put(key, data) and d.flush(10)
    return d.path(key)


def test_disk_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        root = tmp_path / "kv" / "rank0"
        d = DiskTier(root, b"layout")
        f = written(d, disk_key(1), chunk(1))
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(root.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
        d.close()
        os.chmod(root, 0o777)  # loosened by someone: tightened at the next start
        DiskTier(root, b"layout").close()
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    finally:
        os.umask(old)


def test_a_disk_folder_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "rank0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="symlink"):
        DiskTier(tmp_path / "kv" / "rank0", b"layout")


@pytest.mark.parametrize("damage", ["truncated", "oversize", "header_size", "wrong_expected"])
def test_a_wrong_size_disk_file_is_a_counted_miss_and_removed(tmp_path: Path, damage: str, kvf_logs) -> None:
    d = DiskTier(tmp_path / "rank0", b"layout")
    key, data = disk_key(2), chunk(2)
    f = written(d, key, data)
    expect = 1000
    if damage == "truncated":
        os.truncate(f, DISK_HEADER + 999)
    elif damage == "oversize":
        with open(f, "ab") as fh:
            fh.write(b"\0" * (64 << 20))
    elif damage == "header_size":  # the header claims a chunk far larger than the file
        with open(f, "r+b") as fh:
            fh.seek(8)
            fh.write(struct.pack("<Q", 1 << 40))
    else:
        expect = 2000
    tracemalloc.start()
    try:
        assert d.get(key, expect) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert d.counters.corrupt == 1 and not f.exists()
    assert "treated as a miss and deleted" in kvf_logs.text
    d.close()


def test_a_symlink_at_a_chunk_path_is_not_followed_on_read_or_write(tmp_path: Path) -> None:
    d = DiskTier(tmp_path / "rank0", b"layout")
    good = written(d, disk_key(3), chunk(3))
    # Read: a link to a valid chunk file (of the same key) is not followed, and only the link goes.
    target = tmp_path / "planted.kvf"
    target.write_bytes(good.read_bytes())
    good.unlink()
    good.symlink_to(target)
    assert d.get(disk_key(3), 1000) is None
    assert d.counters.corrupt == 1 and not good.is_symlink() and target.exists()
    assert scan(d.root) == []
    # Write: a link planted at the chunk's name is replaced, its target untouched.
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    d.path(disk_key(4)).symlink_to(victim)
    f = written(d, disk_key(4), chunk(4))
    assert victim.read_bytes() == b"precious" and not f.is_symlink()
    assert torch.equal(d.get(disk_key(4), 1000), chunk(4))
    d.close()


def test_a_fifo_planted_at_a_chunk_path_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    d = DiskTier(tmp_path / "rank0", b"layout")
    os.mkfifo(d.path(disk_key(5)))
    assert d.get(disk_key(5), 1000) is None
    assert d.counters.corrupt == 1 and not d.path(disk_key(5)).exists()
    d.close()


def test_disk_temp_files_are_created_exclusively(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file or link already at the temp name makes the write fail (counted), never reused."""
    d = DiskTier(tmp_path / "rank0", b"layout")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(os, "urandom", lambda n: b"\x01" * n)  # a temp name an attacker can predict
    tmp = d.path(disk_key(6)).with_name(d.path(disk_key(6)).name + ".tmp" + "01" * 6)
    tmp.symlink_to(victim)
    assert d.put(disk_key(6), chunk(6)) and d.flush(10)
    assert d.counters.write_errors == 1 and victim.read_bytes() == b"precious"
    assert d.take_lost() == {disk_key(6)}
    d.close()
