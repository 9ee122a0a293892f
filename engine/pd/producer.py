"""The prefiller half of the pd tier: a prompt's chunks out to a decoder's pd_buffer while it computes.

A transfer goes in up to three calls from the connector, none of which waits on the network:

- :meth:`PDProducer.open` when the prefiller's scheduler first schedules the prompt (before its
  compute): staging pages are taken and the decoder's pages are asked for, so the alloc round
  trip runs while the prompt computes. The decoder's lease (pd_lease_seconds) starts when it
  grants them.
- :meth:`PDProducer.progress` after each step of a chunked prefill: chunks whose tokens are all
  computed are gathered into staging and written at once, without a notification.
- :meth:`PDProducer.submit` after the step that computed the prompt's last token: the rest is
  gathered and written with the notification, once every earlier write is done (the decoder
  reads the transfer only when notified). Only this last piece's copy and write are on the
  critical path; that write's descriptors were built when the early grant came (whole prompts).

Without an early grant (no staging pages free at open) `submit` sends the whole prompt itself,
as one transfer; an early alloc that failed fails the transfer (its id is spent). Gathering is
synchronous, on CUDA too (vLLM may reuse the blocks after the step, and NIXL reads the staging
pages from another thread); staging pages are released once no write reads them, and their
lease covers a prompt that computes for long (up to pd_queue_seconds more than a send).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry.buffer.pd_buffer import PDBuffer, PDBufferError, Reservation
from kvferry.common.config import KVFerryConfig
from kvferry.common.hashing import chunk_keys
from kvferry.common.live_gauges import LiveGauges
from kvferry.common.log import get_logger
from kvferry.common.samples import Samples
from kvferry.common.units import fmt_bytes
from kvferry.common.wire import messages as m
from kvferry.engine.chunking import chunk_plan
from kvferry.engine.pd.kv_spans import kv_spans
from kvferry.engine.pd.shared import StagingError, buffer_device, buffer_gauges, bump, key_salt
from kvferry.engine.pd.slicing import Slice, Slicer, as_decoder_rank, same_rank
from kvferry.kernels.paged_copy import PagedKV
from kvferry.sender.addr import ReceiverAddr
from kvferry.sender.errors import SendError, failure_reason
from kvferry.sender.kv_sender import Grant, KVSender, SendResult, sender_config

logger = get_logger(__name__)


@dataclass
class ProducerCounters:
    """A prefiller rank's sends; failures by reason (`sender.errors.failure_reason`, or "staging")."""

    sent: int = 0
    sent_bytes: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    early: int = 0  # sent into pages reserved before the prompt computed
    pieces: int = 0  # writes made while the prompt was still computing (chunked prefill)
    pieces_done: int = 0  # of those, the writes that ended DONE (landed in the decoder's pages)


@dataclass
class _Outgoing:
    transfer_id: str
    receiver: ReceiverAddr
    keys: list[bytes]
    num_tokens: int
    started: float
    res: Reservation  # staging pages, one per chunk
    grant: concurrent.futures.Future[Grant] | None = None
    sent: int = 0  # chunks gathered into staging
    written: int = 0  # chunks handed to a write while the prompt computed
    writes: list[concurrent.futures.Future] = field(default_factory=list)
    nbytes: int = 0
    early: bool = False  # its last write went into the early grant
    first_write: float = 0.0  # time.monotonic() when its first piece was written (0: one write, timed by the sender)
    slice: Slice | None = None  # this rank writes only its heads' runs (engine/pd/slicing.py)
    span: Any = None  # its kv.transfer span (engine/pd/kv_spans.py), when traced
    request_id: str = ""  # vLLM's (it holds the proxy's X-Request-Id): on its log line


def _after_all(futs: Sequence[concurrent.futures.Future], fn: Callable[[], None]) -> None:
    """Run `fn` once every future in `futs` is done, on the thread that finishes the last one."""
    left = [len(futs) + 1]
    lock = threading.Lock()

    def one(_: object = None) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()
    for f in futs:
        f.add_done_callback(one)
    one()


def _ok(f: concurrent.futures.Future) -> bool:
    return not f.cancelled() and f.exception() is None


def _dropped(out: _Outgoing) -> bool:
    """The decoder dropped the prompt's early grant (the proxy's abort: its client left)."""
    g = out.grant
    return g is not None and g.done() and _ok(g) and bool(g.result().cut)


def _observe_sent(samples: Samples, out: _Outgoing, r: SendResult) -> None:
    """A transfer sent: its time from the first write asked to the notifying write done (the decoder
    has the data and its notice), and its bytes. Written in one write (no piece while the prompt
    computed), that write's own phases time it: asked -> posted -> done."""
    now = time.monotonic()
    first = out.first_write or now - r.phases.get("to_nixl", 0.0) - r.phases.get("write", 0.0)
    samples.add("pd_transfer_seconds", now - first)
    samples.add("pd_transfer_bytes", out.nbytes)


def _chain(src: concurrent.futures.Future, dst: concurrent.futures.Future) -> None:
    """`dst` ends as `src` does."""
    def copy(f: concurrent.futures.Future) -> None:
        if f.cancelled():
            dst.cancel()
        elif f.exception() is not None:
            dst.set_exception(f.exception())
        else:
            dst.set_result(f.result())
    src.add_done_callback(copy)


class PDProducer:
    """Prefiller side: one per worker (TP rank)."""

    def __init__(self, cfg: KVFerryConfig, kv: PagedKV, fp: m.LayoutFingerprint, sender_id: str,
                 tp_rank: int = 0) -> None:
        self.cfg, self.kv, self.fp, self.tp_rank = cfg, kv, fp, tp_rank
        self.fmt = fp.chunk_format
        device = buffer_device(cfg, kv)
        self.staging = PDBuffer(cfg.pd_buffer_size, device, fp.page_bytes)
        self.samples = Samples()  # histograms (connector/histograms.py): sent transfers', and the sender's allocs
        self.sender = KVSender(sender_config(cfg, sender_id, tp_rank), fp, device, self.samples)
        self.sender.register(self.staging.tensor)
        self._salt = key_salt(fp)
        self._slicer = Slicer(fp, tp_rank) if fp.kv_kind == "mha" and fp.slices else None
        # Staging pages are local: held for the longest a send may take (the decoder's lease covers
        # the prompt's compute too), then taken back anyway.
        self._staging_lease = cfg.pd_handshake_timeout + cfg.pd_alloc_timeout + cfg.pd_lease_seconds + 5
        self._staging_hold = self._staging_lease + cfg.pd_queue_seconds  # an open prompt's: RenewLease's bound
        # Open prompts by transfer id, then decoder rank's receiver: an MLA prefiller rank may feed
        # several decoder ranks the same latent (docs/pd.md, "Different TP").
        self._open: dict[str, dict[ReceiverAddr, _Outgoing]] = {}
        self.counters = ProducerCounters()
        self._asleep = False
        self.spans = kv_spans(cfg, "prefiller", tp_rank)  # None: no collector configured

    def open(self, transfer_id: str, receiver: ReceiverAddr, token_ids: Sequence[int], num_tokens: int,
             share: Slice | None = None, traceparent: str | None = None, request_id: str = "") -> None:
        """The prompt is about to compute: take staging pages and ask the decoder for its pages now.
        `share`: this rank writes only its heads into that decoder rank (slicing.feeds); `traceparent`:
        the prefill leg's, the transfer's spans go under it (named with vLLM's `request_id`)."""
        if receiver in self._open.get(transfer_id, {}) or self._asleep:
            return
        keys = chunk_keys(list(token_ids[:num_tokens]), self.fp.chunk_size, self._key_salt(share))
        try:
            # Held while the prompt computes (a batch's step can be long), given back by submit or cancel.
            res = self.staging.reserve(len(keys), transfer_id, self._staging_hold, timeout=0)
        except PDBufferError:
            return  # all staging pages are in flight: submit() sends it whole, waiting its turn
        out = _Outgoing(transfer_id, receiver, keys, num_tokens, time.monotonic(), res, slice=share,
                        request_id=request_id)
        try:
            out.grant = self.sender.reserve(transfer_id, receiver, keys, num_tokens, keep_alive=True,
                                            share=share.share if share else (1, 0))
        except SendError as e:
            logger.warning("transfer %s: pages not reserved early: %s", transfer_id, e)
            self.staging.release(res)
            return
        if self.spans is not None:
            out.span = self.spans.transfer(traceparent, transfer_id, str(receiver), num_tokens, request_id)
            if out.span is not None:
                self.spans.reserve(out.span, out.grant, len(keys))
        out.grant.add_done_callback(lambda f: self._prepare(out, f))
        self._open.setdefault(transfer_id, {})[receiver] = out

    def _prepare(self, out: _Outgoing, f: concurrent.futures.Future[Grant]) -> None:
        """The early grant came (on the sender's thread, while the prompt computes): build the whole
        prompt's notifying write now (sender/prepared.py), so that write, at the prompt's end, only
        posts. A chunked prefill's last write, fewer chunks, builds its own."""
        if not _ok(f):
            return
        try:
            chunks = self._all_chunks(out, 0)
            self.sender.prepare(f.result(), chunks, 0, self._runs(out, f.result(), 0, len(chunks)))
        except Exception as e:  # noqa: BLE001 - a done-callback must not raise; the write itself reports it
            logger.debug("transfer %s: its write not prepared: %s", out.transfer_id, e)

    def progress(self, transfer_id: str, block_ids: Sequence[int], computed_tokens: int) -> None:
        """A step computed the prompt up to `computed_tokens`: write the chunks it completed (to every
        receiver the prompt is open for)."""
        for out in list(self._open.get(transfer_id, {}).values()):
            self._progress(out, block_ids, computed_tokens)

    def _progress(self, out: _Outgoing, block_ids: Sequence[int], computed_tokens: int) -> None:
        transfer_id = out.transfer_id
        if out.grant is None or not out.grant.done() or not _ok(out.grant):
            return  # the alloc is still on its way (or failed): submit() sends these chunks
        if out.grant.result().cut or any(w.done() and not _ok(w) for w in out.writes):
            return  # dropped by the decoder, or a piece failed: the grant is gone, submit() reports it
        upto = min(computed_tokens, out.num_tokens) // self.fp.chunk_size
        if upto <= out.sent:
            return
        chunks = self._gather(out, block_ids, upto * self.fp.chunk_size, upto)
        out.first_write = out.first_write or time.monotonic()
        try:
            out.writes.append(self.sender.write(out.grant.result(), chunks, out.written,
                                                runs=self._runs(out, out.grant.result(), out.written, len(chunks))))
        except ValueError as e:  # the sender's refusal of these chunks
            raise StagingError(f"transfer {transfer_id}: {e}") from e
        self._traced_write(out, out.writes[-1], chunks, False)
        out.written = upto
        self.counters.pieces += 1
        out.writes[-1].add_done_callback(self._piece_ended)

    def submit(self, transfer_id: str, receiver: ReceiverAddr, token_ids: Sequence[int], block_ids: Sequence[int],
               num_tokens: int, share: Slice | None = None, traceparent: str | None = None, request_id: str = ""
               ) -> concurrent.futures.Future[SendResult] | None:
        """The prompt's last token is computed: gather the rest now, send in the background. None
        (logged) if no staging pages came in time; StagingError if these blocks cannot be gathered."""
        if self._asleep:
            bump(self.counters.failures, "asleep")
            logger.error("transfer %s: not sent, this prefiller is asleep (vLLM sleep mode)", transfer_id)
            return None
        outs = self._open.get(transfer_id, {})
        out = outs.pop(receiver, None)
        if not outs:
            self._open.pop(transfer_id, None)
        if out is None:
            out = self._staged(transfer_id, receiver, token_ids, num_tokens, share)
            if out is None:
                return None
            out.request_id = request_id
            if self.spans is not None:  # no early grant: the transfer's span starts now
                out.span = self.spans.transfer(traceparent, transfer_id, str(receiver), num_tokens, request_id)
        result: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        result.add_done_callback(lambda f: self._sent(out, f))
        try:
            if not _dropped(out):  # nothing of a dropped one is written: no copy either
                self._gather(out, block_ids, num_tokens, len(out.keys))
        except StagingError:
            self._finish_after_writes(out)
            raise
        _after_all(out.writes + ([out.grant] if out.grant is not None else []), lambda: self._last(out, result))
        return result

    def cancel(self, transfer_id: str) -> None:
        """The prompt will not finish computing (its request ended): give its pages back."""
        for out in self._open.pop(transfer_id, {}).values():
            self._finish_after_writes(out)

    def _staged(self, transfer_id: str, receiver: ReceiverAddr, token_ids: Sequence[int],
                num_tokens: int, share: Slice | None = None) -> _Outgoing | None:
        keys = chunk_keys(list(token_ids[:num_tokens]), self.fp.chunk_size, self._key_salt(share))
        # Prompts still computing hold staging pages that only this (the forward) thread can free:
        # waiting for them would stall the engine, so then the wait is none.
        wait = 0.0 if self._open else self.cfg.pd_alloc_timeout
        try:
            res = self.staging.reserve(len(keys), transfer_id, self._staging_lease, timeout=wait)
        except PDBufferError as e:
            logger.error("transfer %s: cannot stage %d chunks on the prefiller: %s", transfer_id, len(keys), e)
            bump(self.counters.failures, "staging")
            return None
        return _Outgoing(transfer_id, receiver, keys, num_tokens, time.monotonic(), res, slice=share)

    def _gather(self, out: _Outgoing, block_ids: Sequence[int], num_tokens: int, upto: int) -> list[tuple[int, int]]:
        """Copy chunks out.sent..upto (of the first `num_tokens` tokens) into their staging pages."""
        if not self.staging.is_live(out.res):
            bump(self.counters.failures, "staging")
            raise StagingError(f"transfer {out.transfer_id}: its staging pages' lease ran out while the prompt "
                               "computed; raise pd_lease_seconds")
        try:
            plan = chunk_plan(num_tokens, block_ids, self.fp.chunk_size, self.kv.layout.block_size)[out.sent:upto]
            pages = out.res.pages[out.sent:upto]
            views = [self.staging.page(p) for p in pages]
            out.nbytes += self.kv.copy_batch([b for b, _ in plan], views, self.fmt, [n for _, n in plan],
                                             to_chunk=True)
            if self.kv.device.type == "cuda":  # the copy is queued on the GPU; NIXL reads the pages next
                torch.cuda.current_stream(self.kv.device).synchronize()
        except (ValueError, IndexError) as e:  # the kernels' refusals of these blocks
            bump(self.counters.failures, "staging")
            raise StagingError(f"transfer {out.transfer_id}: {e}") from e
        out.sent = upto
        return [(self.staging.page_addr(p), self.kv.chunk_nbytes(self.fmt, n))
                for p, (_, n) in zip(pages, plan, strict=True)]

    def _all_chunks(self, out: _Outgoing, first: int) -> list[tuple[int, int]]:
        sizes = [min(self.fp.chunk_size, out.num_tokens - s) for s in range(0, out.num_tokens, self.fp.chunk_size)]
        return [(self.staging.page_addr(p), self.kv.chunk_nbytes(self.fmt, n))
                for p, n in zip(out.res.pages[first:], sizes[first:], strict=True)]

    def _last(self, out: _Outgoing, result: concurrent.futures.Future[SendResult]) -> None:
        """Every earlier write and the grant are settled: write the rest with the notification."""
        try:
            fut: concurrent.futures.Future[Any]
            if out.grant is not None and _ok(out.grant) and all(_ok(w) for w in out.writes):
                chunks = self._all_chunks(out, out.written)
                fut = self.sender.write(out.grant.result(), chunks, out.written, notify=True,
                                        runs=self._runs(out, out.grant.result(), out.written, len(chunks)))
                self._traced_write(out, fut, chunks, True)
                out.early = True
            elif out.grant is not None and _ok(out.grant):  # a piece failed: the grant was aborted
                fut = next(w for w in out.writes if not _ok(w))
            elif out.grant is not None:  # the early alloc failed: its id is spent on the receiver
                fut = out.grant
            elif out.slice is not None or self._slicer is not None:
                # No early grant, and the decoder's layout (known after the handshake) may ask for runs:
                # reserve (as one of the writers when sliced), then write.
                fut = self._send_sliced(out)
            else:  # no early grant: reserve and write now, as one transfer
                chunks = self._all_chunks(out, 0)
                fut = self.sender.send(out.transfer_id, out.receiver, out.keys, chunks, out.num_tokens)
                self._traced_write(out, fut, chunks, True)
        except (SendError, ValueError) as e:
            if out.grant is not None and _ok(out.grant):  # nothing more will be written: the pages go back
                self.sender.release(out.grant.result(), f"the last write was refused: {e}")
            result.set_exception(e if isinstance(e, SendError) else SendError(str(e)))
            return
        _chain(fut, result)

    def _traced_write(self, out: _Outgoing, fut: concurrent.futures.Future, chunks: list[tuple[int, int]],
                      notify: bool) -> None:
        if out.span is not None and self.spans is not None:
            self.spans.write(out.span, fut, len(chunks), sum(n for _, n in chunks), notify)

    def _key_salt(self, share: Slice | None) -> bytes:
        """The chunk keys' salt the decoder rank checks them with (its own heads per rank)."""
        return self._salt if share is None else key_salt(as_decoder_rank(self.fp, share))

    def _runs(self, out: _Outgoing, grant: Grant, first: int, count: int) -> list | None:
        """The byte runs of chunks first..first+count for the decoder rank of `grant` (None: whole
        chunks): its heads (another TP size) in its block size (docs/pd.md, "Different block sizes")."""
        dst = grant.peer.welcome.fingerprint
        share = out.slice or same_rank(self.fp, self.tp_rank, dst)
        if share is None:
            return None
        if self._slicer is None:
            raise StagingError(f"transfer {out.transfer_id}: a sliced write, and this prefiller does not slice")
        sizes = [min(self.fp.chunk_size, out.num_tokens - s) for s in range(0, out.num_tokens, self.fp.chunk_size)]
        return self._slicer.runs(dst, share, sizes[first:first + count])

    def _send_sliced(self, out: _Outgoing) -> concurrent.futures.Future[SendResult]:
        """Reserve (as writer `out.slice.writer` when sliced), then write every chunk (its runs where
        the decoder's layout asks for them) with the notification."""
        result: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        granted = self.sender.reserve(out.transfer_id, out.receiver, out.keys, out.num_tokens,
                                      share=out.slice.share if out.slice else (1, 0))

        def write(f: concurrent.futures.Future[Grant]) -> None:
            if not _ok(f):
                _chain(f, result)
                return
            try:
                chunks = self._all_chunks(out, 0)
                _chain(self.sender.write(f.result(), chunks, 0, notify=True,
                                         runs=self._runs(out, f.result(), 0, len(chunks))), result)
            except (SendError, ValueError) as e:
                self.sender.release(f.result(), f"the write was refused: {e}")
                result.set_exception(e if isinstance(e, SendError) else SendError(str(e)))
        granted.add_done_callback(write)
        return result

    def _finish_after_writes(self, out: _Outgoing) -> None:
        """Give the grant and the staging pages back once no write reads them."""
        def done() -> None:
            if out.grant is not None and _ok(out.grant):
                self.sender.release(out.grant.result(), "the request ended before its prompt was computed")
            self.staging.release(out.res)
            if out.span is not None and self.spans is not None:
                self.spans.sent(out.span, 0, False, "cancelled: the request ended before its prompt was computed")
        _after_all(out.writes + ([out.grant] if out.grant is not None else []), done)

    def _sent(self, out: _Outgoing, fut: concurrent.futures.Future) -> None:
        self.staging.release(out.res)
        if out.span is not None and self.spans is not None:
            exc = None if fut.cancelled() else fut.exception()
            err = "cancelled" if fut.cancelled() else None if exc is None else f"{failure_reason(exc)}: {exc}"
            self.spans.sent(out.span, out.nbytes, out.early, err)
        try:
            r = fut.result()
        except Exception as e:  # noqa: BLE001 - a done-callback must not raise: every failure is counted
            reason = failure_reason(e)
            bump(self.counters.failures, reason)
            if reason == "aborted":  # dropped on the decoder (its client left): nothing is wrong here
                logger.info("transfer %s: not sent: %s", out.transfer_id, e)
                return
            logger.error("transfer %s: sending %d tokens failed: %s", out.transfer_id, out.num_tokens,
                         e or type(e).__name__)
        else:
            dt = time.monotonic() - out.started
            self.counters.early += out.early
            self.counters.sent += 1
            self.counters.sent_bytes += out.nbytes
            _observe_sent(self.samples, out, r)
            logger.info("transfer %s: stored %d tokens, size %s, %.2f ms, %.2f GB/s (%d chunks)%s",
                        out.transfer_id, out.num_tokens, fmt_bytes(out.nbytes), dt * 1e3,
                        out.nbytes / max(dt, 1e-9) / 1e9, r.sent_chunks,
                        f" [request {out.request_id}]" if out.request_id else "")

    def publish(self, live: LiveGauges) -> None:
        """Keep `live`'s free staging pages true as they change (read when /metrics is scraped)."""
        self.staging.on_free = lambda n: live.set("pd_buffer_free_pages", n)
        live.set("pd_buffer_pages", self.staging.num_pages)
        live.set("pd_buffer_free_pages", self.staging.free_pages)

    def stats(self) -> dict[str, float]:
        """Flat ``name`` / ``name|label`` counters and gauges for connector/stats.py."""
        c, tx = self.counters, self.sender.counters
        out: dict[str, float] = {"pd_sent": c.sent, "pd_sent_bytes": c.sent_bytes,
                                 "pd_sent_early": c.early, "pd_sent_pieces": c.pieces,
                                 "pd_alloc_wait_seconds": tx.alloc_wait_seconds, "pd_alloc_waits": tx.alloc_waits,
                                 **buffer_gauges(self.staging, self.tp_rank)}
        # Copies: the sender's and receiver's threads may add a reason meanwhile.
        out.update({f"pd_send_failures|{k}": v for k, v in dict(c.failures).items()})
        return out

    def close(self) -> None:
        for tid in list(self._open):
            self.cancel(tid)
        self.sender.close()
        self.staging.deregister()

    def _piece_ended(self, f: concurrent.futures.Future) -> None:
        if _ok(f):
            self.counters.pieces_done += 1  # one writer (the NIXL thread's callbacks) for this counter

    # ---- vLLM sleep mode: cancel the prompts computing, drain staging's writes, deregister it ----
    def suspend(self) -> None:
        """vLLM sleep mode, before the staging memory is unmapped: prompts still computing are
        cancelled, every write that reads staging ends (done, or cut at its lease), then the
        staging pages are deregistered from NIXL. Idempotent."""
        if self._asleep:
            return
        self._asleep = True
        for tid in list(self._open):
            self.cancel(tid)
        deadline = time.monotonic() + self._staging_lease
        while not self.staging.fully_free():
            if time.monotonic() >= deadline:
                logger.warning("prefiller going to sleep: staging pages still held after %.0fs; deregistering "
                               "anyway (no write outlives its lease)", self._staging_lease)
                break
            time.sleep(0.005)
        self.sender.suspend()
        logger.info("prefiller asleep: staging deregistered from NIXL")

    def resume(self) -> None:
        """After vLLM remapped the memory: register the staging pages again. Idempotent."""
        if not self._asleep:
            return
        self.sender.resume()
        self._asleep = False
        logger.info("prefiller awake: staging registered again")
