"""`kvferry up` beyond loopback: the proxy's admin key is a new random key in a file only its owner
can read, beside cluster.secret (no cluster is started: the function that makes it)."""

from __future__ import annotations

import stat
from pathlib import Path

from kvferry.launcher.up import admin_key_file


def test_the_admin_key_file_is_new_random_and_owner_only_security(tmp_path: Path) -> None:
    first = admin_key_file(tmp_path)
    assert first == tmp_path / "admin.key"
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    key = first.read_text().strip()
    assert len(key) >= 40 and key.isascii() and " " not in key  # 256 random bits, URL-safe
    second = admin_key_file(tmp_path)  # a new cluster in the same folder: a new key
    assert second.read_text().strip() != key and stat.S_IMODE(second.stat().st_mode) == 0o600
