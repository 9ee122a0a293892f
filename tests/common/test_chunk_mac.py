"""The chunk MAC: a tag binds the key and every byte; another secret or key gives another tag."""

import os

from kvferry.common.secret import from_text
from kvferry.common.wire import chunk_mac

A = from_text("a" * 32, "test")
B = from_text("b" * 32, "test")


def test_tag_checks_and_rejects_any_change():
    mac = chunk_mac.ChunkMAC(A)
    head, payload = b"head", os.urandom(3 << 20)  # above the threaded size
    tag = mac.tag(b"key1", head, memoryview(payload))
    assert len(tag) == chunk_mac.TAG_BYTES
    assert mac.check(tag, b"key1", head, payload)
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 1
    assert not mac.check(tag, b"key1", head, bytes(flipped))
    assert not mac.check(tag, b"key2", head, payload)          # another key's chunk
    assert not mac.check(tag, b"key1", head + payload[:1], payload[1:])  # parts re-split
    assert not mac.check(tag[:-1], b"key1", head, payload)     # short tag
    assert not chunk_mac.ChunkMAC(B).check(tag, b"key1", head, payload)  # another secret


def test_no_secret_no_mac_and_key_hidden():
    assert chunk_mac.for_secret(None) is None
    assert "hidden" in repr(chunk_mac.for_secret(A))
