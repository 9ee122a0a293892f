"""kvferry-server (lm://) as a real process: round trips, LRU under its memory limit, bad peers
(garbage, oversized frames, byte-at-a-time frames, stalled frames, a dead server) that cost a
connection, never the server, and the cluster-secret handshake (clients without the secret, or
with another one, neither read nor store anything)."""

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
from kvferry.common import secret
from kvferry.engine.lm_server import LMClient, LMError, frame
from kvferry.launcher.stores import Proc, start_lm_server

KIB = 1 << 10
A, B = "a-cluster-secret-of-32-characters", "another-cluster-secret-entirely!"
SA, SB = secret.from_text(A, "test"), secret.from_text(B, "test")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[int, Proc]]:
    p = start_lm_server(tmp_path, None, "--max-bytes", str(1000 * KIB / (1 << 30)), "--max-frame", "0.5",
                        "--frame-timeout", "1")
    yield p.port, p
    p.kill()


@pytest.fixture
def secret_server(tmp_path: Path) -> Iterator[tuple[int, Proc]]:
    path = tmp_path / "secret"
    secret.write_file(str(path), A)
    p = start_lm_server(tmp_path, None, "--frame-timeout", "1", secret_file=path)
    yield p.port, p
    p.kill()


def raw(port: int, auth: bool = False) -> socket.socket:
    """A raw connection past the server's greeting (a ServerHello, with a challenge when `auth`)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = reply_of(s)
    assert isinstance(hello, m.ServerHello) and hello.auth is auth and len(hello.nonce) == (32 if auth else 0)
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


def closed(s: socket.socket) -> bool:
    """The server closed the connection (a reset, when it left bytes of ours unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


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


def test_with_the_cluster_secret_round_trips_work(secret_server) -> None:
    port, _ = secret_server
    c = LMClient("127.0.0.1", port, secret=SA)
    blob = os.urandom(300 * KIB)
    c.put(b"k1", blob)
    assert c.get(b"k1") == blob
    assert c.exists([b"k1", b"nope"]) == [True, False]
    c.close()
    assert c.get(b"k1") == blob, "a new connection proves the secret again"
    c.close()


def test_clients_without_the_secret_neither_read_nor_store(secret_server) -> None:
    port, p = secret_server
    good = LMClient("127.0.0.1", port, secret=SA)
    good.put(b"mine", b"v" * 1000)
    wrong, none = LMClient("127.0.0.1", port, secret=SB), LMClient("127.0.0.1", port)
    for c, fix in ((wrong, "wrong cluster secret"), (none, "set cluster_secret_file")):
        with pytest.raises(LMError, match=fix):
            c.get(b"mine")
        with pytest.raises(LMError, match=fix):
            c.put(b"theirs", b"x" * 100)
        with pytest.raises(LMError, match=fix):
            c.exists([b"mine"])
    # A raw peer that skips the challenge and sends a request (payload and all) gets refused.
    s = raw(port, auth=True)
    s.sendall(frame(m.RemotePut(key=b"raw", nbytes=10)) + b"y" * 10)
    got = reply_of(s)
    assert isinstance(got, m.ErrorReply) and got.code == "unauthorized" and "cluster_secret_file" in got.message
    assert closed(s)
    s.close()
    # So is a raw peer with a well-formed answer made with the wrong key.
    s = raw(port, auth=True)
    s.sendall(frame(m.AuthAnswer(nonce=os.urandom(32), mac=os.urandom(32))))
    got = reply_of(s)
    assert isinstance(got, m.ErrorReply) and got.code == "unauthorized" and "wrong cluster secret" in got.message
    s.close()
    # Nothing they sent was stored; the good client's connection was never disturbed.
    assert good.exists([b"mine", b"theirs", b"raw"]) == [True, False, False]
    assert good.get(b"mine") == b"v" * 1000
    assert p.proc.poll() is None
    good.close()


def test_a_peer_that_never_answers_the_challenge_is_cut_off(secret_server) -> None:
    port, _ = secret_server
    s = raw(port, auth=True)
    t0 = time.monotonic()
    got = reply_of(s)  # we send nothing
    assert isinstance(got, m.ErrorReply) and got.code == "unauthorized" and "no answer" in got.message
    assert 0.8 < time.monotonic() - t0 < 4, "cut off after --frame-timeout (1 s)"
    assert closed(s)
    s.close()
    # A header too large for an answer is refused at once, before its bytes are read.
    s = raw(port, auth=True)
    s.sendall((1 << 20).to_bytes(4, "big"))
    got = reply_of(s)
    assert isinstance(got, m.ErrorReply) and got.code == "unauthorized"
    s.close()
    c = LMClient("127.0.0.1", port, secret=SA)
    c.put(b"after", b"z")
    assert c.get(b"after") == b"z"
    c.close()


def test_a_client_with_a_secret_refuses_a_server_without_one(server) -> None:
    port, _ = server
    c = LMClient("127.0.0.1", port, secret=SA)
    with pytest.raises(LMError, match="start kvferry-server with --cluster-secret-file"):
        c.put(b"k", b"v")
    assert LMClient("127.0.0.1", port).exists([b"k"]) == [False], "it sent nothing"


def test_an_exposed_server_needs_a_secret_when_told_to() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_CLUSTER_SECRET")}
    r = subprocess.run([sys.executable, "-m", "kvferry.engine.lm_server", "0.0.0.0", "5", "--require-cluster-secret"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--cluster-secret-file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
