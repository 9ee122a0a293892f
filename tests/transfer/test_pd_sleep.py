"""vLLM sleep mode (vLLM >= 0.33 calls unregister_kv_caches / restore_kv_caches around it): the
connector's worker side drains its transfers, drops its NIXL registrations and registers again.

vLLM's CPU build has no sleep mode (its worker ignores sleep), so the connector's worker side is
driven directly, as vLLM's GPU worker drives it, over real NIXL (UCX) between a prefiller and a
decoder in this process. Only vLLM's tensor-parallel rank lookup is replaced (no process group)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("nixl")

from kvferry.buffer import nixl_agent  # noqa: E402
from kvferry.common.config import load_config  # noqa: E402
from kvferry.common.netutil import free_port  # noqa: E402
from kvferry.engine.api import PagedKV, PDConsumer, PDProducer, ReceiverAddr, fingerprint  # noqa: E402
from kvferry.sender.errors import TransferDropped  # noqa: E402
from tests.kv_caches import make_caches  # noqa: E402
from tests.polling import until  # noqa: E402

BS, CHUNK, LAYERS, HEADS, HEAD = 16, 32, 2, 2, 64
NBLOCKS = 24


def rows(caches: list[torch.Tensor], blocks: list[int], n: int) -> list[bytes]:
    """Each of the first `n` tokens' K/V bytes in every layer ("cpu" layout: blocks, heads, slot, 2*head)."""
    return [bytes(t[blocks[i // BS], :, i % BS, :].contiguous().view(torch.uint8).numpy())
            for t in caches for i in range(n)]


def covered(metadata: bytes, tensor: torch.Tensor) -> bool:
    """Whether a fresh NIXL peer that loads `metadata` may address all of `tensor` (what a
    prefiller that handshakes now would get)."""
    probe = nixl_agent.make_agent(f"kvf-sleep-probe-{time.monotonic_ns()}")
    name = probe.add_remote_agent(metadata)
    try:
        descs = probe.get_xfer_descs([(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)], "DRAM")
        return bool(probe.check_remote_metadata(name, descs))
    finally:
        probe.remove_remote_agent(name)


# ---- the connector's worker side, as vLLM's GPU worker calls it ----

def vllm_config(role: str, keys: dict) -> SimpleNamespace:
    mc = SimpleNamespace(model="/models/sleepy", dtype="bfloat16", get_num_kv_heads=lambda pc: HEADS,
                         get_total_num_kv_heads=lambda: HEADS,
                         get_head_size=lambda: HEAD)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=keys, engine_id="sleepy"),
        model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"))


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch):
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry.connector import KVFerryConnector

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    init, alloc = free_port(), free_port()
    common = {"chunk_size": CHUNK, "enable_pd": True, "local_cpu": False, "pd_buffer_size": 16 * 16384,
              "pd_lease_seconds": 5.0, "pd_kv_ready_timeout": 60.0}
    p = KVFerryConnector(vllm_config("kv_producer", {**common, "pd_role": "sender"}), KVConnectorRole.WORKER)
    d = KVFerryConnector(vllm_config("kv_consumer", {**common, "pd_role": "receiver", "pd_peer_host": "127.0.0.1",
                                                     "pd_peer_init_port": init, "pd_peer_alloc_port": alloc}),
                         KVConnectorRole.WORKER)
    src = make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=1)
    dst = make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=2)
    try:
        p.register_kv_caches({f"layers.{i}.attn": t for i, t in enumerate(src)})
        d.register_kv_caches({f"layers.{i}.attn": t for i, t in enumerate(dst)})
        yield p, d, src, dst, (init, alloc)
    finally:
        p.shutdown()
        d.shutdown()


def pd_transfer(p, d, ports: tuple[int, int], tid: str, n: int, seed: int, load: bool = True
                ) -> tuple[list[int], list[int]]:
    """One prompt of `n` tokens through both connectors as vLLM's steps drive them: the
    prefiller opens, computes and saves it; the decoder loads it. (source blocks, decoder blocks)."""
    from kvferry.connector.metadata import KVFerryMetadata, LoadOp, OpenOp, SaveOp

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 4000, (n,), generator=g).tolist()
    src_blocks = torch.randperm(NBLOCKS, generator=g)[:-(-n // BS)].tolist()
    dst_blocks = torch.randperm(NBLOCKS, generator=g)[:-(-n // BS)].tolist()
    host, (init, alloc) = "127.0.0.1", ports
    if load:
        d.bind_connector_metadata(KVFerryMetadata(loads=[LoadOp("dreq", tid, tokens, dst_blocks, n - 1, 0)]))
        d.start_load_kv(None)
        d.clear_connector_metadata()
    p.bind_connector_metadata(KVFerryMetadata(opens=[OpenOp("preq", tid, host, (init,), (alloc,), tokens, n)]))
    p.start_load_kv(None)
    p.clear_connector_metadata()
    p.bind_connector_metadata(KVFerryMetadata(saves=[SaveOp("preq", tid, host, (init,), (alloc,), tokens, src_blocks,
                                                            n)]))
    p.wait_for_save()
    p.clear_connector_metadata()
    return src_blocks, dst_blocks


def decoder_step(d) -> tuple[set[str], set[int]]:
    """One idle engine step on the decoder: (requests whose load ended, block ids that failed)."""
    from kvferry.connector.metadata import KVFerryMetadata

    d.bind_connector_metadata(KVFerryMetadata(idle=True))
    done = d.get_transfer_results(set()).finished_recving
    d.clear_connector_metadata()
    return done, d.get_block_ids_with_load_errors()


def loaded(d, timeout: float = 60.0) -> tuple[set[str], set[int]]:
    """Steps until a load ends: (those requests, failed block ids; empty when loaded)."""
    def ended() -> tuple[set[str], set[int]] | None:
        done, errors = decoder_step(d)
        return (done, errors) if done else None
    return until(ended, timeout, "a load to end", every=0)


def test_sleep_mode_is_claimed_only_with_the_hooks_that_make_it_true() -> None:
    from kvferry.connector import KVFerryConnector

    assert KVFerryConnector.supports_sleep_mode(SimpleNamespace(kv_connector_extra_config={})) is True
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        assert hook in vars(KVFerryConnector), f"{hook} must be kvferry's own, not vLLM's no-op"


def test_sleep_restore_then_pd_transfer_is_byte_exact_and_nixl_registrations_follow(workers) -> None:
    p, d, src, dst, ports = workers
    pw, dw = p._worker, d._worker
    staging, pd_buffer = pw.producer.staging.tensor, dw.consumer.buffer.tensor
    receiver, sender = dw.consumer.receiver, pw.producer.sender
    n = 150

    # Before sleep: one transfer, so the prefiller holds the decoder's registration (its handshake).
    sb, db = pd_transfer(p, d, ports, "T1", n, seed=1)
    assert loaded(d) == ({"dreq"}, set())
    assert rows(dst, db, n - 1) == rows(src, sb, n - 1)
    assert covered(receiver._agent_metadata, pd_buffer) and covered(sender._metadata, staging)
    epoch = receiver.epoch

    d.unregister_kv_caches()
    p.unregister_kv_caches()
    d.unregister_kv_caches()  # idempotent, as vLLM asks
    # Skipping the deregistration fails here: a peer loading either side's NIXL metadata could
    # still address memory that vLLM is about to unmap.
    assert not covered(receiver._agent_metadata, pd_buffer), "the decoder's pd_buffer is still registered"
    assert not covered(sender._metadata, staging), "the prefiller's staging pages are still registered"

    # Asleep: no transfer starts (the decoder would recompute the prompt).
    pd_transfer(p, d, ports, "T2", n, seed=2, load=False)
    assert pw.producer.counters.failures.get("asleep") == 1
    assert pw.producer.staging.fully_free() and dw.consumer.buffer.fully_free()

    p.restore_kv_caches()
    d.restore_kv_caches()
    d.restore_kv_caches()
    assert covered(receiver._agent_metadata, pd_buffer) and covered(sender._metadata, staging)
    assert receiver.epoch != epoch, "a new registration must come with a new epoch"

    # After wake-up: the prefiller's old view of the decoder is refused (stale epoch), it
    # handshakes again and writes into the new registration, byte-exact.
    sb, db = pd_transfer(p, d, ports, "T3", n, seed=3)
    assert loaded(d) == ({"dreq"}, set())
    assert rows(dst, db, n - 1) == rows(src, sb, n - 1), "the decoder's KV differs from the prefiller's"
    assert sender.counters.handshakes == 2
    until(lambda: pw.producer.staging.fully_free() and dw.consumer.buffer.fully_free(), 60, "every page back")


# ---- a write in flight when the decoder goes to sleep ----

@pytest.fixture
def pair():
    cfg = load_config({"chunk_size": CHUNK, "pd_buffer_size": 16 * 16384, "pd_peer_host": "127.0.0.1",
                       "pd_peer_init_port": free_port(), "pd_peer_alloc_port": free_port(),
                       "pd_lease_seconds": 60.0, "pd_kv_ready_timeout": 5.0})
    src_caches = make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=1)
    dst_caches = make_caches("cpu", LAYERS, NBLOCKS, BS, HEADS, HEAD, torch.bfloat16, seed=2)
    src, dst = PagedKV(src_caches, "cpu"), PagedKV(dst_caches, "cpu")
    fp = fingerprint(src, "sleepy", CHUNK, "block")
    consumer = PDConsumer(cfg, dst, fp)
    producer = PDProducer(cfg, src, fp, "sleepy-sender")
    addr = ReceiverAddr("127.0.0.1", cfg.pd_peer_init_port, cfg.pd_peer_alloc_port)
    try:
        yield producer, consumer, addr
    finally:
        producer.close()
        consumer.close()


def test_sleep_waits_for_a_granted_write_then_deregisters_and_refuses_allocs(pair) -> None:
    producer, consumer, addr = pair
    receiver, pd_buffer = consumer.receiver, consumer.buffer.tensor
    tokens = list(range(100, 196))
    blocks = list(range(6))
    producer.open("G", addr, tokens, 96)
    until(lambda: all(o.grant.done() for o in producer._open["G"].values()), 60, "the decoder's pages granted")

    t0 = time.monotonic()
    done = threading.Event()
    quarantined: list[int] = []
    sleeper = threading.Thread(target=lambda: (quarantined.append(consumer.suspend()), done.set()), daemon=True)
    sleeper.start()
    # The granted transfer is quarantined, not forgotten, and its sender is told: it posts no write
    # from then on and, having posted none, says so (a final abort). Only then does the pd_buffer go.
    assert done.wait(30), "suspend did not end once the sender said no write would land"
    assert time.monotonic() - t0 < 30, "suspend waited for the 60 s lease instead of the sender's word"
    assert producer._open["G"][addr].grant.result().cut, "the decoder slept before the sender stopped writing"
    with pytest.raises(TransferDropped):  # the prompt finished computing meanwhile: nothing more is written
        producer.submit("G", addr, tokens, blocks, 96).result(10)
    assert quarantined == [1] and receiver.table.counters["late_writes"] == 0
    assert not covered(receiver._agent_metadata, pd_buffer)
    assert consumer.buffer.fully_free(), "the drained transfer's pages must be free"

    # Asleep: a prefiller's alloc is refused (it fails fast; the decoder recomputes).
    fut = producer.submit("H", addr, tokens, blocks, 96)
    with pytest.raises(Exception, match="asleep"):
        fut.result(10)
    assert producer.counters.failures.get("asleep") == 1 and receiver.counters.refusals.get("asleep") == 1

    consumer.resume()
    res = producer.submit("I", addr, tokens, blocks, 96).result(10)
    assert res.sent_chunks == 3 and res.handshook, "the sender must handshake again after the decoder woke"
    until(lambda: producer.staging.fully_free(), 60, "staging back")
