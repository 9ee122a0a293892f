"""kvferry-server (lm://) as a real process: round trips, LRU under its memory limit, and bad
peers (garbage, oversized frames, byte-at-a-time frames, stalled frames, a dead server) that
cost a connection, never the server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.common import messages as m
from kvferry.engine.lm_server import LMClient, LMError, frame
from kvferry.launcher.stores import Proc, start_lm_server

KIB = 1 << 10


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[int, Proc]]:
    p = start_lm_server(tmp_path, None, "--max-bytes", str(1000 * KIB / (1 << 30)), "--max-frame", "0.5",
                        "--frame-timeout", "1")
    yield p.port, p
    p.kill()


def raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def reply_of(s: socket.socket) -> m.Msg | None:
    """The server's next reply on a raw socket, or None if it closed without one."""
    try:
        head = s.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            return None
        return m.decode(s.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL))
    except (ConnectionError, TimeoutError):
        return None


def still_serves(port: int) -> bool:
    c = LMClient("127.0.0.1", port)
    try:
        c.put(b"probe", b"x" * 100)
        return c.get(b"probe") == b"x" * 100
    finally:
        c.close()


def test_put_get_exists_round_trip(server) -> None:
    port, _ = server
    c = LMClient("127.0.0.1", port)
    blob = os.urandom(300 * KIB)
    c.put(b"k1", blob)
    assert c.get(b"k1") == blob
    assert c.get(b"nope") is None
    assert c.exists([b"k1", b"nope"]) == [True, False]
    c.close()


def test_memory_limit_evicts_least_recently_used(server) -> None:
    port, _ = server
    c = LMClient("127.0.0.1", port)
    for k in (b"a", b"b"):
        c.put(k, os.urandom(400 * KIB))
    c.get(b"a")  # a is now newer than b
    c.put(b"c", os.urandom(400 * KIB))  # 1,200 KiB > 1,000 KiB: the oldest (b) goes
    assert c.exists([b"a", b"b", b"c"]) == [True, False, True]
    with pytest.raises(LMError, match="too_large"):  # over --max-frame (512 KiB)
        c.put(b"big", os.urandom(600 * KIB))
    assert still_serves(port)
    c.close()


@pytest.mark.parametrize("junk", [b"\x00\x00\x00\x05hello", os.urandom(64), b"\xff\xff\xff\xff" + b"x" * 10,
                                  frame(m.RemoteExists(keys=[b"k"]))[:4] + b"\x81\xa1t\xa5rputX"])
def test_garbage_is_rejected_and_others_keep_being_served(server, junk: bytes) -> None:
    port, p = server
    other = LMClient("127.0.0.1", port)
    other.put(b"mine", b"v" * 1000)
    s = raw(port)
    s.sendall(junk)
    got = reply_of(s)
    assert got is None or isinstance(got, m.ErrorReply)
    s.close()
    assert other.get(b"mine") == b"v" * 1000  # the same connection as before: never disturbed
    assert p.proc.poll() is None
    other.close()


def test_a_frame_may_arrive_a_byte_at_a_time(server) -> None:
    port, _ = server
    blob = os.urandom(2000)
    data = frame(m.RemotePut(key=b"slow", nbytes=len(blob))) + blob
    s = raw(port)
    for i in range(0, len(data), 97):  # short writes with pauses: the server reads exactly
        s.sendall(data[i:i + 97])
        time.sleep(0.002)
    assert isinstance(reply_of(s), m.RemoteReply)
    s.close()
    assert LMClient("127.0.0.1", port).get(b"slow") == blob


def test_a_stalled_frame_is_cut_off(server) -> None:
    port, _ = server
    s = raw(port)
    s.sendall(frame(m.RemotePut(key=b"stall", nbytes=1000)) + b"x" * 10)  # then nothing
    t0 = time.monotonic()
    got = reply_of(s)
    assert isinstance(got, m.ErrorReply) and got.code == "timeout"
    assert time.monotonic() - t0 < 5
    assert still_serves(port)


def test_a_dead_server_is_a_bounded_error_and_a_restart_is_picked_up(tmp_path: Path) -> None:
    p = start_lm_server(tmp_path)
    port = p.port
    c = LMClient("127.0.0.1", port, timeout=2)
    c.put(b"k", b"v")
    p.kill()
    t0 = time.monotonic()
    with pytest.raises(LMError):
        c.get(b"k")
    assert time.monotonic() - t0 < 3
    p = start_lm_server(tmp_path, port)
    try:
        assert c.get(b"k") is None  # a fresh, empty server; the client reconnected by itself
        c.put(b"k", b"v2")
        assert c.get(b"k") == b"v2"
    finally:
        c.close()
        p.kill()


def test_bad_arguments_exit_2() -> None:
    for args in (["127.0.0.1", "5", "gpu"], ["127.0.0.1", "70000"], ["127.0.0.1", "5", "--max-bytes", "0"]):
        r = subprocess.run([sys.executable, "-m", "kvferry.engine.lm_server", *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2, (args, r.stderr)
