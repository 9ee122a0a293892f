"""Wire messages: round trips, and nothing but MessageError out of hostile frames."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.common.wire import messages as m

FP = m.LayoutFingerprint(model="tiny", dtype="bfloat16", num_layers=8, num_kv_heads=8, head_size=64,
                         block_size=16, kv_layout="cpu", chunk_format="block", chunk_size=256)
PEER = m.PeerAddr(host="localhost", init_port=8200, lookup_port=8201)
WORKER = m.WorkerInfo(instance_id="i1", worker_id=0, epoch="e", host="localhost", worker_port=8500,
                      p2p_init_port=8200, p2p_lookup_port=8201, salt=b"s" * 16, chunk_size=256,
                      partial_chunks=True, heartbeat_timeout=30.0, cpu_capacity=1 << 30)
SAMPLES = [
    m.Hello(peer_id="p0", tp_rank=0, agent_name="a", agent_metadata=b"\x00" * 100, fingerprint=FP),
    m.Welcome(peer_id="d0", epoch=7, agent_name="b", agent_metadata=b"x", fingerprint=FP,
              region=m.Region(addr=1 << 40, page_bytes=4 << 20, num_pages=256)),
    m.AllocRequest(transfer_id="t1", sender_id="p0", epoch=7, chunk_keys=[b"k" * 16] * 3, num_tokens=700),
    m.AllocResponse(transfer_id="t1", generation=3, pages=[4, 5], lease_seconds=30.0),
    m.ErrorReply(code="buffer_full", message="raise pd_buffer_size", transfer_id="t1"),
    m.ArrivalNotice(transfer_id="t1", generation=3),
    m.AbortTransfer(transfer_id="t1", reason="client gone", final=True),
    m.AbortTransfer(transfer_id="t1", generation=3, ack=True),
    m.AbortAck(transfer_id="t1", generation=3),
    m.RenewLease(transfer_id="t1", generation=3),
    m.LeaseRenewed(transfer_id="t1", generation=3, lease_seconds=30.0),
    m.ProxyNotification(transfer_id="t1", receiver_id="d0", num_chunks=3, num_tokens=700),
    m.ServerHello(auth=True, nonce=b"n" * 32),
    m.AuthAnswer(nonce=b"c" * 32, mac=b"m" * 32),
    m.AuthOk(mac=b"m" * 32),
    m.RemotePut(key=b"k" * 16, nbytes=4 << 20),
    m.RemoteGet(key=b"k" * 16),
    m.RemoteExists(keys=[b"k" * 16, b"j" * 16]),
    m.RemoteReply(ok=True, found=True, nbytes=10, found_keys=[True, False]),
    m.RegisterWorker(worker=WORKER),
    m.DeregisterWorker(instance_id="i1", worker_id=0, epoch="e"),
    m.Heartbeat(worker=WORKER, num_chunks=3, used_bytes=1 << 20),
    m.ChunkAdmit(instance_id="i1", worker_id=0, epoch="e", location="LocalCPUBackend", keys=[b"a" * 16],
                 sizes=[1 << 20], reset=True),
    m.ChunkEvict(instance_id="i1", worker_id=0, epoch="e", location="LocalCPUBackend", keys=[b"a" * 16]),
    m.TransferReport(instance_id="i2", peer_id="i1", num_chunks=4, nbytes=1 << 25, seconds=0.01, ok=True),
    m.LookupRequest(instance_id="i2", keys=[b"a" * 16]),
    m.LookupResponse(instance_id="i1", location="LocalCPUBackend", num_chunks=1, peers=[PEER]),
    m.PullChunks(event_id="e1", source_id="i1", source=PEER, keys=[b"a" * 16]),
    m.DropChunks(event_id="e1", keys=[b"a" * 16]),
    m.ClearChunks(event_id="e2"),
    m.Resync(event_id="e3"),
    m.CommandResult(event_id="e1", ok=True, num_chunks=1, nbytes=10),
    m.TierNotice(adopted=[b"a" * 16], sizes=[10], dropped=[b"b" * 16]),
    m.PeerFetch(request_id="r1", agent_name="a", keys=[b"a" * 16]),
    m.PeerChunks(request_id="r1", lease_id="l1", addrs=[1 << 40], sizes=[1 << 20], lease_seconds=10.0,
                 metadata=[b"md"], spans=[m.Span(addr=1 << 40, nbytes=1 << 20)], tags=[bytes(16)]),
    m.PeerRelease(lease_id="l1"),
    m.InstanceRecord(instance_id="d-1", role="decoder", model="tiny", url="http://10.0.0.2:8000",
                     receiver_host="10.0.0.2", init_ports=[7100], alloc_ports=[7101],
                     kv_events=["tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558"], fingerprint="ab12", lease=7),
    m.DrainMark(instance_id="d-1"),
    m.SignedEntry(body=b"\x81", sig=b"s" * 32),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(m.Message.__args__)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg: m.Msg) -> None:
    assert m.decode(m.encode(msg)) == msg
    assert m.decode(m.encode(msg), expect=type(msg)) == msg


def test_wrong_version_is_named() -> None:
    frame = msgspec.msgpack.encode({"t": "arrived", "v": 99, "transfer_id": "t", "generation": 1})
    with pytest.raises(m.MessageError) as e:
        m.decode(frame)
    assert e.value.kind == "version"
    # A future version with fields this side does not know is still reported as a version issue.
    frame = msgspec.msgpack.encode({"t": "arrived", "v": m.PROTOCOL_VERSION + 1, "new_field": [1]})
    with pytest.raises(m.MessageError) as e:
        m.decode(frame)
    assert e.value.kind == "version"


def test_oversized_frame_rejected_before_parsing() -> None:
    with pytest.raises(m.MessageError) as e:
        m.decode(b"\x00" * 100, max_bytes=99)
    assert e.value.kind == "too_large"


def test_unexpected_type() -> None:
    with pytest.raises(m.MessageError) as e:
        m.decode(m.encode(SAMPLES[5]), expect=(m.AllocRequest, m.Hello))
    assert e.value.kind == "unexpected" and "AllocRequest" in str(e.value)


def test_limits_enforced() -> None:
    v = m.PROTOCOL_VERSION
    too_many = msgspec.msgpack.encode({"t": "lookup_req", "v": v, "keys": [b"k"] * ((1 << 16) + 1)})
    with pytest.raises(m.MessageError):
        m.decode(too_many)
    negative = msgspec.msgpack.encode({"t": "arrived", "v": v, "transfer_id": "t", "generation": -1})
    with pytest.raises(m.MessageError):
        m.decode(negative)


@pytest.mark.parametrize("msg,field,bad", [
    (WORKER, "heartbeat_timeout", float("nan")), (WORKER, "heartbeat_timeout", float("inf")),
    (WORKER, "heartbeat_timeout", 0.0),
])
def test_peer_seconds_must_be_finite_and_bounded(msg, field, bad) -> None:
    # replace() does not validate: these frames are what a hostile peer can send.
    with pytest.raises(m.MessageError, match=field):
        m.decode(m.encode(m.RegisterWorker(worker=msgspec.structs.replace(msg, **{field: bad}))))
    report = next(x for x in SAMPLES if isinstance(x, m.TransferReport))
    for sample, key in ((SAMPLES[3], "lease_seconds"), (report, "seconds")):
        for value in (float("nan"), float("inf"), -1.0):
            with pytest.raises(m.MessageError, match=key):
                m.decode(m.encode(msgspec.structs.replace(sample, **{key: value})))


def test_parallel_lists_must_have_equal_lengths_and_an_alloc_needs_a_key() -> None:
    cases = [
        ({"t": "admit", "instance_id": "i", "worker_id": 0, "epoch": "e", "location": "L", "keys": [b"a", b"b"],
          "sizes": [1]}, "2 keys and 1 sizes"),
        ({"t": "peer_chunks", "request_id": "r", "lease_id": "l", "addrs": [1, 2], "sizes": [1],
          "lease_seconds": 1.0}, "addresses"),
        ({"t": "tier_notice", "adopted": [b"a"], "sizes": []}, "adopted"),
        ({"t": "alloc_req", "transfer_id": "t", "sender_id": "s", "epoch": 1, "chunk_keys": [], "num_tokens": 0},
         "chunk_keys"),
    ]
    for body, why in cases:
        with pytest.raises(m.MessageError, match=why):
            m.decode(msgspec.msgpack.encode({**body, "v": m.PROTOCOL_VERSION}))


def test_fingerprint_diff_shows_both_sides() -> None:
    other = msgspec.structs.replace(FP, dtype="float16", block_size=32)
    assert other.diff(FP) == ["dtype: 'float16' != 'bfloat16'", "block_size: 32 != 16"]


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_message_error(frame: bytes) -> None:
    try:
        m.decode(frame)
    except m.MessageError:
        pass


TAGS = [s.__struct_config__.tag for s in SAMPLES]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(tag=st.sampled_from(TAGS),
       version=st.sampled_from([m.PROTOCOL_VERSION, m.PROTOCOL_VERSION, 0, 1, str(m.PROTOCOL_VERSION), None]),
       data=st.data())
def test_wrong_typed_messages_only_raise_message_error(tag: str, version: object, data: st.DataObject) -> None:
    sample = next(s for s in SAMPLES if s.__struct_config__.tag == tag)
    body = {f: getattr(sample, f) for f in sample.__struct_fields__}
    # Replace a random subset of fields with values of random types.
    for f in data.draw(st.lists(st.sampled_from(sample.__struct_fields__), max_size=3)):
        body[f] = data.draw(json_values)
    body.update(t=tag, v=version)
    frame = msgspec.msgpack.encode(msgspec.to_builtins(body))
    try:
        msg = m.decode(frame)
    except m.MessageError:
        return
    assert isinstance(msg, type(sample)) and msg.v == m.PROTOCOL_VERSION
