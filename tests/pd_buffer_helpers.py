"""A small PDBuffer for tests: its page size and a clock the test sets by hand (leases expire
only when the test moves `t`)."""

from __future__ import annotations

PAGE = 256


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
