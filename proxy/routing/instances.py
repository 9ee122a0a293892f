"""The instances the proxy routes to, their health and load, and the routing policies."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

from kvferry.common.errors import UnavailableError
from kvferry.common.wire.transfer_params import DisaggSpec
from kvferry.proxy.instance_flags import InstanceSpec
from kvferry.proxy.metrics import Value
from kvferry.proxy.multiproc.board import BoardFull, LoadBoard

FAILS_TO_EJECT = 2  # consecutive failed health checks or connection errors
_USABILITY = frozenset({"healthy", "draining"})  # the fields `usable` reads: a change rebuilds the pools


@dataclass
class Instance:
    spec: InstanceSpec
    id: str
    healthy: bool = True
    draining: bool = False
    fails: int = 0
    active: int = 0  # requests in flight (decoder: active sequences)
    queued_tokens: int = 0  # prefiller: prompt tokens sent and not yet answered
    own_served: int = 0  # this process's (with --workers N, `served` sums every worker's)
    own_errors: int = 0
    kv_usage: float | None = None  # decoder: vLLM's vllm:kv_cache_usage_perc at the last health check
    discovery_id: str | None = None  # its instance_id in discovery (etcd or file); None: a static flag
    engine_load: int | None = None  # vLLM's running + waiting requests at the last /metrics scrape
    own_at_scrape: int = 0  # this proxy's in-flight requests then
    # With --workers N: the load every worker sees (multiproc/board.py), at this row; None: one
    # process, an instance removed, or one added while every row was held (its load this worker's own).
    board: LoadBoard | None = field(default=None, repr=False, compare=False)
    row: int = 0
    # True once it left the registry: what was kept for it is freed (see `retire`), and requests
    # still in flight on it count on this object only.
    removed: bool = False
    in_flight_gauge: Value | None = field(default=None, repr=False, compare=False)  # its labelled gauge (the router's)
    _on_removed: list[Callable[[], None]] = field(default_factory=list, repr=False, compare=False)
    _watch: Callable[[], None] | None = field(default=None, repr=False, compare=False)  # the registry's

    def __setattr__(self, name: str, value: object) -> None:
        if name in _USABILITY and self.__dict__.get(name) != value:
            object.__setattr__(self, name, value)
            watch = self.__dict__.get("_watch")
            if watch is not None:
                watch()
        else:
            object.__setattr__(self, name, value)

    def counted(self, active: int, queued: int) -> None:
        """A leg started or ended on this instance (this process's counts, shared with its peers)."""
        self.active, self.queued_tokens = active, queued
        if self.board is not None:
            self.board.put(self.row, active, queued)

    @contextlib.contextmanager
    def claimed(self) -> Iterator[None]:
        """A request whose KV is on its way here (its prefill runs): counted in flight from its
        route on, so the requests routed meanwhile see it rather than all take the same idle decoder."""
        self.counted(self.active + 1, self.queued_tokens)
        try:
            yield
        finally:
            self.counted(self.active - 1, self.queued_tokens)

    def when_removed(self, free: Callable[[], None]) -> None:
        """Call `free` when the instance leaves the registry (at once if it has): for what another
        part keeps per instance (a socket)."""
        if self.removed:
            free()
        else:
            self._on_removed.append(free)

    def retire(self) -> None:
        """Out of the registry: its board row is released (it never writes the row again) and what
        others keep for it is freed."""
        if self.removed:
            return
        self.removed = True
        if self.board is not None:
            self.board.release(self.row)
            self.board = None
        frees, self._on_removed = self._on_removed, []
        for free in frees:
            free()

    def served_one(self) -> None:
        """A request answered by this instance."""
        self._done(1, 0)

    def failed_one(self) -> None:
        """An upstream failure on this instance."""
        self._done(0, 1)

    def _done(self, served: int, errors: int) -> None:
        self.own_served += served
        self.own_errors += errors
        if self.board is not None:
            self.board.put_done(self.row, self.own_served, self.own_errors)

    def done(self) -> tuple[int, int]:
        """(requests answered, upstream failures) on this instance for this proxy: every worker's."""
        return (self.own_served, self.own_errors) if self.board is None else self.board.done(self.row)

    @property
    def all_active(self) -> int:
        """Requests in flight from this proxy: every worker's."""
        return self.active if self.board is None else self.board.total(self.row)[0]

    @property
    def all_queued(self) -> int:
        """Prompt tokens sent and not yet answered, from every worker of this proxy."""
        return self.queued_tokens if self.board is None else self.board.total(self.row)[1]

    @property
    def load(self) -> int:
        """Requests on the engine from every proxy: its own count at the last scrape, plus this
        proxy's requests started (less those ended) since. Without a scrape, this proxy's own."""
        active = self.all_active
        if self.engine_load is None:
            return active
        return max(active, self.engine_load + active - self.own_at_scrape)

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    def ok(self) -> None:
        self.fails = 0
        self.healthy = True

    def failed(self) -> None:
        self.fails += 1
        if self.fails >= FAILS_TO_EJECT:
            self.healthy = False

    def eject(self) -> None:
        """Out of rotation at once (a failed request and a failed probe); a passing check re-admits it."""
        self.fails = max(self.fails, FAILS_TO_EJECT)
        self.healthy = False

    @cached_property
    def disagg_spec(self) -> DisaggSpec:
        """Where prefillers write for this decoder (its spec is fixed: made once, not per request).
        The receiver's advertised host, carried explicitly: not necessarily the HTTP URL's."""
        return DisaggSpec(self.spec.kv_host, list(self.spec.init_ports), list(self.spec.alloc_ports))

    def describe(self, ports: bool = True) -> dict:
        """The instance for /health and /admin; `ports` adds a decoder's receiver ports (internal:
        only for callers with the admin key)."""
        served, errors = self.done()
        d = {"id": self.id, "role": self.role, "url": self.url, "healthy": self.healthy, "draining": self.draining,
             "in_flight": self.all_active, "queued_prompt_tokens": self.all_queued, "served": served,
             "errors": errors}
        if self.kv_usage is not None:
            d["kv_cache_usage"] = self.kv_usage
        if self.engine_load is not None:
            d["engine_load"] = self.engine_load
        if self.discovery_id is not None:
            d["instance_id"] = self.discovery_id
        if ports and self.role == "decoder":
            d["init_ports"], d["alloc_ports"] = list(self.spec.init_ports), list(self.spec.alloc_ports)
        return d


class RolePool(list[Instance]):
    """The usable instances of one role, and the same by id: built when an instance comes, goes,
    or changes health or drain, not per request (a route reads it; nobody changes it)."""

    def __init__(self, members: list[Instance]) -> None:
        super().__init__(members)
        self.by_id = {i.id: i for i in members}


class NoInstance(UnavailableError, RuntimeError):
    """No healthy instance of a role."""


@dataclass
class Registry:
    policy: str = "load"
    instances: dict[str, Instance] = field(default_factory=dict)
    _rr: dict[str, itertools.count] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count())
    board: LoadBoard | None = None  # --workers N: load shared with the other workers
    _pools: dict[str, RolePool] = field(default_factory=dict)  # role -> its usable instances, while valid

    def add(self, spec: InstanceSpec) -> Instance:
        """A new instance; with a board, its row and id are the ones every worker uses for its URL.
        With every row held it is added without one (routed on this worker's own load): see
        `Instance.board`."""
        for inst in self.instances.values():
            if inst.url == spec.url:
                raise ValueError(f"{spec.url} is already registered as {inst.id}")
        if self.board is None:
            inst = Instance(spec, f"{spec.role[0]}{next(self._ids)}")
        else:
            try:
                row, n = self.board.claim(spec.url)
            except BoardFull:
                inst = Instance(spec, f"{spec.role[0]}{self.board.next_id()}")
            else:
                inst = Instance(spec, f"{spec.role[0]}{n}", board=self.board, row=row)
                inst.own_served, inst.own_errors = self.board.own_done(row)
        self.instances[inst.id] = inst
        inst._watch = self._pools.clear
        self._pools.clear()
        return inst

    def remove(self, iid: str) -> Instance:
        """Out of rotation and freed (`Instance.retire`)."""
        inst = self.instances.pop(iid)
        inst._watch = None
        self._pools.clear()
        inst.retire()
        return inst

    def of(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role]

    def usable(self, role: str) -> RolePool:
        """The usable instances of `role` (healthy, not draining), kept between changes."""
        pool = self._pools.get(role)
        if pool is None:
            pool = self._pools[role] = RolePool([i for i in self.instances.values() if i.role == role and i.usable])
        return pool

    def pick(self, role: str, affinity: str | None = None) -> Instance:
        pool = self.usable(role)
        if not pool:
            raise NoInstance(f"no healthy {role} available")
        if affinity is not None:
            # Rendezvous hashing: the same key keeps its instance while that instance is healthy.
            return max(pool, key=lambda i: hashlib.blake2b(f"{affinity}|{i.url}".encode(), digest_size=8).digest())
        if len(pool) == 1:
            return pool[0]
        if self.policy == "round_robin":
            turn = (self.board.turn(role) if self.board is not None
                    else next(self._rr.setdefault(role, itertools.count())))
            return pool[turn % len(pool)]
        a, b = random.sample(pool, 2)  # power of two choices on the role's load measure
        return min((a, b), key=(lambda i: (i.all_queued, i.load)) if role == "prefiller"
                   else (lambda i: (i.load, i.all_queued)))

    def ready(self) -> bool:
        return bool(self.usable("prefiller")) and bool(self.usable("decoder"))
