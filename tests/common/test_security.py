"""The cluster secret and the sockets made with it (common/secret.py, common/zsock.py), the
exposure rules for ports beyond loopback, and the background-loop supervisor."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import zmq

from kvferry.common import secret, zsock
from kvferry.common.config import ConfigError, load_config
from kvferry.common.netutil import free_port
from kvferry.common.supervise import LoopHealth, supervise, supervise_thread
from tests.polling import until

A, B = "a-cluster-secret-of-32-characters", "another-cluster-secret-entirely!"


def test_keys_are_derived_per_purpose_and_nothing_shows_the_secret(tmp_path: Path) -> None:
    s = secret.from_text(A, "test")
    assert s is secret.from_text(A, "test"), "stretched once per process"
    assert s.key("x") != s.key("y") and s.key("x") != secret.from_text(B, "test").key("x")
    assert len(s.key("x")) == 32
    assert A not in repr(s) and A not in str(s) and s.master.hex() not in repr(s)
    cfg = load_config({"cluster_secret": A}, env={})
    assert A not in repr(cfg) and A not in str(cfg) and "<hidden>" in repr(cfg)
    tag = s.mac("purpose", b"one", b"two")
    assert s.verify("purpose", tag, b"one", b"two")
    assert not s.verify("purpose", tag, b"onet", b"wo"), "the parts are framed: no two splits collide"
    assert not s.verify("other", tag, b"one", b"two")


def test_secret_from_a_file_or_env_and_clear_errors(tmp_path: Path, kvf_logs, monkeypatch) -> None:
    path = tmp_path / "secret"
    secret.write_file(str(path), A)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert secret.from_file(str(path), "t") is secret.from_text(A, "t")
    assert load_config({"cluster_secret_file": str(path)}, env={}).cluster_secret_file == str(path)
    os.chmod(path, 0o644)
    secret.from_file(str(path), "t")
    assert "chmod 600" in kvf_logs.text
    with pytest.raises(ConfigError, match="cluster_secret .*16 to 4096.*kvferry secret"):
        load_config({"cluster_secret": "short"}, env={})
    with pytest.raises(ConfigError, match="cluster_secret_file .*cannot read"):
        load_config(env={"KVFERRY_CLUSTER_SECRET_FILE": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="keep one"):
        load_config({"cluster_secret": A, "cluster_secret_file": str(path)}, env={})
    monkeypatch.setenv("KVFERRY_CLUSTER_SECRET", B)
    assert secret.from_env() is secret.from_text(B, "t")
    assert secret.from_env(str(path)) is secret.from_text(A, "t"), "a --cluster-secret-file wins"
    assert len(secret.generate()) >= secret.MIN_CHARS


def _exchange(server: zsock.Trust, client: zsock.Trust, kind=(zmq.ROUTER, zmq.DEALER)) -> bytes | None:
    ctx = zmq.Context()
    try:
        port = free_port()
        srv = zsock.listen(ctx, kind[0], server, "127.0.0.1", port, "test port")
        cli = zsock.connect(ctx, kind[1], client, zsock.tcp("127.0.0.1", port))
        cli.send(b"hello")
        if not srv.poll(1500):
            return None
        return srv.recv_multipart()[-1]
    finally:
        ctx.destroy(linger=0)


def test_security_secret_file_never_follows_a_link_nor_lands_in_a_readable_file(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    link = tmp_path / "cluster.secret"
    link.symlink_to(target)  # dangling: an O_CREAT open through it would make `elsewhere`
    with pytest.raises(FileExistsError):
        secret.write_file(str(link), A, replace=False)
    assert not target.exists() and link.is_symlink()
    secret.write_file(str(link), A)  # replace: the link itself is replaced
    assert not target.exists() and not link.is_symlink()
    assert link.read_text() == A + "\n" and os.stat(link).st_mode & 0o777 == 0o600

    old = tmp_path / "old.secret"
    old.write_text("old\n")
    os.chmod(old, 0o644)
    seen = tmp_path / "seen"  # a second name for the old file's inode, as a reader holding it open would see
    os.link(old, seen)
    secret.write_file(str(old), B)
    assert old.read_text() == B + "\n" and os.stat(old).st_mode & 0o777 == 0o600
    assert seen.read_text() == "old\n", "the secret was never written into the 0644 inode"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.secret", "old.secret", "seen"], "no temp left"


def test_security_kvferry_secret_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    from kvferry.launcher.cli import main
    out = tmp_path / "s"
    assert main(["secret", "--out", str(out)]) == 0
    first = out.read_text()
    assert main(["secret", "--out", str(out)]) == 2 and out.read_text() == first
    assert main(["secret", "--out", str(out), "--force"]) == 0 and out.read_text() != first
    assert os.stat(out).st_mode & 0o777 == 0o600


def test_curve_lets_only_holders_of_the_same_secret_through() -> None:
    good, other = zsock.Trust(secret.from_text(A, "t")), zsock.Trust(secret.from_text(B, "t"))
    assert _exchange(good, good) == b"hello"
    assert _exchange(good, other) is None, "a wrong secret must not get a frame through"
    assert _exchange(good, zsock.PLAIN) is None, "no secret must not get a frame through"
    assert _exchange(zsock.PLAIN, good) is None, "a secret holder does not talk to an unauthenticated server"
    assert _exchange(zsock.PLAIN, zsock.PLAIN) == b"hello", "without secrets: plain ZMQ, as LMCache"
    assert _exchange(good, good, (zmq.PULL, zmq.PUSH)) == b"hello"
    assert _exchange(good, other, (zmq.PULL, zmq.PUSH)) is None


def test_frames_above_the_socket_bound_never_arrive() -> None:
    ctx = zmq.Context()
    try:
        port = free_port()
        srv = zsock.listen(ctx, zmq.PULL, zsock.PLAIN, "127.0.0.1", port, "test port", max_bytes=1024)
        cli = zsock.connect(ctx, zmq.PUSH, zsock.PLAIN, zsock.tcp("127.0.0.1", port))
        cli.send(b"x" * 4096)
        assert not srv.poll(500)
        cli = zsock.connect(ctx, zmq.PUSH, zsock.PLAIN, zsock.tcp("127.0.0.1", port))
        cli.send(b"small")
        assert srv.poll(2000) and srv.recv() == b"small", "the port keeps serving other peers"
    finally:
        ctx.destroy(linger=0)


def test_a_port_beyond_loopback_without_a_secret_warns_once_or_fails_when_required(kvf_logs) -> None:
    assert zsock.is_loopback("127.0.0.1") and zsock.is_loopback("localhost") and zsock.is_loopback("::1")
    assert not zsock.is_loopback("0.0.0.0") and not zsock.is_loopback("*") and not zsock.is_loopback("10.1.2.3")
    zsock.check_exposure("127.0.0.1", "test_key_a", zsock.PLAIN)
    assert "SECURITY" not in kvf_logs.text
    zsock.check_exposure("0.0.0.0", "test_key_b", zsock.PLAIN)
    zsock.check_exposure("0.0.0.0", "test_key_b", zsock.PLAIN)
    lines = [r for r in kvf_logs.records if "SECURITY" in r.getMessage()]
    assert len(lines) == 1 and "test_key_b" in lines[0].getMessage() and "cluster_secret" in lines[0].getMessage()
    with pytest.raises(zsock.ExposureError, match="require_cluster_secret"):
        zsock.check_exposure("0.0.0.0", "test_key_c", zsock.Trust(require=True))
    zsock.check_exposure("0.0.0.0", "test_key_d", zsock.Trust(secret.from_text(A, "t"), require=True))


def test_a_loop_that_raises_is_logged_counted_and_started_again(kvf_logs) -> None:
    runs: list[int] = []
    health = LoopHealth("test loop")

    async def body() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError(f"boom {len(runs)}")
        health.recovered()

    asyncio.run(asyncio.wait_for(supervise(health, body, pause=0.01), 5))
    assert len(runs) == 3 and health.restarts == 2 and health.ok and "boom 2" in health.last_error
    assert "test loop failed" in kvf_logs.text and "boom 1" in kvf_logs.text

    stop = threading.Event()
    th = LoopHealth("test thread")
    calls: list[float] = []

    def tbody() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ValueError("thread boom")
        stop.wait()

    t = threading.Thread(target=supervise_thread, args=(th, tbody, stop, 0.01))
    t.start()
    until(lambda: len(calls) >= 2, 60, "the thread's restart", every=0.01)
    stop.set()
    t.join(5)
    assert len(calls) == 2 and th.restarts == 1 and not t.is_alive()


def test_an_authorization_header_carries_the_key_as_bearer_or_basic_and_nothing_else() -> None:
    import base64
    key = "admin-key-123"
    basic = "Basic " + base64.b64encode(f"anyone:{key}".encode()).decode()
    assert secret.authorized(f"Bearer {key}", key) and secret.authorized(f"bearer  {key} ", key)
    assert secret.authorized(basic, key)
    for bad in (None, "", key, f"Bearer {key}x", f"Bearer {key[:-1]}", "Basic !!!",
                "Basic " + base64.b64encode(key.encode()).decode(), f"Token {key}", "Bearer \udcff"):
        assert not secret.authorized(bad, key), bad
