"""The local disk tier's data: one checksummed file per chunk, written behind the forward pass.

File ``<root>/<key hex>.kvf``: a fixed header (magic, version, payload length, xxh3-64 of the
payload, the writer's layout digest, the key) then the chunk's bytes. Files are written to a
temporary name and renamed, so a reader sees a whole file or none; a file that is truncated,
corrupt, or from another layout is a miss with a warning and is deleted, never loaded.

Writes run on one thread in submission order (a put, then a delete, then a put of the same key
leaves the second put on disk); until its file is written a chunk is served from memory.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
from pathlib import Path

import torch
import xxhash

from kvferry.common.log import RateLimitedLog, get_logger

logger = get_logger(__name__)

MAGIC = b"KVFC"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQ16s16s")  # magic, version, flags, payload bytes, xxh3_64, layout, key
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvf"


def disk_path(local_disk: str) -> Path:
    """`local_disk` as LMCache writes it ("file:///data/kv/") or a plain path."""
    return Path(local_disk.removeprefix("file://")).expanduser()


def rank_root(local_disk: str, tp_rank: int) -> Path:
    """Each tensor-parallel rank keeps its shard of every chunk in its own folder."""
    return disk_path(local_disk) / f"rank{tp_rank}"


def scan(root: Path) -> list[tuple[bytes, int]]:
    """(key, file bytes) of every chunk file under `root`, least recently used first."""
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:
        name = e.name
        if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
            continue
        try:
            key = bytes.fromhex(name[:32])
            st = e.stat()
        except (ValueError, OSError):
            continue
        found.append((st.st_mtime_ns, key, st.st_size))
    found.sort()
    return [(k, n) for _, k, n in found]


class DiskTier:
    """One rank's chunk files. `layout_digest` (16 bytes) must match for a file to be loaded."""

    def __init__(self, root: Path, layout_digest: bytes, max_pending_bytes: int = 2 << 30) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for tmp in self.root.glob("*.tmp*"):  # a writer killed mid-file
            tmp.unlink(missing_ok=True)
        self.digest = layout_digest.ljust(16, b"\0")[:16]
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[bytes, tuple[int, torch.Tensor]] = {}  # key -> (seq, data) not yet on disk
        self._pending_bytes = 0
        self._queued = 0
        self._seq = 0
        self._lost: set[bytes] = set()  # written keys that did not make it (reported to the index)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._warn = RateLimitedLog(logger)
        self.counters = {"writes": 0, "write_bytes": 0, "write_errors": 0, "reads": 0, "read_bytes": 0,
                         "misses": 0, "corrupt": 0, "deletes": 0}
        self._thread = threading.Thread(target=self._run, name="kvferry-disk-writer", daemon=True)
        self._thread.start()

    def path(self, key: bytes) -> Path:
        return self.root / (key.hex() + SUFFIX)

    # ---- called from the forward path: never waits on the disk ----
    def put(self, key: bytes, data: torch.Tensor) -> bool:
        """Queue `data` (a 1-D uint8 CPU tensor the caller no longer changes) for writing."""
        with self._lock:
            if self._pending_bytes + data.numel() > self.max_pending_bytes:
                self._warn.warning("disk tier %s: %d bytes already wait to be written; dropping a chunk "
                                   "(the disk is slower than the stores)", self.root, self._pending_bytes)
                self._lost.add(key)
                return False
            self._seq += 1
            old = self._pending.get(key)
            if old is not None:
                self._pending_bytes -= old[1].numel()
            self._pending[key] = (self._seq, data)
            self._pending_bytes += data.numel()
            self._queued += 1
            self._q.put(("w", key, self._seq, data))
        return True

    def delete(self, key: bytes) -> None:
        with self._lock:
            old = self._pending.pop(key, None)
            if old is not None:
                self._pending_bytes -= old[1].numel()
            self._queued += 1
            self._q.put(("d", key, 0, None))

    def get(self, key: bytes) -> torch.Tensor | None:
        """The chunk's bytes, or None (missing, or bad: warned and deleted)."""
        with self._lock:
            hit = self._pending.get(key)
        if hit is not None:
            return hit[1]
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                head = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
                why = self._check_header(head, key, size)
                if why is None:
                    data = torch.empty(size - HEADER_BYTES, dtype=torch.uint8)
                    view = memoryview(data.numpy())
                    got = f.readinto(view)
                    if got != data.numel():
                        why = f"short read: {got} of {data.numel()} bytes"
                    elif xxhash.xxh3_64_intdigest(view) != _HEADER.unpack(head)[4]:
                        why = "checksum mismatch"
        except FileNotFoundError:
            self.counters["misses"] += 1
            return None
        except OSError as e:
            why = f"unreadable: {e}"
        if why is not None:
            self.counters["corrupt"] += 1
            self._warn.warning("disk tier: chunk file %s is %s; treated as a miss and deleted", p, why)
            p.unlink(missing_ok=True)
            return None
        self.counters["reads"] += 1
        self.counters["read_bytes"] += data.numel()
        return data

    def _check_header(self, head: bytes, key: bytes, size: int) -> str | None:
        if len(head) < HEADER_BYTES:
            return f"truncated ({size} bytes, shorter than its header)"
        magic, version, _, nbytes, _, digest, fkey = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION:
            return f"not a kvferry v{VERSION} chunk file"
        if fkey != key:
            return "holding another key"
        if digest != self.digest:
            return "from another model or KV layout"
        if size != HEADER_BYTES + nbytes:
            return f"truncated ({size - HEADER_BYTES} of {nbytes} payload bytes)"
        return None

    def take_lost(self) -> set[bytes]:
        with self._lock:
            lost, self._lost = self._lost, set()
        return lost

    # ---- the writer thread ----
    def _run(self) -> None:
        while True:
            op, key, seq, data = self._q.get()
            if op == "stop":
                return
            try:
                if op == "w":
                    self._write(key, data)
                else:
                    self.path(key).unlink(missing_ok=True)
                    self.counters["deletes"] += 1
            except OSError as e:
                self.counters["write_errors"] += 1
                self._warn.warning("disk tier %s: writing a chunk failed: %s", self.root, e)
                with self._lock:
                    self._lost.add(key)
            finally:
                with self._lock:
                    cur = self._pending.get(key)
                    if op == "w" and cur is not None and cur[0] == seq:
                        del self._pending[key]
                        self._pending_bytes -= data.numel()
                    self._queued -= 1
                    if self._queued == 0:
                        self._idle.notify_all()

    def _write(self, key: bytes, data: torch.Tensor) -> None:
        view = memoryview(data.numpy())
        head = _HEADER.pack(MAGIC, VERSION, 0, data.numel(), xxhash.xxh3_64_intdigest(view), self.digest, key)
        final = self.path(key)
        tmp = final.with_name(f"{final.name}.tmp{threading.get_native_id()}")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(view)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.counters["writes"] += 1
        self.counters["write_bytes"] += data.numel()

    def flush(self, timeout: float) -> bool:
        """Wait (bounded) until every queued write and delete is done."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (bounded), then stop the writer."""
        if not self._thread.is_alive():
            return
        if not self.flush(timeout):
            logger.warning("disk tier %s: %d writes still queued after %.0fs; they are dropped", self.root,
                           self._queued, timeout)
        self._q.put(("stop", b"", 0, None))
        self._thread.join(timeout=5)
