"""The local disk tier's data: one checksummed file per chunk, written behind the forward pass.

File ``<root>/<key hex>.kvf``: a fixed header (magic, version, payload length, xxh3-64 of the
payload, the writer's layout digest, the key) then the chunk's bytes. Files are written to a
temporary name and renamed, so a reader sees a whole file or none; a file that is truncated,
oversize, corrupt, not a regular file, or from another layout is a miss with a warning and is
deleted, never loaded. Every size is checked against the chunk the reader expects before any
memory is allocated for it.

Only this user may read or plant chunks: folders are 0700, files 0600, temporary files are
created exclusively (O_CREAT|O_EXCL) and no path is followed through a symlink (O_NOFOLLOW), so
a link planted at a chunk's or a temporary file's name is neither written through nor read.

Writes run on one thread in submission order (a put, then a delete, then a put of the same key
leaves the second put on disk); until its file is written a chunk is served from memory.
"""

from __future__ import annotations

import os
import queue
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvferry.common.counters import Counters
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.engine.tiers.interface import LoadRequest

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


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted FIFO must not hang
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def private_dir(path: Path) -> None:
    """Make `path` (and missing parents) a folder only this user can use, or raise naming the fix."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)  # mode applies to the folders it makes
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"disk tier folder {path} is a symlink or not a folder: point local_disk at a real folder")
    if st.st_uid != os.getuid():
        raise OSError(f"disk tier folder {path} belongs to uid {st.st_uid}, not this user ({os.getuid()}): "
                      "point local_disk at a folder of this user's")
    if stat.S_IMODE(st.st_mode) != 0o700:
        logger.info("disk tier folder %s: mode %o changed to 700 (chunks are this user's only)", path,
                    stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)


def scan(root: Path) -> list[tuple[bytes, int]]:
    """(key, file bytes) of every chunk file under `root` (regular files only, never a link),
    least recently used first."""
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
            st = e.stat(follow_symlinks=False)
        except (ValueError, OSError):
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        found.append((st.st_mtime_ns, key, st.st_size))
    found.sort()
    return [(k, n) for _, k, n in found]


@dataclass
class DiskCounters(Counters):
    """Exported as ``disk_<name>`` (kvferry:cache_disk_*)."""

    prefix = "disk_"
    writes: int = 0
    write_bytes: int = 0
    write_errors: int = 0
    reads: int = 0
    read_bytes: int = 0
    misses: int = 0
    corrupt: int = 0
    deletes: int = 0


class DiskTier:
    """One rank's chunk files. `layout_digest` (16 bytes) must match for a file to be loaded."""

    name = "disk"

    def __init__(self, root: Path, layout_digest: bytes, max_pending_bytes: int = 2 << 30) -> None:
        self.root = Path(root)
        self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # local_disk: private when made here
        private_dir(self.root)
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
        self.counters = DiskCounters()
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

    def get(self, key: bytes, nbytes: int) -> torch.Tensor | None:
        """The chunk's bytes if they are an `nbytes` chunk, or None (missing, or bad: warned,
        counted and deleted)."""
        with self._lock:
            hit = self._pending.get(key)
        if hit is not None:
            return hit[1] if hit[1].numel() == nbytes else None
        p = self.path(key)
        why, data = None, None
        try:
            fd = os.open(p, _READ_FLAGS)
        except FileNotFoundError:
            self.counters.misses += 1
            return None
        except OSError as e:  # ELOOP: a symlink planted at the chunk's name
            why = f"not openable without following a link: {e.strerror}"
        else:
            try:
                why, data = self._read(fd, key, nbytes)
            except OSError as e:
                why = f"unreadable: {e}"
            finally:
                os.close(fd)
        if why is not None or data is None:
            self.counters.corrupt += 1
            self._warn.warning("disk tier: chunk file %s is %s; treated as a miss and deleted", p, why)
            try:
                p.unlink(missing_ok=True)  # a link itself, never its target
            except OSError as e:
                self._warn.warning("disk tier: could not delete %s: %s", p, e)
            return None
        self.counters.reads += 1
        self.counters.read_bytes += data.numel()
        return data

    def _read(self, fd: int, key: bytes, nbytes: int) -> tuple[str | None, torch.Tensor | None]:
        """(None, data) or (why it is bad, None); allocates only after every size checks out."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file", None
        if st.st_size != HEADER_BYTES + nbytes:
            return f"{st.st_size} bytes, expected {HEADER_BYTES + nbytes} (truncated or oversize)", None
        head = os.read(fd, HEADER_BYTES)  # straight from the fd: no dup, no file object per chunk
        why = self._check_header(head, key, nbytes)
        if why is not None:
            return why, None
        data = torch.empty(nbytes, dtype=torch.uint8)
        view = data.numpy().data
        got = self._read_payload(fd, view)
        if got != nbytes:
            return f"short read: {got} of {nbytes} bytes", None
        if xxhash.xxh3_64_intdigest(view) != _HEADER.unpack(head)[4]:
            return "checksum mismatch", None
        return None, data

    def _check_header(self, head: bytes, key: bytes, nbytes: int) -> str | None:
        if len(head) < HEADER_BYTES:
            return f"truncated ({len(head)} header bytes)"
        magic, version, _, size, _, digest, fkey = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION:
            return f"not a kvferry v{VERSION} chunk file"
        if fkey != key:
            return "holding another key"
        if digest != self.digest:
            return "from another model or KV layout"
        if size != nbytes:
            return f"a {size}-byte chunk, expected {nbytes}"
        return None

    # ---- the Tier interface (engine/tiers/interface.py) ----
    def prefetch(self, req: LoadRequest) -> None:
        pass

    def fetch(self, key: bytes, tokens: int, nbytes: int) -> torch.Tensor | None:
        return self.get(key, nbytes)

    def store(self, key: bytes, data: torch.Tensor, tokens: int) -> None:
        self.put(key, data)

    def remove(self, key: bytes) -> None:
        self.delete(key)

    def stats(self) -> dict[str, float]:
        return self.counters.as_dict()

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
                    self.counters.deletes += 1
            except OSError as e:
                self.counters.write_errors += 1
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
        view = data.numpy().data
        head = _HEADER.pack(MAGIC, VERSION, 0, data.numel(), xxhash.xxh3_64_intdigest(view), self.digest, key)
        final = self.path(key)
        tmp = final.with_name(f"{final.name}.tmp{os.urandom(6).hex()}")
        # Exclusive and link-free: a planted file or symlink at this name makes the write fail.
        fd = os.open(tmp, _WRITE_FLAGS, 0o600)
        try:
            self._write_file(fd, head, view)
            os.replace(tmp, final)  # replaces a link at `final` itself, never writes through it
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.counters.writes += 1
        self.counters.write_bytes += data.numel()

    def _read_payload(self, fd: int, view: memoryview) -> int:
        """Read the chunk's bytes (after the header) into `view`; the number read."""
        return os.readv(fd, [view])

    def _write_file(self, fd: int, head: bytes, view: memoryview) -> None:
        """Write header and chunk to `fd` and close it."""
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(view)

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
