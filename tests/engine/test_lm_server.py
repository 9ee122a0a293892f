"""kvferry-server (lm://) as a real process: round trips, LRU under its memory limit, bad peers
(garbage, oversized frames, byte-at-a-time frames, stalled frames, a dead server) that cost a
connection, never the server, and the cluster-secret handshake (clients without the secret, or
with another one, neither read nor store anything). Its limits: more connections than its
`ulimit -n`, a connection cap, idle and partial-prefix connections, trickled puts under an
in-flight byte budget, a client that does not read; and LMClient against a lying peer."""

from __future__ import annotations

import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.common import secret
from kvferry.common.wire import messages as m
from kvferry.engine.remote.lm.lm_client import LMClient, LMError
from kvferry.engine.remote.lm.protocol import frame
from kvferry.launcher.services import Proc
from kvferry.testing.store_servers import start_lm_server
from tests.polling import until

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


@pytest.mark.parametrize("junk", [b"\x00\x00\x00\x05hello", random.Random(114).randbytes(64),  # seeded: xdist workers
                                  b"\xff\xff\xff\xff" + b"x" * 10,
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
        time.sleep(0.002)  # a sleep (pacing): the frame comes in paced short writes
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
    assert time.monotonic() - t0 < 30  # cut off by the server's frame timeout: without it, never
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
    assert time.monotonic() - t0 < 30  # the client's 2 s timeout bounds it, far from this
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
        r = subprocess.run([sys.executable, "-m", "kvferry.launcher.lm_server", *args], capture_output=True, text=True,
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
    assert 0.8 < time.monotonic() - t0 < 30, "cut off after --frame-timeout (1 s)"
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
    r = subprocess.run([sys.executable, "-m", "kvferry.launcher.lm_server", "0.0.0.0", "5", "--require-cluster-secret"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--cluster-secret-file" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---- limits: the server keeps serving ----

MIB = 1 << 20


def lm_server(tmp_path: Path, *extra: str) -> Proc:
    return start_lm_server(tmp_path, None, "--frame-timeout", "1", *extra)


def serves(port: int) -> bool:
    try:
        return still_serves(port)
    except LMError:
        return False


def greeting(port: int, rcvbuf: int | None = None) -> tuple[socket.socket, m.Msg | None]:
    """A raw connection and the server's first frame on it (None: closed without one)."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    return s, reply_of(s)


def stats(p: Proc) -> dict[str, int]:
    """The server's counters: SIGUSR1 makes it log a stats line."""
    before = p.log.read_text().count("kvferry-server stats:")
    p.proc.send_signal(signal.SIGUSR1)
    until(lambda: p.log.read_text().count("kvferry-server stats:") > before, what="a stats line")
    line = p.log.read_text().split("kvferry-server stats:")[-1].split("(")[0]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KIB
    raise AssertionError("no VmRSS")


def test_more_connections_than_its_ulimit_then_it_serves_again(tmp_path: Path) -> None:
    p = lm_server(tmp_path, "--max-connections", "1000")  # a cap above the limit: accept() itself runs out
    try:
        resource.prlimit(p.proc.pid, resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        conns, answers = [], []
        for _ in range(150):
            s, hello = greeting(p.port)
            conns.append(s)
            answers.append(hello)
        assert sum(isinstance(a, m.ServerHello) for a in answers) < 64, "the limit was in force"
        refused = [a for a in answers if not isinstance(a, m.ServerHello)]
        assert refused, "connections past the limit were refused at once, not left in the backlog"
        assert all(a is None or (isinstance(a, m.ErrorReply) and a.code == "busy") for a in refused)
        assert p.proc.poll() is None
        for s in conns:
            s.close()
        until(lambda: serves(p.port), what="serving again once descriptors were free")
        log = p.log.read_text()
        assert 1 <= log.count("cannot accept connections") <= 3, "logged once per burst, not per connection"
        assert "ulimit -n" in log
        assert stats(p)["refused_fd"] >= 1
    finally:
        p.kill()


def test_the_connection_cap_refuses_the_excess_and_serves_again_after(tmp_path: Path) -> None:
    p = lm_server(tmp_path, "--max-connections", "3")
    try:
        held = []
        for _ in range(3):
            s, hello = greeting(p.port)
            assert isinstance(hello, m.ServerHello)
            held.append(s)
        s, got = greeting(p.port)
        assert isinstance(got, m.ErrorReply) and got.code == "busy" and "--max-connections" in got.message
        assert closed(s)
        s.close()
        with pytest.raises(LMError, match="busy"):
            LMClient("127.0.0.1", p.port).exists([b"k"])
        assert stats(p)["refused_cap"] == 2
        assert "--max-connections limit" in p.log.read_text()
        held.pop().close()
        until(lambda: serves(p.port), what="a slot freed by a closed connection")
    finally:
        for s in held:
            s.close()
        p.kill()


def test_a_trickled_partial_length_prefix_is_cut_off_by_the_frame_timeout(tmp_path: Path) -> None:
    p = lm_server(tmp_path, "--idle-timeout", "600")
    try:
        s, _ = greeting(p.port)
        head = frame(m.RemoteGet(key=b"k"))[:3]
        for b in head:  # three bytes of four, a third of a second apart: still one frame in progress
            s.sendall(bytes([b]))
            time.sleep(0.3)  # a sleep (pacing): the prefix trickles in slower than a frame
        got = reply_of(s)  # waits up to 5 s: the idle timeout (600 s) must not be what applies
        assert isinstance(got, m.ErrorReply) and got.code == "timeout" and "length prefix" in got.message
        assert closed(s)
        s.close()
        assert stats(p)["frame_timeouts"] == 1
        assert serves(p.port)
    finally:
        p.kill()


def test_idle_connections_are_closed_and_the_client_reconnects_unnoticed(tmp_path: Path) -> None:
    p = lm_server(tmp_path, "--idle-timeout", "1")
    try:
        s, hello = greeting(p.port)
        assert isinstance(hello, m.ServerHello)
        assert closed(s), "closed by the idle timeout, with nothing sent"  # the socket waits up to 5 s
        s.close()
        c = LMClient("127.0.0.1", p.port)
        c.put(b"k", b"v" * 100)
        until(lambda: c._sock is not None and closed_now(c._sock), what="the client's idle connection closed")
        assert c.get(b"k") == b"v" * 100, "the next call opens a new connection instead of failing"
        c.close()
        assert stats(p)["idle_closed"] == 2
    finally:
        p.kill()


def closed_now(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def test_trickled_max_size_puts_keep_memory_bounded(tmp_path: Path) -> None:
    # --frame-timeout is the window the test has to set the scene (twelve connections, each frame
    # started) before the first frame's timeout ends it; a machine too loaded for that window
    # shows it (a timeout counted before the scene is set) and gets the next, longer one.
    for window in (6, 24, 96):
        if _trickled_puts_keep_memory_bounded(tmp_path / f"w{window}", window):
            return
    raise AssertionError("even a 96 s --frame-timeout ended a frame before twelve were started")


def _trickled_puts_keep_memory_bounded(tmp_path: Path, window: int) -> bool:
    """The test in one window; False when the window closed before the scene was set."""
    tmp_path.mkdir()
    budget = 24 * MIB  # three 8 MiB frames
    p = start_lm_server(tmp_path, None, "--max-frame", "8", "--max-inflight-bytes", str(budget / (1 << 30)),
                        "--frame-timeout", str(window))
    conns: list[socket.socket] = []
    try:
        base = rss(p.proc.pid)

        def trickle(n: int) -> None:
            for _ in range(n):
                s, _ = greeting(p.port)
                s.sendall(frame(m.RemotePut(key=os.urandom(8), nbytes=8 * MIB)) + b"x" * 1000)
                conns.append(s)

        trickle(3)  # these three take the whole budget...
        until(lambda: stats(p)["inflight_bytes"] >= budget, what="three frames holding the budget")
        trickle(9)  # ...so these nine wait for room, with no buffer of their own
        until(lambda: stats(p)["waiting_for_room"] == 9 or stats(p)["frame_timeouts"],
              what="nine frames waiting for room")
        for s in conns:
            s.sendall(b"y")  # still trickling
        st = stats(p)
        if st["frame_timeouts"] or st["busy"]:
            return False
        assert st["peak_inflight_bytes"] <= budget
        grown = rss(p.proc.pid) - base
        assert grown < budget + 16 * MIB, f"RSS grew {grown / MIB:.0f} MiB; 12 unbounded buffers would be 96 MiB"
        replies = [reply_of(s) for s in conns]  # each frame's own timeout ends it
        codes = [r.code for r in replies if isinstance(r, m.ErrorReply)]
        assert codes.count("timeout") >= 3 and "busy" in codes, codes
        busy = next(r for r in replies if isinstance(r, m.ErrorReply) and r.code == "busy")
        assert "--max-inflight-bytes" in busy.message
        assert stats(p)["inflight_bytes"] == 0, "every reservation was given back"
        assert serves(p.port)
        return True
    finally:
        for s in conns:
            s.close()
        p.kill()


def test_a_client_that_does_not_read_its_replies_is_cut_off(tmp_path: Path) -> None:
    p = lm_server(tmp_path, "--max-frame", "1", "--send-timeout", "1")
    try:
        value = os.urandom(MIB)
        c = LMClient("127.0.0.1", p.port)
        c.put(b"big", value)
        s, _ = greeting(p.port, rcvbuf=4096)
        s.sendall(frame(m.RemoteGet(key=b"big")) * 40)  # 40 MiB of replies, none read for now
        until(lambda: stats(p)["send_timeouts"] == 1, what="the send timeout")
        got = 0
        while True:  # what was already in the socket buffers, then the end
            try:
                k = len(s.recv(1 << 20))
            except ConnectionError:
                break
            if not k:
                break
            got += k
        assert got < 40 * MIB
        s.close()
        assert c.get(b"big") == value, "other connections never noticed"
        c.close()
    finally:
        p.kill()


def test_a_max_frame_above_the_inflight_budget_is_a_start_error() -> None:
    r = subprocess.run([sys.executable, "-m", "kvferry.launcher.lm_server", "127.0.0.1", "5", "--max-frame", "512",
                        "--max-inflight-bytes", "0.25"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "raise --max-inflight-bytes" in r.stderr


class LyingServer:
    """A peer that greets like a kvferry-server, then answers every request with `reply`."""

    def __init__(self, reply: m.Msg) -> None:
        self.reply = reply
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.lock, self.closed = threading.Lock(), False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.lsock.accept()
            with self.lock:
                if self.closed:  # close() came first and could not shut this one down
                    conn.close()
                    return
                self.conns.append(conn)
            conn.sendall(frame(m.ServerHello(auth=False)))
            while head := conn.recv(4, socket.MSG_WAITALL):
                conn.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)
                conn.sendall(frame(self.reply))  # and never the payload it announced
        except OSError:
            pass  # shut down by the test

    def close(self) -> None:
        """Stop the thread, wherever it waits: shutdown() wakes a blocked accept() or recv(); close() alone does not."""
        with self.lock:
            self.closed = True
            socks = [self.lsock, *self.conns]
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected (the listener, or a peer already gone)
            s.close()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the fake server's thread was left behind"


@pytest.mark.parametrize("max_bytes", [4096, None])
def test_a_reply_larger_than_expected_is_an_error_not_an_allocation(max_bytes: int | None) -> None:
    fake = LyingServer(m.RemoteReply(found=True, nbytes=1 << 40))
    try:
        c = LMClient("127.0.0.1", fake.port, timeout=30)
        t0 = time.monotonic()
        with pytest.raises(LMError, match=f"at most {max_bytes or 256 * MIB} bytes"):
            c.get(b"k", max_bytes=max_bytes)
        assert time.monotonic() - t0 < 10, "refused on the header, not after waiting for a terabyte"
        assert c._sock is None, "the stream is lost: the connection is dropped"
    finally:
        fake.close()


def test_an_exists_answer_of_another_length_is_an_error() -> None:
    fake = LyingServer(m.RemoteReply(found_keys=[True]))
    try:
        with pytest.raises(LMError, match="1 flags for 2 keys"):
            LMClient("127.0.0.1", fake.port).exists([b"a", b"b"])
    finally:
        fake.close()


def test_a_trickled_reply_cannot_stretch_a_call_past_its_timeout() -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def trickle() -> None:  # a byte of the reply every 0.2 s: each recv() is quick, the whole is not
        conn, _ = lsock.accept()
        with conn:
            conn.sendall(frame(m.ServerHello(auth=False)))
            conn.recv(1 << 16)
            for b in frame(m.RemoteReply(found_keys=[False] * 100)):
                if done.wait(0.2):
                    return
                conn.sendall(bytes([b]))

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        c = LMClient("127.0.0.1", lsock.getsockname()[1], timeout=1)
        t0 = time.monotonic()
        with pytest.raises(LMError, match="TimeoutError"):
            c.exists([b"k"] * 100)
        assert time.monotonic() - t0 < 10, "bounded by the call's timeout (1 s), not by each recv (29 s of trickle)"
    finally:
        done.set()
        t.join(timeout=10)
        lsock.close()
        assert not t.is_alive()
