"""What the controller knows: instances, their workers, which chunks each holds, recent events.

Pure bookkeeping (no sockets), so every rule here is testable on its own: registration (a
restarted worker replaces its old self; another process claiming a live instance id is refused),
admissions and evictions, expiry of workers whose heartbeats stopped, and lookups (the instance
holding the longest prefix of a prompt's chunks, on every one of its TP ranks).

Everything here comes from workers, so everything is bounded: at most `max_workers` workers, TP
sizes up to MAX_TP, and at most `max_chunks_per_worker` / `max_chunks` indexed keys (keys past a
bound are left out of the index, which only costs lookups a miss, and the worker is not asked to
resync for the difference). What cannot be applied raises RegistryError, which the controller
logs and counts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvferry.common.errors import BadDataError
from kvferry.common.hashing import chunk_keys
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.wire import messages as m

logger = get_logger(__name__)

CPU = "LocalCPUBackend"
# LMCache's location names and kvferry's tier names, for the HTTP API.
LOCATIONS = {"LocalCPUBackend": CPU, "cpu": CPU}

# Bounds on what workers can make the controller hold (memory: ~150 bytes per indexed key).
MAX_TP = 1024  # a LookupResponse names at most 1024 peers
MAX_WORKERS = 4096  # all instances together
MAX_CHUNKS_PER_WORKER = 1 << 22  # e.g. 4 TiB of 1 MiB chunks
MAX_CHUNKS = 1 << 23  # all workers together: ~1.2 GB of index at most
MAX_CHUNK_SIZE = 1 << 20  # tokens


class RegistryError(BadDataError, ValueError):
    """A request the controller cannot carry out; the message names the fix."""


@dataclass
class Worker:
    info: m.WorkerInfo
    last_seen: float
    chunks: dict[bytes, int] = field(default_factory=dict)  # key -> bytes, CPU tier
    used: int = 0
    reported_chunks: int = 0  # what the worker's last heartbeat said it holds
    capped: bool = False  # keys were left out of the index (a bound): its count cannot match

    def admit(self, keys: Sequence[bytes], sizes: Sequence[int], room: int) -> tuple[int, int]:
        """Index `keys`, at most `room` of them new: (keys added, keys left out)."""
        if len(keys) != len(sizes):
            raise RegistryError(f"{len(keys)} keys and {len(sizes)} sizes")
        added = left = 0
        for k, n in zip(keys, sizes, strict=True):
            old = self.chunks.get(k)
            if old is None:
                if added >= room:
                    left += 1
                    continue
                added += 1
            self.used += n - (old or 0)
            self.chunks[k] = n
        return added, left

    def evict(self, keys: Sequence[bytes]) -> int:
        """Keys removed."""
        gone = 0
        for k in keys:
            n = self.chunks.pop(k, None)
            if n is not None:
                self.used -= n
                gone += 1
        return gone

    @property
    def peer(self) -> m.PeerAddr:
        return m.PeerAddr(host=self.info.host, init_port=self.info.p2p_init_port,
                          lookup_port=self.info.p2p_lookup_port)


@dataclass
class InstanceWorkers:
    id: str
    workers: dict[int, Worker] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every TP rank has registered, and they agree on the TP size (a lookup needs all of them
        to hold a chunk; ranks of an older incarnation with another TP size expire by themselves)."""
        sizes = {w.info.tp_size for w in self.workers.values()}
        return len(sizes) == 1 and len(self.workers) == next(iter(sizes))

    def ranks(self) -> list[Worker]:
        return [self.workers[r] for r in sorted(self.workers)]

    def prefix(self, keys: Sequence[bytes]) -> int:
        """Leading chunks of `keys` that every worker holds."""
        if not self.complete:
            return 0
        ws = self.ranks()
        n = 0
        for k in keys:
            if not all(k in w.chunks for w in ws):
                break
            n += 1
        return n

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        info = next(iter(self.workers.values())).info
        return chunk_keys(tokens, info.chunk_size, info.salt, include_partial=info.partial_chunks)

    @property
    def chunk_size(self) -> int:
        return next(iter(self.workers.values())).info.chunk_size


class WorkerRegistry:
    def __init__(self, clock=time.monotonic, history: int = 50, max_workers: int = MAX_WORKERS,
                 max_chunks_per_worker: int = MAX_CHUNKS_PER_WORKER, max_chunks: int = MAX_CHUNKS) -> None:
        self.instances: dict[str, InstanceWorkers] = {}
        self.clock = clock
        self.transfers: deque[dict] = deque(maxlen=history)
        self.events: deque[dict] = deque(maxlen=history)
        self.max_workers, self.max_chunks_per_worker, self.max_chunks = max_workers, max_chunks_per_worker, max_chunks
        self.num_workers = 0
        self.indexed = 0  # keys indexed, all workers together
        self._refusals = RateLimitedLog(logger)  # a duplicate heartbeats every second: one line per 10 s

    # ---- workers ----
    def register(self, info: m.WorkerInfo) -> bool:
        """Add or refresh a worker; False (and a warning) when another live process owns the id.
        RegistryError for a registration that makes no sense or does not fit the bounds."""
        inst = self.instances.get(info.instance_id)
        old = inst.workers.get(info.worker_id) if inst is not None else None
        now = self.clock()
        if old is not None and old.info.epoch == info.epoch:
            old.last_seen = now
            return True
        who = f"instance {info.instance_id} worker {info.worker_id}"
        if not 1 <= info.tp_size <= MAX_TP or info.worker_id >= info.tp_size:
            raise RegistryError(f"{who}: worker id (TP rank) {info.worker_id} with tp_size {info.tp_size}: the rank "
                                f"must be below the TP size, which must be 1 to {MAX_TP}")
        if not 1 <= info.chunk_size <= MAX_CHUNK_SIZE:
            raise RegistryError(f"{who}: chunk_size {info.chunk_size} is outside 1 to {MAX_CHUNK_SIZE}")
        if old is not None and (old.info.host, old.info.worker_port) != (info.host, info.worker_port) \
                and now - old.last_seen < old.info.heartbeat_timeout:
            self._refusals.warning("instance %s worker %d: already registered from %s:%d (heartbeat %.1fs ago); "
                                   "refused the one at %s:%d. Give each instance its own lmcache_instance_id",
                                   info.instance_id, info.worker_id, old.info.host, old.info.worker_port,
                                   now - old.last_seen, info.host, info.worker_port)
            return False
        if old is None and self.num_workers >= self.max_workers:
            raise RegistryError(f"{who}: refused, the controller already tracks {self.num_workers} workers (its "
                                "bound); the others' heartbeats must stop first")
        if inst is None:
            inst = self.instances[info.instance_id] = InstanceWorkers(info.instance_id)
        if old is not None:
            self.indexed -= len(old.chunks)
        else:
            self.num_workers += 1
        inst.workers[info.worker_id] = Worker(info, now)
        self.event("register", info.instance_id, f"worker {info.worker_id} at {info.host}:{info.worker_port}"
                    + (" (restarted)" if old is not None else ""))
        logger.info("instance %s worker %d registered (p2p %s:%d/%d, worker port %d)", info.instance_id,
                    info.worker_id, info.host, info.p2p_init_port, info.p2p_lookup_port, info.worker_port)
        return True

    def worker(self, instance_id: str, worker_id: int, epoch: str) -> Worker | None:
        inst = self.instances.get(instance_id)
        w = inst.workers.get(worker_id) if inst else None
        return w if w is not None and w.info.epoch == epoch else None

    def heartbeat(self, msg: m.Heartbeat) -> Worker | None:
        """The worker, or None when it was refused."""
        if not self.register(msg.worker):
            return None
        w = self.worker(msg.worker.instance_id, msg.worker.worker_id, msg.worker.epoch)
        assert w is not None  # registered just above
        w.reported_chunks = msg.num_chunks
        return w

    def deregister(self, instance_id: str, worker_id: int, epoch: str) -> None:
        if self.worker(instance_id, worker_id, epoch) is not None:
            self._drop(instance_id, worker_id, "deregistered (shut down)")

    def expire(self) -> list[str]:
        """Drop workers whose heartbeats stopped; the ids of instances that went with them."""
        now = self.clock()
        gone = []
        for inst in list(self.instances.values()):
            for w in list(inst.workers.values()):
                age = now - w.last_seen
                if age > w.info.heartbeat_timeout:
                    self._drop(inst.id, w.info.worker_id, f"no heartbeat for {age:.1f}s (timeout "
                               f"{w.info.heartbeat_timeout:g}s, lmcache_worker_heartbeat_timeout)")
            if inst.id not in self.instances:
                gone.append(inst.id)
        return gone

    def _drop(self, instance_id: str, worker_id: int, why: str) -> None:
        inst = self.instances[instance_id]
        w = inst.workers.pop(worker_id)
        self.num_workers -= 1
        self.indexed -= len(w.chunks)
        logger.warning("instance %s worker %d dropped: %s; its %d chunks are forgotten", instance_id, worker_id,
                       why, len(w.chunks))
        self.event("drop", instance_id, f"worker {worker_id}: {why}")
        if not inst.workers:
            del self.instances[instance_id]

    # ---- chunks ----
    def admit(self, msg: m.ChunkAdmit) -> bool:
        """False for an unknown worker (its next heartbeat registers it and asks for a resync);
        RegistryError when keys were left out of the index (a bound; the rest is indexed)."""
        w = self.worker(msg.instance_id, msg.worker_id, msg.epoch)
        if w is None:
            return False
        if msg.reset:
            self.indexed -= len(w.chunks)
            w.chunks.clear()
            w.used = 0
            w.capped = False
        room = max(0, min(self.max_chunks_per_worker - len(w.chunks), self.max_chunks - self.indexed))
        added, left = w.admit(msg.keys, msg.sizes, room)
        self.indexed += added
        if left:
            w.capped = True
            raise RegistryError(f"instance {msg.instance_id} worker {msg.worker_id}: {left} chunk(s) left out of the "
                                f"index (it holds {len(w.chunks)}; the controller indexes at most "
                                f"{self.max_chunks_per_worker} per worker and {self.max_chunks} in all): lookups "
                                "miss them")
        return True

    def evict(self, msg: m.ChunkEvict) -> None:
        w = self.worker(msg.instance_id, msg.worker_id, msg.epoch)
        if w is not None:
            self.indexed -= w.evict(msg.keys)

    def lookup(self, keys: Sequence[bytes], asker: str | None = None) -> m.LookupResponse:
        """The instance holding the longest prefix of `keys` (the asker wins a tie)."""
        best, best_n = None, 0
        for inst in self.instances.values():
            n = inst.prefix(keys)
            if n > best_n or (n == best_n and n > 0 and inst.id == asker):
                best, best_n = inst, n
        if best is None:
            return m.LookupResponse()
        return m.LookupResponse(instance_id=best.id, location=CPU, num_chunks=best_n,
                                peers=[w.peer for w in best.ranks()])

    def lookup_tokens(self, tokens: Sequence[int]) -> dict[str, int]:
        """Tokens of the prompt's prefix each instance holds (instances holding none omitted)."""
        out = {}
        for inst in self.instances.values():
            n = inst.prefix(inst.keys(tokens)) if inst.complete else 0
            if n:
                out[inst.id] = min(n * inst.chunk_size, len(tokens))
        return out

    # ---- move / clear planning ----
    def instance(self, instance_id: str, role: str) -> InstanceWorkers:
        inst = self.instances.get(instance_id)
        if inst is None or not inst.complete:
            known = ", ".join(sorted(self.instances)) or "none"
            raise RegistryError(f"{role} instance {instance_id!r} is not registered (registered: {known}); check its "
                                "lmcache_instance_id and that it has enable_controller: true")
        return inst

    def plan_move(self, old: Sequence[str], new: Sequence[str],
                  tokens: Sequence[int]) -> tuple[InstanceWorkers, InstanceWorkers, list[bytes], int]:
        """(source, destination, keys to move, tokens they cover)."""
        for pos, name in ((old, "old_position"), (new, "new_position")):
            if len(pos) != 2:
                raise RegistryError(f"{name} must be [instance_id, location], got {list(pos)!r}")
            if pos[1] not in LOCATIONS:
                raise RegistryError(f"{name} location {pos[1]!r} is not supported: kvferry moves between CPU "
                                    "tiers, use \"LocalCPUBackend\"")
        if old[0] == new[0]:
            raise RegistryError(f"old_position and new_position are both {old[0]!r}: name two instances")
        src, dst = self.instance(old[0], "old_position"), self.instance(new[0], "new_position")
        if len(src.workers) != len(dst.workers):
            raise RegistryError(f"{src.id} has {len(src.workers)} TP ranks and {dst.id} {len(dst.workers)}: "
                                "KV moves between instances of the same tensor-parallel size")
        if not tokens:
            raise RegistryError("tokens is empty: give the prompt's token ids (POST /tokenize on the vLLM server)")
        keys = src.keys(tokens)
        dkeys = dst.keys(tokens)
        if keys != dkeys:
            raise RegistryError(f"{src.id} and {dst.id} key chunks differently (another model, dtype, chunk_size or "
                                "KV layout): their KV cannot be shared")
        n = src.prefix(keys)
        return src, dst, keys[:n], min(n * src.chunk_size, len(tokens))

    # ---- history ----
    def record_transfer(self, r: m.TransferReport) -> None:
        self.transfers.appendleft({"at": time.time(), "to": r.instance_id, "from": r.peer_id, "kind": r.kind,
                                   "chunks": r.num_chunks, "bytes": r.nbytes, "ms": round(r.seconds * 1e3, 2),
                                   "gbps": round(r.nbytes / max(r.seconds, 1e-9) / 1e9, 3), "ok": r.ok})

    def event(self, kind: str, instance_id: str, detail: str) -> None:
        self.events.appendleft({"at": time.time(), "kind": kind, "instance": instance_id, "detail": detail})

    def state(self) -> dict:
        """Everything the web page shows, as JSON-able data."""
        now = self.clock()
        insts = []
        for inst in sorted(self.instances.values(), key=lambda i: i.id):
            ws = inst.ranks()
            insts.append({
                "instance_id": inst.id,
                "complete": inst.complete,
                "workers": [{"worker_id": w.info.worker_id, "host": w.info.host, "worker_port": w.info.worker_port,
                             "p2p_init_port": w.info.p2p_init_port, "p2p_lookup_port": w.info.p2p_lookup_port,
                             "heartbeat_age_s": round(now - w.last_seen, 2)} for w in ws],
                "tiers": [{"location": CPU, "chunks": sum(len(w.chunks) for w in ws),
                           "bytes": sum(w.used for w in ws),
                           "capacity_bytes": sum(w.info.cpu_capacity for w in ws)}],
            })
        return {"instances": insts, "transfers": list(self.transfers), "events": list(self.events)}
