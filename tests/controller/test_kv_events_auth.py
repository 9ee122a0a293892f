"""vLLM's KV events across the network: vLLM's own publisher (vllm.distributed.kv_events,
real ZMQ) on a Unix socket, kvferry's relay republishing it on TCP with the cluster secret. A
subscriber without the secret gets nothing (no event, no replay); the proxy's event stream with it
fills its prefix index, live and from the replay."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
import zmq

from kvferry.common import secret, zsock
from kvferry.common.kv_events_relay import KVEventsRelay, RelaySpec, dialable
from kvferry.common.netutil import free_port
from kvferry.proxy.routing.kv_event_subscription import KVEventSubscription
from kvferry.proxy.routing.prefix_index import PrefixIndex, prefix_keys
from tests.kv_event_helpers import replay_holds
from tests.polling import until, until_async

kv = pytest.importorskip("vllm.distributed.kv_events")

BS = 16
DOC = list(range(2000, 2000 + 4 * BS))
EARLY = list(range(9000, 9000 + BS))  # another prompt, published before anyone listens
SECRET = zsock.Trust(secret.load("kv-events-secret-for-tests", None))
WRONG = zsock.Trust(secret.load("some-other-secret-entirely", None))


def stored(tokens: list[int], first: int = 1) -> kv.BlockStored:
    n = len(tokens) // BS
    return kv.BlockStored(block_hashes=list(range(first, first + n)), parent_block_hash=None,
                          token_ids=tokens[:n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)


def relay_for(tmp: Path, trust: zsock.Trust, host: str = "127.0.0.1") -> tuple[KVEventsRelay, str, str]:
    port, rport = free_port(), free_port()
    r = KVEventsRelay(RelaySpec(f"ipc://{tmp}/ev.sock", f"ipc://{tmp}/replay.sock", host, port, rport), trust).start()
    return r, zsock.tcp(host, port), zsock.tcp(host, rport)


def test_kv_events_auth_only_a_subscriber_with_the_secret_hears_the_relay(tmp_path: Path) -> None:
    pub = kv.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/ev.sock", replay_endpoint=f"ipc://{tmp_path}/replay.sock")
    relay, ep, rep = relay_for(tmp_path, SECRET)
    good = KVEventSubscription("with secret", ep, rep, PrefixIndex(1000), stale_after=5.0, trust=SECRET)
    wrong = KVEventSubscription("wrong secret", ep, rep, PrefixIndex(1000), stale_after=5.0, trust=WRONG)
    plain = KVEventSubscription("no secret", ep, rep, PrefixIndex(1000), stale_after=5.0)
    streams = [good, wrong, plain]

    async def go() -> None:
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored(EARLY, 100)]))
        await until_async(lambda: replay_holds(f"ipc://{tmp_path}/replay.sock") == 1, what="the batch published")
        tasks = [asyncio.ensure_future(s.run(probe_interval=0.2)) for s in streams]
        try:
            await until_async(lambda: len(good.index) == 1)  # the replay, through the relay
            # A PUB shows no subscriber: an empty batch each poll until the relay passes one on live.
            await until_async(lambda: pub.publish(kv.KVEventBatch(ts=time.time(), events=[])) or relay.relayed >= 1,
                              what="the relay to hear the publisher live", every=0.1)
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored(DOC)]))
            await until_async(lambda: len(good.index) == 5)
            assert good.index.cached_tokens(prefix_keys(DOC, BS)) == 4 * BS
            assert good.index.cached_tokens(prefix_keys(EARLY, BS)) == BS
            assert good.fresh
            await asyncio.sleep(1.0)  # a sleep (window): time for strangers' probes and events, were they let in
            for s in (wrong, plain):
                assert len(s.index) == 0 and s.last_seq is None and s.last_heard is None and not s.fresh, s.name
            assert relay.relayed >= 1 and relay.replays >= 1
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(go())
    finally:
        for s in streams:
            s.close()
        relay.close()
        pub.shutdown()


def publish_until_heard(pub: kv.ZmqEventPublisher, sock: zmq.Socket) -> None:
    """Publish until `sock` (subscribed through the relay) has an event: vLLM's publisher and the
    relay drop what they publish before a subscription reaches them, and neither says when one has."""
    def heard() -> bool:
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored(DOC[:BS])]))
        return bool(sock.poll(100))
    until(heard, 60, "an event through the relay (the subscriber with the secret got nothing)", every=0)


def test_kv_events_auth_raw_zmq_stranger_gets_no_frame(tmp_path: Path) -> None:
    """Below the proxy's code: a plain ZMQ SUB and DEALER on the relay's ports receive nothing."""
    pub = kv.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/ev.sock", replay_endpoint=f"ipc://{tmp_path}/replay.sock")
    relay, ep, rep = relay_for(tmp_path, SECRET)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(ep)
        friend = zsock.connect(ctx, zmq.SUB, SECRET, ep)
        friend.setsockopt(zmq.SUBSCRIBE, b"")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(rep)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
        publish_until_heard(pub, friend)
        assert len(friend.recv_multipart()) == 3
        for i in range(5):
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored(DOC[:BS], 10 + i)]))
            time.sleep(0.05)  # a sleep (pacing): events spread out over time, each a chance for a stranger
        assert not sub.poll(500) and not dealer.poll(100), "a stranger received KV events"
    finally:
        ctx.destroy(linger=0)
        relay.close()
        pub.shutdown()


def test_kv_events_auth_relay_beyond_loopback_needs_the_secret(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    spec = RelaySpec(f"ipc://{tmp_path}/ev.sock", None, "0.0.0.0", free_port())
    with pytest.raises(zsock.ExposureError, match="kv_events_relay_port"):
        KVEventsRelay(spec, zsock.Trust(None, require=True)).start()
    caplog.set_level(logging.WARNING)
    KVEventsRelay(spec, zsock.PLAIN).start().close()  # allowed, with a warning naming the key
    assert any("kv_events_relay_port" in r.getMessage() and "SECURITY" in r.getMessage() for r in caplog.records)
    assert dialable("tcp://*:5557") == "tcp://127.0.0.1:5557" and dialable("ipc:///x") == "ipc:///x"
    with pytest.raises(zsock.BindError, match="replay_endpoint"):
        KVEventsRelay(RelaySpec(f"ipc://{tmp_path}/ev.sock", None, "127.0.0.1", free_port(), free_port()),
                      zsock.PLAIN).start()


def test_kv_events_auth_connector_starts_the_relay_from_its_config(tmp_path: Path) -> None:
    """The scheduler side's relay (connector/kv_events.start_relay) from vLLM's own KVEventsConfig."""
    from types import SimpleNamespace

    from vllm.config import KVEventsConfig

    from kvferry.common.config import ConfigError, load_config
    from kvferry.connector.vllm_kv_events import start_relay

    port, rport = free_port(), free_port()
    cfg = load_config(env={"KVFERRY_KV_EVENTS_RELAY_PORT": str(port), "KVFERRY_KV_EVENTS_RELAY_REPLAY_PORT": str(rport),
                           "KVFERRY_CLUSTER_SECRET": "kv-events-secret-for-tests"})
    on = SimpleNamespace(kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/ev.sock",
        replay_endpoint=f"ipc://{tmp_path}/replay.sock"))
    assert start_relay(load_config(env={}), on) is None  # not configured: no relay
    with pytest.raises(ConfigError, match="kv_events_relay_port relays vLLM's KV events"):
        start_relay(cfg, SimpleNamespace(kv_events_config=None))
    pub = kv.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/ev.sock", replay_endpoint=f"ipc://{tmp_path}/replay.sock")
    relay = start_relay(cfg, on)
    assert relay is not None
    ctx = zmq.Context()
    try:
        sub = zsock.connect(ctx, zmq.SUB, SECRET, zsock.tcp("127.0.0.1", port))
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        publish_until_heard(pub, sub)
        assert len(sub.recv_multipart()) == 3
    finally:
        ctx.destroy(linger=0)
        relay.close()
        pub.shutdown()
    with pytest.raises(ConfigError, match="kv_events_relay_port"):
        load_config(env={"KVFERRY_KV_EVENTS_RELAY_REPLAY_PORT": "5558"})
