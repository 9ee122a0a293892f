"""The PD path's decoder side: :class:`PDConsumer` waits for each expected transfer, checks its
chunk keys against the decoder's own prompt and scatters the chunks into the request's blocks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvferry.buffer.pd_buffer import PDBuffer
from kvferry.common import live_gauges
from kvferry.common.config import KVFerryConfig
from kvferry.common.hashing import chunk_keys
from kvferry.common.log import get_logger
from kvferry.common.reasons import CLIENT_LEFT
from kvferry.common.samples import Samples
from kvferry.common.units import fmt_bytes
from kvferry.common.wire import messages as m
from kvferry.engine.chunking import chunk_tokens, scatter_chunks
from kvferry.engine.pd.kv_spans import kv_spans, wall_ns
from kvferry.engine.pd.shared import buffer_device, buffer_gauges, bump, key_salt
from kvferry.kernels.layout import LayoutError
from kvferry.kernels.paged_copy import PagedKV
from kvferry.receiver.kv_receiver import KVReceiver, receiver_config
from kvferry.receiver.transfer_table import TransferError

logger = get_logger(__name__)



@dataclass
class ConsumerCounters:
    """A decoder rank's loads. A recomputed request is one whose KV did not arrive ("timeout"), whose
    transfer ended unread ("ended"), or whose chunks failed their checks ("mismatch")."""

    loaded: int = 0
    received_bytes: int = 0
    kv_timeouts: int = 0
    recomputed: dict[str, int] = field(default_factory=dict)
    arrival_wait_seconds: float = 0.0  # scheduled -> its KV loaded
    arrival_waits: int = 0


@dataclass
class _Expected:
    req_id: str
    transfer_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_tokens: int
    skip_tokens: int  # already computed locally (prefix cache): those blocks are not written
    deadline: float
    started: float = field(default_factory=time.monotonic)
    traceparent: str | None = None  # the decode leg's: its KV spans go under it


def _ids(e: _Expected) -> dict[str, str]:
    """A span's names for the request: the transfer's id and vLLM's (which holds the X-Request-Id)."""
    return {"kvferry.transfer_id": e.transfer_id, "kvferry.vllm_request_id": e.req_id}


class PDConsumer:
    """Decoder side: one per worker (TP rank); owns the receiver and its pd_buffer."""

    def __init__(self, cfg: KVFerryConfig, kv: PagedKV, fp: m.LayoutFingerprint, tp_rank: int = 0,
                 receiver_id: str | None = None) -> None:
        self.cfg, self.kv, self.fp, self.tp_rank = cfg, kv, fp, tp_rank
        self.fmt = fp.chunk_format
        device = buffer_device(cfg, kv)
        self.buffer = PDBuffer(cfg.pd_buffer_size, device, fp.page_bytes)
        self.receiver = KVReceiver(receiver_config(cfg, tp_rank), self.buffer, fp, receiver_id=receiver_id)
        self.receiver.start()
        self._salt = key_salt(fp)
        self._pending: dict[str, _Expected] = {}
        # Recomputed requests: their KV did not arrive or could not be loaded (vLLM recomputes them,
        # or fails them with pd_kv_timeout_action: fail).
        self.counters = ConsumerCounters()
        # Histogram samples of each loaded transfer (connector/stats.py): its KV wait, its copy's time and bytes.
        self.samples = Samples()
        self.spans = kv_spans(cfg, "decoder", tp_rank)  # None: no collector configured

    def publish(self, live: live_gauges.LiveGauges) -> None:
        """Keep `live` true as pages and transfers change: read when /metrics is scraped, between
        engine steps too."""
        self.receiver.publish(live)

    def pin(self, transfer_id: str) -> None:
        """The decoder's scheduler holds the request: keep its KV until it is scheduled (pd_queue_seconds)."""
        self.receiver.table.pin(transfer_id)

    def unpin(self, transfer_id: str) -> None:
        """The request ended: KV it did not read is not kept for anyone."""
        self.receiver.table.unpin(transfer_id, "its request ended")

    def stats(self) -> dict[str, float]:
        """Flat ``name`` / ``name|label`` counters and gauges for connector/stats.py."""
        c, rx = self.counters, self.receiver.counters
        out: dict[str, float] = {
            "pd_loaded": c.loaded, "pd_received_bytes": c.received_bytes, "pd_kv_timeouts": c.kv_timeouts,
            "pd_arrival_wait_seconds": c.arrival_wait_seconds, "pd_arrival_waits": c.arrival_waits,
            "pd_received": rx.arrivals, "pd_quarantined": self.receiver.table.counters["quarantined"],
            "pd_bad_frames": rx.bad_frames, "pd_aborts_received": rx.aborts,
            "pd_loop_restarts": self.receiver.nixl_health.restarts,
            f"pd_transfers_in_flight|{self.tp_rank}": self.receiver.table.expecting(),
            **buffer_gauges(self.buffer, self.tp_rank)}
        out.update({f"pd_recomputed|{k}": v for k, v in c.recomputed.items()})
        out.update({f"pd_alloc_refusals|{k}": v for k, v in dict(rx.refusals).items()})
        return out

    def expect(self, req_id: str, transfer_id: str, token_ids: Sequence[int], block_ids: Sequence[int],
               num_tokens: int, skip_tokens: int = 0, traceparent: str | None = None) -> None:
        self._pending[req_id] = _Expected(req_id, transfer_id, list(token_ids), list(block_ids),
                                          num_tokens, skip_tokens,
                                          time.monotonic() + self.cfg.pd_kv_ready_timeout, traceparent=traceparent)

    def cancel(self, req_id: str) -> bool:
        """The request ended before its KV came (aborted): stop waiting; free the pages if they come."""
        e = self._pending.pop(req_id, None)
        if e is None:
            return False
        self._drop_later(e.transfer_id)
        return True

    def _drop_later(self, transfer_id: str) -> None:
        # An unread transfer keeps its pages until its lease runs out; read-and-release it if it is
        # here already, else the lease (pd_lease_seconds) takes the pages back.
        if self.receiver.table.status(transfer_id) == "arrived":
            try:
                with self.receiver.claim(transfer_id, 0):
                    pass
            except TransferError:
                pass

    def poll(self, wait: float = 0.0) -> tuple[set[str], set[str]]:
        """Load what arrived: (loaded request ids, failed request ids). `wait` > 0 blocks up to that
        long for an arrival when nothing is ready (an idle engine step: no core spins)."""
        if not self._pending:
            return set(), set()
        table = self.receiver.table
        if wait > 0:
            table.wait_any([e.transfer_id for e in self._pending.values()], wait)
        loaded: set[str] = set()
        failed: set[str] = set()
        now = time.monotonic()
        for req_id, e in list(self._pending.items()):
            st = table.status(e.transfer_id)
            # Its client left: vLLM is aborting the request (the proxy closed its connection), and
            # its abort ends the wait (cancel); recomputing would serve nobody.
            if st == "pending" or CLIENT_LEFT in st:
                if now < e.deadline:
                    continue
                self.counters.kv_timeouts += 1
                self._recompute(e, "timeout", f"no KV within {self.cfg.pd_kv_ready_timeout:g}s (pd_kv_ready_timeout)")
                logger.warning("transfer %s (request %s): KV did not arrive within %.1fs (pd_kv_ready_timeout); "
                               "%s", e.transfer_id, req_id, self.cfg.pd_kv_ready_timeout,
                               "the request fails (pd_kv_timeout_action: fail)"
                               if self.cfg.pd_kv_timeout_action == "fail" else "recomputing the prompt")
                del self._pending[req_id]
                failed.add(req_id)
                continue
            del self._pending[req_id]
            if st != "arrived":
                self._recompute(e, "ended", st)
                logger.warning("transfer %s (request %s) cannot be loaded: %s; %s", e.transfer_id, req_id, st,
                               "the request fails" if self.cfg.pd_kv_timeout_action == "fail"
                               else "recomputing the prompt")
                failed.add(req_id)
                continue
            try:
                self._load(e)
            except (TransferError, ValueError, LayoutError) as err:
                self._recompute(e, "mismatch", str(err))
                logger.warning("transfer %s (request %s) not loaded: %s", e.transfer_id, req_id, err)
                failed.add(req_id)
            else:
                loaded.add(req_id)
        return loaded, failed

    def _recompute(self, e: _Expected, reason: str, why: str) -> None:
        """Counted (pd_recomputed by reason) and, traced, a kv.recompute span."""
        bump(self.counters.recomputed, reason)
        if self.spans is not None:
            self.spans.recompute(e.traceparent, _ids(e), wall_ns(e.started), reason, why)

    def _load(self, e: _Expected) -> None:
        t0 = time.monotonic()
        with self.receiver.claim(e.transfer_id, 0) as got:
            arrived_at = got.arrived_at
            # The prefiller may have sent more than is loaded (a chat decode leg repeats the whole
            # prompt and recomputes its last token): its chunks must match this prompt's start.
            sent = got.num_tokens
            if not e.num_tokens <= sent <= len(e.token_ids):
                raise TransferError(f"the prefiller sent {sent} tokens; this request needs {e.num_tokens} of its "
                                    f"{len(e.token_ids)} prompt tokens")
            if list(got.chunk_keys) != chunk_keys(e.token_ids[:sent], self.fp.chunk_size, self._salt):
                raise TransferError(f"the prefiller's {sent} tokens do not match this request's prompt (chunk keys "
                                    "differ: a different prompt or tokenizer?)")
            nchunks = -(-sent // self.fp.chunk_size)
            nbytes = scatter_chunks(self.kv, self.fmt, self.fp.chunk_size, [got.pages[i] for i in range(nchunks)],
                                    chunk_tokens(sent, self.fp.chunk_size), 0, e.block_ids, e.skip_tokens,
                                    e.num_tokens)
        dt = time.monotonic() - t0
        if self.spans is not None:
            self.spans.loaded(e.traceparent, _ids(e), wall_ns(e.started), wall_ns(got.arrived_at), wall_ns(t0),
                              nbytes, e.num_tokens)
        self.counters.loaded += 1
        self.counters.received_bytes += nbytes
        self.counters.arrival_wait_seconds += t0 - e.started
        self.counters.arrival_waits += 1
        # Scheduled -> its KV arrived (0 when it was here first); the copy into vLLM's paged cache.
        self.samples.add("pd_kv_wait_seconds", max(0.0, arrived_at - e.started))
        self.samples.add("pd_load_seconds", dt)
        self.samples.add("pd_load_bytes", nbytes)
        logger.info("transfer %s: %d tokens loaded from pd_buffer (%s, waited %.1f ms, copied in %.2f ms) "
                    "[request %s]", e.transfer_id, e.num_tokens, fmt_bytes(nbytes), (t0 - e.started) * 1e3, dt * 1e3,
                    e.req_id)

    def suspend(self) -> int:
        """vLLM sleep mode: see KVReceiver.suspend (transfers in flight drained, pd_buffer deregistered)."""
        return self.receiver.suspend()

    def resume(self) -> None:
        self.receiver.resume()

    def close(self) -> None:
        self.receiver.close()
