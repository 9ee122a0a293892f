"""Addresses beyond loopback: IPv6 endpoints on every kvferry socket and the proxy,
bind failures that name their cause, advertised addresses distinct from bind addresses, and the
proxy's KV-arrival wait with one sample per transfer."""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time

import httpx
import pytest
import zmq

from kvferry.common import netutil, secret, zsock
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.proxy.instance_flags import OptionError
from kvferry.proxy.options import parse
from tests.polling import until
from tests.stub_procs import Proc, log, stub


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this kernel has no IPv6 loopback (::1)")


def test_ipv6_endpoints_are_bracketed() -> None:
    assert zsock.tcp("::1", 5555) == "tcp://[::1]:5555"
    assert zsock.tcp("[::1]", 5555) == "tcp://[::1]:5555"
    assert zsock.tcp("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert zsock.tcp("::", 5555) == zsock.tcp("0.0.0.0", 5555) == "tcp://*:5555"
    assert netutil.hostport("fe80::1", 80) == "[fe80::1]:80"
    assert netutil.http_url("::1", 8000) == "http://[::1]:8000"
    assert zsock.is_loopback("::1") and zsock.is_loopback("[::1]") and not zsock.is_loopback("::")
    # "localhost" resolves in both families; the endpoint is one of its addresses, bracketed if IPv6
    assert zsock.tcp("localhost", 1) == "tcp://127.0.0.1:1"  # IPv4 first, as before


@pytest.mark.parametrize("host, expected", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("::1%lo", True),
    ("::ffff:127.0.0.1", True), ("localhost", True), ("LocalHost.", True), (" localhost ", True),
    # a wildcard binds every interface: never loopback ("" included)
    ("", False), ("*", False), ("0.0.0.0", False), ("::", False), ("[::]", False),
    ("10.1.2.3", False), ("fe80::1", False), ("::ffff:10.0.0.1", False),
    # any other name, even one that resolves to loopback: judged by its text, no DNS lookup
    ("my-host", False), ("localhost.example.com", False), ("ip6-localhost", False),
])
def test_is_loopback_is_one_rule_without_dns(host: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dns(*args: object, **kw: object) -> None:
        raise AssertionError(f"is_loopback looked {args[0]!r} up")
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    assert netutil.is_loopback(host) is expected
    assert zsock.is_loopback is netutil.is_loopback  # one rule (zsock's name is kept for kvferry.proxy.app)


@needs_ipv6
@pytest.mark.parametrize("with_secret", [False, True])
def test_ipv6_zmq_sockets_bind_and_talk_on_ipv6_loopback(with_secret: bool) -> None:
    trust = zsock.Trust(secret.load("ipv6-secret-for-the-tests", None)) if with_secret else zsock.PLAIN
    ctx = zmq.Context()
    try:
        port = free_port("::1")
        srv = zsock.listen(ctx, zmq.ROUTER, trust, "::1", port, "test port")
        cli = zsock.connect(ctx, zmq.DEALER, trust, zsock.tcp("::1", port))
        cli.send(b"ping")
        assert srv.poll(5000), "nothing arrived over ::1"
        ident, body = srv.recv_multipart()
        assert body == b"ping"
        srv.send_multipart([ident, b"pong"])
        assert cli.poll(5000) and cli.recv() == b"pong"
        # Bracketed input binds as well (a config value copied from a URL).
        other = zsock.listen(ctx, zmq.PULL, trust, "[::1]", free_port("::1"), "bracketed")
        other.close()
    finally:
        ctx.destroy(linger=0)


def test_ipv6_bind_failure_names_the_real_cause() -> None:
    ctx = zmq.Context()
    try:
        port = free_port()
        held = zsock.listen(ctx, zmq.PULL, zsock.PLAIN, "127.0.0.1", port, "first")
        with pytest.raises(zsock.BindError, match=rf"second: .*port {port} is in use"):
            zsock.listen(ctx, zmq.PULL, zsock.PLAIN, "127.0.0.1", port, "second")
        held.close()
        # An address this machine does not have (a documentation range): not "port in use".
        with pytest.raises(zsock.BindError, match="is not an address of this machine") as e:
            zsock.listen(ctx, zmq.PULL, zsock.PLAIN, "192.0.2.7", free_port(), "foreign")
        assert "in use" not in str(e.value)
        if _has_ipv6_loopback():
            port6 = free_port("::1")
            held6 = zsock.listen(ctx, zmq.PULL, zsock.PLAIN, "::1", port6, "v6")
            with pytest.raises(zsock.BindError, match=rf"\[::1\]:{port6}: port {port6} is in use"):
                zsock.listen(ctx, zmq.PULL, zsock.PLAIN, "::1", port6, "v6 again")
            held6.close()
            with pytest.raises(zsock.BindError, match="is not an address of this machine"):
                zsock.listen(ctx, zmq.PULL, zsock.PLAIN, "2001:db8::7", free_port(), "foreign v6")
    finally:
        ctx.destroy(linger=0)
    assert "port" in zsock.bind_cause(errno.EADDRINUSE, "h", 1)


def test_advertise_receiver_host_is_carried_not_the_url_host() -> None:
    o = parse(["--prefiller", "http://10.0.0.1:8100", "--decoder", "http://10.0.0.2:8200,7000,7001,192.168.5.9"])
    d = o.decoders[0]
    assert d.host == "10.0.0.2" and d.kv_host == "192.168.5.9"
    o = parse(["--prefiller", "http://[fd00::1]:8100",
               "--decoder", "http://[fd00::2]:8200,7000+7002,7001+7003,[fd00::9]"])
    assert o.prefillers[0].url == "http://[fd00::1]:8100"
    assert o.decoders[0].url == "http://[fd00::2]:8200" and o.decoders[0].kv_host == "fd00::9"
    # LMCache-style flags: one receiver host per decoder, or one for all.
    o = parse(["--prefiller-host", "::1", "--prefiller-port", "8100", "--decoder-host", "h1,h2", "--decoder-port",
               "8200,8201", "--decoder-init-port", "7000", "--decoder-alloc-port", "7100",
               "--decoder-receiver-host", "10.9.0.1,10.9.0.2"])
    assert o.prefillers[0].url == "http://[::1]:8100"
    assert [(d.host, d.kv_host, d.init_port) for d in o.decoders] == [("h1", "10.9.0.1", 7000),
                                                                       ("h2", "10.9.0.2", 7001)]
    # Without it: the URL's host, as LMCache does.
    o = parse(["--prefiller", "http://p:1", "--decoder", "http://d:2,3,4"])
    assert o.decoders[0].kv_host == "d"
    for bad, msg in ((["--decoder", "http://d:2,3,4,0.0.0.0"], "not the address prefillers dial"),
                     (["--decoder-host", "a,b", "--decoder-port", "1,2", "--decoder-init-port", "3",
                       "--decoder-alloc-port", "5", "--decoder-receiver-host", "x,y,z"], "3 hosts for 2 decoders"),
                     (["--decoder", "http://d:2,3,4", "--decoder-receiver-host", "x"], "goes with --decoder-host")):
        with pytest.raises(OptionError, match=msg):
            parse(["--prefiller", "http://p:1", *bad])


def test_advertise_config_keys_refuse_a_wildcard() -> None:
    from kvferry.common.config import ConfigError, load_config

    assert load_config(env={"KVFERRY_PD_PEER_ADVERTISE_HOST": "fd00::2"}).pd_peer_advertise_host == "fd00::2"
    for key in ("PD_PEER_ADVERTISE_HOST", "P2P_ADVERTISE_HOST"):
        with pytest.raises(ConfigError, match=f"{key.lower()}.*not an address peers can dial"):
            load_config(env={f"KVFERRY_{key}": "0.0.0.0"})


def test_advertise_wildcard_bind_picks_this_machine_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvferry.common.netutil")
    assert netutil.advertised("10.1.1.1", "203.0.113.5", "k") == "203.0.113.5"
    assert netutil.advertised("127.0.0.1", None, "k") == "127.0.0.1"
    assert netutil.advertised(None, None, "k") == "127.0.0.1"
    assert netutil.advertised("[::1]", None, "k") == "::1"
    chosen = netutil.advertised("0.0.0.0", None, "config key test_wildcard")
    assert chosen not in netutil.WILDCARDS
    assert chosen == (netutil.machine_address() or "127.0.0.1")
    assert any("test_wildcard" in r.getMessage() and chosen in r.getMessage() for r in caplog.records)


def _proxy(args: list[str], host: str = "127.0.0.1") -> Proc:
    port = free_port(host)
    return Proc(["-m", "kvferry.proxy", "--host", host, "--port", str(port), "--health-interval", "0.3", *args],
                netutil.http_url(host, port), "/metrics")


@needs_ipv6
def test_ipv6_proxy_serves_on_ipv6_loopback_and_hears_notifications() -> None:
    ps = [Proc(["-m", "kvferry.testing.stub_engine", "--host", "::1", "--port", str(p := free_port("::1"))],
               f"http://[::1]:{p}", "/health") for _ in range(2)]
    note = free_port("::1")
    px = _proxy(["--prefiller", ps[0].url, "--decoder", f"{ps[1].url},{free_port()},{free_port()}",
                 "--proxy-host", "::1", "--proxy-port", str(note)], "::1")
    r = httpx.post(px.url + "/v1/completions", json={"prompt": "over six", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    req = log(ps[0])["requests"][0]
    assert req["kv_transfer_params"]["disagg_spec"]["receiver_host"] == "::1"
    ctx = zmq.Context()
    try:
        push = zsock.connect(ctx, zmq.PUSH, zsock.PLAIN, zsock.tcp("::1", note))
        push.send(m.encode(m.ProxyNotification(transfer_id=req["kv_transfer_params"]["transfer_id"],
                                               receiver_id="d0", num_chunks=1, num_tokens=2)))
        until(lambda: "kvferry_proxy_kv_transfer_wait_seconds_count 1.0" in httpx.get(px.url + "/metrics").text, 5.0,
              "the transfer wait's sample")
    finally:
        ctx.destroy(linger=0)


def test_advertise_receiver_host_reaches_the_prefiller() -> None:
    p0, d0 = stub(), stub()
    px = _proxy(["--prefiller", p0.url, "--decoder", f"{d0.url},{free_port()},{free_port()},10.77.0.3"])
    r = httpx.post(px.url + "/v1/completions", json={"prompt": "where", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    spec = log(p0)["requests"][0]["kv_transfer_params"]["disagg_spec"]
    assert spec["receiver_host"] == "10.77.0.3"


def _wait_samples(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    count = zero = 0.0
    for line in text.splitlines():
        if line.startswith("kvferry_proxy_kv_transfer_wait_seconds_count"):
            count = float(line.split()[-1])
        if line.startswith('kvferry_proxy_kv_transfer_wait_seconds_bucket{le="0.001"}'):
            zero = float(line.split()[-1])
    return count, zero


def _arrived(url: str) -> float:
    """The proxy's count of receivers' notices for transfers it sent."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('kvferry_proxy_notifications_total{result="arrived"}'):
            return float(line.split()[-1])
    return 0.0


def test_transfer_wait_has_one_sample_per_transfer_whichever_comes_first() -> None:
    """One transfer's notice comes while its prefill is still running (pages reserved early: the
    common case), the other's after the prefiller answered; both are samples, the early one 0.
    The prefill leg's token delay is the window the early notice has to reach the proxy (a ZMQ
    connect and a send); a machine too loaded for it shows it (the notice, counted, timed as a late
    one) and gets the next, longer one."""
    for delay in (0.8, 4.0, 20.0):
        if _early_then_late_notice(delay):
            return
    raise AssertionError("in every window the early notice was timed as a late one: either it never reached the "
                         "proxy within a 20 s prefill, or the proxy times an early notice wrong")


def _early_then_late_notice(delay: float) -> bool:
    """The test with a prefill leg of `delay` s; False when the early notice came too late to tell."""
    p0, d0 = stub(delay), stub()
    note = free_port()
    px = _proxy(["--prefiller", p0.url, "--decoder", f"{d0.url},{free_port()},{free_port()}",
                 "--proxy-host", "127.0.0.1", "--proxy-port", str(note)])
    ctx = zmq.Context()
    t: threading.Thread | None = None
    try:
        push = zsock.connect(ctx, zmq.PUSH, zsock.PLAIN, zsock.tcp("127.0.0.1", note))

        def notice(tid: str) -> None:
            push.send(m.encode(m.ProxyNotification(transfer_id=tid, receiver_id="d0", num_chunks=1, num_tokens=2)))

        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "r", httpx.post(px.url + "/v1/completions", json={"prompt": "early", "max_tokens": 3}, timeout=120)))
        t.start()
        until(lambda: log(p0)["requests"], 60, "the prefill leg to reach the prefiller")
        notice(log(p0)["requests"][0]["kv_transfer_params"]["transfer_id"])  # before the prefiller answers
        until(lambda: _arrived(px.url) == 1.0, 60, "the proxy to count the early notice")
        if _wait_samples(px.url) == (1.0, 0.0):
            return False  # timed when it came, after the prefiller's answer: this window cannot tell
        t.join(120)
        assert out["r"].status_code == 200
        until(lambda: _wait_samples(px.url) == (1.0, 1.0), 60, lambda: f"one sample at 0: {_wait_samples(px.url)}")
        # The usual order: answer first, notice after.
        assert httpx.post(px.url + "/v1/completions", json={"prompt": "late", "max_tokens": 3},
                          timeout=120).status_code == 200
        time.sleep(0.05)  # a sleep (pacing): the notice comes 50 ms after the answer, past the histogram's first bucket
        notice(log(p0)["requests"][1]["kv_transfer_params"]["transfer_id"])
        until(lambda: _wait_samples(px.url)[0] == 2.0, 60, lambda: f"two samples: {_wait_samples(px.url)}")
        transfers = len(log(p0)["requests"])
        count, zero = _wait_samples(px.url)
        assert count == transfers == 2 and zero == 1.0
        text = httpx.get(px.url + "/metrics").text
        assert 'kvferry_proxy_notifications_total{result="arrived"} 2.0' in text
        assert 'result="unknown"' not in text
        return True
    finally:
        if t is not None:
            t.join(120)
        ctx.destroy(linger=0)
        for proc in (px, p0, d0):
            proc.stop()


@needs_ipv6
def test_ipv6_kv_transfer_over_ipv6_loopback_with_the_secret() -> None:
    """A real receiver bound to ::1 and a real sender (NIXL, CurveZMQ) dialling it there."""
    pytest.importorskip("nixl")
    import torch

    from kvferry.sender.kv_sender import KVSender, SenderConfig
    from tests.transfer_helpers import PAGE, ReceiverProc, fingerprint
    from tests.transfer_helpers import trust as trust_of

    key = "an-ipv6-cluster-secret-for-tests"
    r = ReceiverProc(pages=4, opts={"host": "::1", "secret": key}).start()
    s = KVSender(SenderConfig("p6", trust=trust_of(key)), fingerprint())
    try:
        src = torch.randint(0, 256, (2 * PAGE,), dtype=torch.uint8)
        s.register(src)
        assert r.addr.host == "::1"
        res = s.send("t6", r.addr, [b"k6-0" * 4, b"k6-1" * 4],
                     [(src.data_ptr() + i * PAGE, PAGE) for i in range(2)], 64).result(30)
        assert res.sent_chunks == 2 and res.handshook
        kind, num_tokens, data = r.ask("claim", "t6", 10)
        assert kind == "ok" and num_tokens == 64
        assert [data[i] for i in range(2)] == [bytes(src[i * PAGE:(i + 1) * PAGE].numpy()) for i in range(2)]
        assert r.wait_fully_free(5)
    finally:
        s.close()
        r.stop()


def test_advertise_launcher_binds_host_and_advertises_another(tmp_path) -> None:
    """`kvferry up --host/--advertise-host`: vLLM and the receiver bind --host, the proxy is told
    the advertised address (constructors only: nothing starts)."""
    from kvferry.launcher.pd_instances import Decoder
    from kvferry.launcher.vllm_proc import VLLMServer

    d = Decoder("m", tmp_path, None, tmp_path, host="0.0.0.0", advertise_host="10.20.30.40",
                server={"host": "0.0.0.0", "advertise_host": "10.20.30.40"})
    assert d.url.startswith("http://10.20.30.40:") and d.local_url.startswith("http://127.0.0.1:")
    assert d.args[d.args.index("--host") + 1] == "0.0.0.0"
    assert d.disagg_spec()["receiver_host"] == "10.20.30.40"
    text = d.config_path.read_text()
    assert "pd_peer_host: 0.0.0.0" in text and "pd_peer_advertise_host: 10.20.30.40" in text
    v6 = VLLMServer("m", 8000, tmp_path / "x.log", host="::1")
    assert v6.url == "http://[::1]:8000" and v6.args[v6.args.index("--host") + 1] == "::1"
    # The default stays loopback.
    d = Decoder("m", tmp_path, None, tmp_path)
    assert d.url.startswith("http://127.0.0.1:") and d.receiver_host == "127.0.0.1"
    wild = Decoder("m", tmp_path, None, tmp_path, host="0.0.0.0")
    assert wild.receiver_host == (netutil.machine_address() or "127.0.0.1")


def test_advertise_nixl_net_devices_becomes_ucx_net_devices(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from kvferry.buffer.nixl_agent import use_net_devices
    from kvferry.common.config import load_config

    assert load_config(env={"LMCACHE_NIXL_NET_DEVICES": "eth1"}).nixl_net_devices == "eth1"
    monkeypatch.setenv("UCX_NET_DEVICES", "placeholder")
    monkeypatch.delenv("UCX_NET_DEVICES")  # unset here, restored after the test
    use_net_devices("eth1")
    assert os.environ["UCX_NET_DEVICES"] == "eth1"
    caplog.set_level(logging.WARNING)
    use_net_devices("mlx5_0:1")  # the environment wins, with a warning
    assert os.environ["UCX_NET_DEVICES"] == "eth1"
    assert any("UCX_NET_DEVICES" in r.getMessage() for r in caplog.records)


@needs_ipv6
def test_ipv6_lm_server_listens_on_ipv6_loopback() -> None:
    """kvferry-server (lm://) binds an IPv6 address (it was IPv4 only) and a client connects there."""
    import asyncio

    from kvferry.engine.remote.lm.lm_store import LMServer

    async def go() -> None:
        server = LMServer("::1", 0, 1 << 20, 1 << 16)
        await server.start()
        try:
            assert server._lsock is not None and server._lsock.family == socket.AF_INET6
            socket.create_connection(("::1", server.port), timeout=2).close()
        finally:
            server._lsock.close()
    asyncio.run(go())


def test_advertise_host_name_on_loopback_warns(caplog: pytest.LogCaptureFixture) -> None:
    """The classic trap: the machine's own name maps to 127.x in /etc/hosts while it has another
    address; binding or advertising that name would keep peers out."""
    name = socket.gethostname()
    addrs = netutil.resolve(name)
    if not addrs or not all(a.startswith("127.") or a == "::1" for a in addrs) or netutil.machine_address() is None:
        pytest.skip(f"this machine's name {name!r} does not resolve to loopback only ({addrs}) while it has "
                    "another address")
    caplog.set_level(logging.WARNING, logger="kvferry.common.netutil")
    assert netutil.advertised(name, None, "config key pd_peer_host (test)") == name
    assert any("resolves to loopback only" in r.getMessage() and "pd_peer_host (test)" in r.getMessage()
               for r in caplog.records)
