"""pd_buffer: leases, generations, FIFO waiting and thread safety."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvferry.buffer.pd_buffer import (
    BufferFullTimeout,
    BufferTooSmall,
    PDBuffer,
    PDBufferError,
    Reservation,
    ReservationGone,
)
from tests.pd_buffer_helpers import PAGE, FakeClock
from tests.polling import until


def test_rounding_down_and_too_small(kvf_logs: pytest.LogCaptureFixture) -> None:
    buf = PDBuffer(PAGE * 5 + 100, "cpu", PAGE)
    assert buf.num_pages == 5 and buf.size_bytes == PAGE * 5
    assert len([r for r in kvf_logs.records if "is not a multiple of the 256-byte "
                                               "page" in r.getMessage()]) == 1, kvf_logs.text
    with pytest.raises(BufferTooSmall, match="pd_buffer_size .* raise pd_buffer_size to at least 256"):
        PDBuffer(PAGE - 1, "cpu", PAGE)


def test_request_larger_than_buffer_fails_at_once() -> None:
    buf = PDBuffer(PAGE * 4, "cpu", PAGE)
    t0 = time.monotonic()
    with pytest.raises(BufferTooSmall) as e:
        buf.reserve(5, "t", lease_seconds=10, timeout=60)
    assert time.monotonic() - t0 < 30  # not after the 60 s it was allowed to wait
    assert "holds 4 chunks; this request needs 5: raise pd_buffer_size" in str(e.value)


def test_lifecycle_and_generation() -> None:
    clock = FakeClock()
    buf = PDBuffer(PAGE * 4, "cpu", PAGE, clock=clock)
    r = buf.reserve(3, "t1", lease_seconds=5)
    assert len(set(r.pages)) == 3 and buf.free_pages == 1
    with pytest.raises(PDBufferError, match="reserved, expected committed"):
        buf.begin_read(r)
    buf.commit(r)
    views = buf.begin_read(r)
    assert [v.numel() for v in views] == [PAGE] * 3
    views[0].fill_(7)
    assert buf.page(r.pages[0]).eq(7).all()
    clock.t += 100  # a reading reservation is pinned: it does not expire mid-copy
    buf.reap()
    assert buf.is_live(r)
    assert buf.release(r) and not buf.release(r)
    with pytest.raises(ReservationGone):
        buf.begin_read(r)
    # A stale handle stays dead even when the same pages are handed out again.
    r2 = buf.reserve(4, "t2", lease_seconds=5)
    assert set(r.pages) <= set(r2.pages) and r2.generation > r.generation
    with pytest.raises(ReservationGone):
        buf.commit(r)
    buf.release(r2)
    assert buf.fully_free()


def test_expiry_in_reserved_and_committed_states() -> None:
    clock = FakeClock()
    buf = PDBuffer(PAGE * 4, "cpu", PAGE, clock=clock)
    never_written = buf.reserve(2, "a", lease_seconds=5)
    never_read = buf.reserve(2, "b", lease_seconds=5)
    clock.t += 4
    buf.commit(never_read)  # commit renews the lease for reading
    clock.t += 2
    with pytest.raises(ReservationGone):
        buf.commit(never_written)
    assert buf.free_pages == 2
    clock.t += 4
    with pytest.raises(ReservationGone):
        buf.begin_read(never_read)
    assert buf.fully_free() and buf.stats().leases_expired == 2


def test_full_buffer_times_out_with_clear_error() -> None:
    buf = PDBuffer(PAGE * 2, "cpu", PAGE)
    r = buf.reserve(2, "a", lease_seconds=120)
    t0 = time.monotonic()
    with pytest.raises(BufferFullTimeout, match="raise pd_buffer_size or pd_alloc_timeout"):
        buf.reserve(1, "b", lease_seconds=60, timeout=0.3)
    # Its 0.3 s timeout ended the wait, not the holder's 120 s lease (which would have granted it).
    assert 0.25 < time.monotonic() - t0 < 30
    buf.release(r)
    assert buf.fully_free() and buf.stats().timeouts == 1


def test_waiter_is_woken_by_lease_expiry_without_a_reaper() -> None:
    buf = PDBuffer(PAGE * 2, "cpu", PAGE)
    buf.reserve(2, "abandoned", lease_seconds=0.3)  # a sender that died: never written
    t0 = time.monotonic()
    r = buf.reserve(2, "next", lease_seconds=10, timeout=60)
    # Woken when the 0.3 s lease ended, not at its own 60 s deadline (where it would reap and get them).
    assert 0.25 < time.monotonic() - t0 < 30
    buf.release(r)
    assert buf.fully_free()


def test_cancel_waiters_ends_blocked_reserves_at_once() -> None:
    """A closing receiver must not leave threads blocked for the rest of pd_alloc_timeout."""
    buf = PDBuffer(PAGE * 2, "cpu", PAGE)
    held = buf.reserve(2, "a", lease_seconds=60)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            buf.reserve(1, "w", lease_seconds=60, timeout=60)
        except PDBufferError as e:
            errors.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    until(lambda: buf.stats().extra["waiting"] >= 2, 60, "both reserves waiting", every=0.01)
    t0 = time.monotonic()
    assert buf.cancel_waiters("receiver closing") == 2
    for t in threads:
        t.join(30)
    # Ended by the cancel, not by their 60 s timeout.
    assert time.monotonic() - t0 < 30 and not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all("receiver closing" in str(e) for e in errors)
    buf.release(held)
    assert buf.fully_free() and buf.stats().extra["waiting"] == 0


def test_fifo_no_starvation_of_a_large_request() -> None:
    """A big waiter at the head is not overtaken by small requests that would fit."""
    buf = PDBuffer(PAGE * 4, "cpu", PAGE)
    held = [buf.reserve(1, f"h{i}", lease_seconds=60) for i in range(3)]
    order: list[str] = []
    got: dict[str, Reservation] = {}

    def want(name: str, n: int) -> None:
        got[name] = buf.reserve(n, name, lease_seconds=60, timeout=60)
        order.append(name)

    big = threading.Thread(target=want, args=("big", 4))
    big.start()
    until(lambda: buf.stats().extra["waiting"] >= 1, 60, "the big reserve waiting", every=0.01)
    # One page is free, but the small request must queue behind the big one.
    with pytest.raises(BufferFullTimeout):
        buf.reserve(1, "sneaky", lease_seconds=60, timeout=0)
    small = threading.Thread(target=want, args=("small", 1))
    small.start()
    until(lambda: buf.stats().extra["waiting"] >= 2, 60, "the small reserve waiting too", every=0.01)
    for r in held:
        buf.release(r)
    big.join(60)
    assert order == ["big"]
    buf.release(got["big"])
    small.join(60)
    assert order == ["big", "small"]
    buf.release(got["small"])
    assert buf.fully_free()


def test_two_large_requests_interleaving_do_not_deadlock() -> None:
    buf = PDBuffer(PAGE * 6, "cpu", PAGE)
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            for _ in range(50):
                r = buf.reserve(4, name, lease_seconds=5, timeout=60)
                buf.commit(r)
                buf.begin_read(r)
                buf.release(r)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in ts)
    assert buf.fully_free()


def test_threads_never_share_a_page() -> None:
    buf = PDBuffer(PAGE * 16, "cpu", PAGE)
    owners: dict[int, str] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def worker(name: str, n: int) -> None:
        for _ in range(200):
            try:
                r = buf.reserve(n, name, lease_seconds=5, timeout=60)
            except BufferFullTimeout as e:
                errors.append(str(e))
                return
            with lock:
                for p in r.pages:
                    if p in owners:
                        errors.append(f"page {p} held by {owners[p]} and {name}")
                    owners[p] = name
            for p in r.pages:  # write a signature, check nobody overwrote it
                buf.page(p).fill_(hash(name) % 251)
            buf.commit(r)
            views = buf.begin_read(r)
            if not all(v.eq(hash(name) % 251).all() for v in views):
                errors.append(f"{name}: data overwritten while held")
            with lock:
                for p in r.pages:
                    del owners[p]
            buf.release(r)

    ts = [threading.Thread(target=worker, args=(f"w{i}", 1 + i % 5)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors[:3]
    assert buf.fully_free()


class BufferMachine(RuleBasedStateMachine):
    """Random reserve/commit/read/release/expire/wait sequences against a model."""

    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.buf = PDBuffer(PAGE * 8, "cpu", PAGE, clock=self.clock)
        self.model: dict[int, tuple[Reservation, str, float]] = {}  # rid -> (res, state, deadline)
        self.dead: list[Reservation] = []

    def _expire_model(self) -> None:
        for rid, (res, state, deadline) in list(self.model.items()):
            if state != "reading" and deadline <= self.clock.t:
                del self.model[rid]
                self.dead.append(res)

    @rule(target=live, n=st.integers(1, 10), lease=st.floats(0.5, 20))
    def reserve(self, n: int, lease: float):
        self._expire_model()
        used = sum(len(r.pages) for r, _, _ in self.model.values())
        try:
            res = self.buf.reserve(n, f"r{n}", lease_seconds=lease, timeout=0)
        except BufferTooSmall:
            assert n > 8
            return None
        except BufferFullTimeout:
            assert n > 8 - used
            return None
        assert n <= 8 - used
        self.model[res.rid] = (res, "reserved", self.clock.t + lease)
        return res

    def _transition(self, res: Reservation | None, op, need: str, new: str) -> None:
        """Apply `op` and check it against the model: gone, wrong state, or the new state."""
        if res is None:
            return
        self._expire_model()
        entry = self.model.get(res.rid)
        if entry is None:
            with pytest.raises(ReservationGone):
                op(res)
        elif entry[1] != need:
            with pytest.raises(PDBufferError):
                op(res)
        else:
            lease = self.buf._records[res.rid].lease_seconds
            op(res)
            # Commit restarts the lease; reading pins the pages (no expiry).
            self.model[res.rid] = (res, new, self.clock.t + lease if new == "committed" else float("inf"))

    @rule(res=live)
    def commit(self, res: Reservation | None) -> None:
        self._transition(res, self.buf.commit, "reserved", "committed")

    @rule(res=live)
    def read(self, res: Reservation | None) -> None:
        self._transition(res, self.buf.begin_read, "committed", "reading")

    @rule(res=consumes(live))
    def release(self, res: Reservation | None) -> None:
        if res is None:
            return
        self._expire_model()
        assert self.buf.release(res) == (res.rid in self.model)
        self.model.pop(res.rid, None)
        self.dead.append(res)

    @rule(dt=st.floats(0, 10))
    def advance(self, dt: float) -> None:
        self.clock.t += dt
        self.buf.reap()
        self._expire_model()

    @invariant()
    def pages_unique_and_accounted(self) -> None:
        self._expire_model()
        self.buf.reap()
        held = [p for r, _, _ in self.model.values() for p in r.pages]
        assert len(held) == len(set(held)), "a page is in two live reservations"
        assert self.buf.free_pages + len(held) == 8
        for res in self.dead[-5:]:
            assert not self.buf.is_live(res)
            with pytest.raises(ReservationGone):
                self.buf.begin_read(res)

    def teardown(self) -> None:
        for res, _, _ in list(self.model.values()):
            self.buf.release(res)
        assert self.buf.fully_free()


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_registers_once_with_a_real_nixl_agent() -> None:
    """The whole region is registered with NIXL (UCX) exactly once."""
    pytest.importorskip("nixl")
    from kvferry.buffer.nixl_agent import make_agent

    agent = make_agent("kvferry-test-buffer")
    buf = PDBuffer(PAGE * 64, "cpu", PAGE)
    descs = buf.register(agent)
    assert buf.register(agent) is descs
    other = make_agent("kvferry-test-other")
    with pytest.raises(PDBufferError, match="already registered"):
        buf.register(other)
    assert buf.page_addr(3) == buf.base_addr + 3 * PAGE
    buf.deregister()
    buf.register(other)  # after deregistering it may move to another agent
    buf.deregister()


def test_nixls_log_lines_go_to_stderr_not_into_what_a_command_prints() -> None:
    """NIXL logs to stdout by default: a benchmark's JSON or a `--json` answer would carry its lines."""
    import subprocess
    import sys

    pytest.importorskip("nixl")
    code = "from kvferry.buffer.nixl_agent import make_agent; make_agent('kvf-log-probe'); print('{}')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == "{}\n", f"stdout carries more than the command printed: {r.stdout[:500]!r}"
    assert "Initialized NIXL agent: kvf-log-probe" in r.stderr


def test_pd_buffer_device_is_the_kv_caches_or_refused_with_the_fix() -> None:
    """pd_buffer_device may only name the KV cache's device: the copy kernels read both."""
    import torch

    from kvferry.common.config import ConfigError, load_config
    from kvferry.engine.pd.shared import buffer_device
    from kvferry.kernels.paged_copy import PagedKV

    kv = PagedKV([torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)], "cpu")
    for given in (None, "cpu"):
        cfg = load_config(extra={"pd_buffer_device": given} if given else {}, env={})
        assert buffer_device(cfg, kv) == "cpu"
    cfg = load_config(extra={"pd_buffer_device": "cuda"}, env={})
    with pytest.raises(ConfigError, match="KV cache is on cpu.*set pd_buffer_device to 'cpu' or remove it"):
        buffer_device(cfg, kv)
