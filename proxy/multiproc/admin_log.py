"""Admin changes made on one worker of `kvferry-proxy --workers N`, applied on every other.

The supervisor makes, before it forks: a file of changes (one JSON line each, appended under an
flock, which the kernel releases if its holder dies) and a change counter per worker in shared
memory. A worker that changes its instances through the admin API appends the change and bumps
its counter; every worker compares the counters' sum with the last it saw before each request (a
few reads of shared memory) and applies the lines it has not seen (those of its own process it
made already). So a change answered by one worker holds on every worker for any request that
starts after the answer. Changes are named by instance URL.

The file holds current state, not history: once it outgrows COMPACT_BYTES (and twice its last
compacted size) the worker appending rewrites it as the changes that still hold (instances
added and not removed, removed flag instances, drains) and renames it over the old one. A worker
that finds a new file (by its inode) applies the difference between what it had applied and the
new file's state; a replacement worker starts from nothing, so it replays current state only.
Ejections are health, not state: applied as they come by the workers that run then, never kept
in a compacted file nor replayed onto a worker that starts later (its own health checks decide).
A line that cannot be read or applied is logged and skipped; a file error is logged
(rate-limited) and the read tried again at the next request: neither fails the request."""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator

from kvferry.common.log import RateLimitedLog, get_logger

logger = get_logger(__name__)

COMPACT_BYTES = 64 * 1024  # the file is rewritten as current state past this (and twice its compacted size)

# url -> {"add": the add change or None (a flag instance), "removed": bool, "draining": bool}
State = dict[str, dict]


class Peers:
    def __init__(self, path: str, workers: int, static_urls: Iterable[str] = ()) -> None:
        """`static_urls`: the instances every worker adds from its flags (their removal is state
        a replacement worker must replay)."""
        self.path = path
        self.static = frozenset(static_urls)
        self.worker = 0  # this process's cell (set in each worker after the fork)
        # One change counter per worker, each written by its worker alone: no lock (a worker killed
        # while it held one would stop every other), and no increment lost to a race.
        self._versions = memoryview(mmap.mmap(-1, 8 * workers)).cast("q")
        self._compacted = memoryview(mmap.mmap(-1, 8)).cast("q")  # the file's size at its last compaction
        self._pid = os.getpid()  # the process the fields below are of
        self._seen = -1  # sum of the counters when this process last read the file (-1: never)
        self._file: tuple[int, int] | None = None  # (fd, inode) of the file this process reads
        self._offset = 0  # bytes of that file applied by this process (whole lines only)
        self._state: State = {}  # what this process has applied (its own changes too)
        self._bad_line, self._bad_change, self._failing = (RateLimitedLog(logger, 10.0) for _ in range(3))

    def _here(self) -> int:
        """This process's id; a forked copy (a new worker) starts having applied nothing."""
        pid = os.getpid()
        if pid != self._pid:
            if self._file is not None:
                os.close(self._file[0])
            self._pid, self._seen, self._file, self._offset, self._state = pid, -1, None, 0, {}
        return pid

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def publish(self, change: dict) -> None:
        """A change this worker made (and applied): every other worker applies it before its next request."""
        line = (json.dumps({"pid": self._here(), **change}, separators=(",", ":")) + "\n").encode()
        with self._locked():
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            try:
                os.write(fd, line)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size > max(COMPACT_BYTES, 2 * self._compacted[0]):
                self._compact()
        fold(self._state, change, self.static)
        self._versions[self.worker] += 1

    def _compact(self) -> None:
        """Rewrite the file as the changes that still hold (under the lock)."""
        with open(self.path, "rb") as f:
            state = self._fold_lines(f.read())[0]
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".admin-changes-")
        try:
            with os.fdopen(fd, "wb") as f:
                for change in snapshot(state):
                    f.write((json.dumps({"pid": 0, **change}, separators=(",", ":")) + "\n").encode())
                size = f.tell()
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._compacted[0] = size

    def sync(self, apply: Callable[[dict], None]) -> None:
        """Apply the changes other workers made since the last call (cheap when there are none).
        Never raises: see the module's docstring."""
        self._here()
        v = sum(self._versions)
        if v == self._seen:
            return
        try:
            complete = self._read(apply)
        except OSError as e:
            self._failing.warning("admin changes of the other workers: cannot read %s (%s); trying again at "
                                  "the next request", self.path, e)
            return
        self._seen = v if complete else -1

    def _read(self, apply: Callable[[dict], None]) -> bool:
        """Apply what is new in the file; True when it ended with a whole line."""
        pid = self._pid
        if self._file is None or self._file[1] != os.stat(self.path).st_ino:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = _read_all(fd, 0)
                new = (fd, os.fstat(fd).st_ino)
            except BaseException:
                os.close(fd)
                raise
            state, end = self._fold_lines(data)
            for change in diff(self._state, state, self.static):
                self._apply(apply, change)
            if self._file is not None:
                os.close(self._file[0])  # held open while read: its inode cannot be reused meanwhile
            self._file, self._offset, self._state = new, end, state
            return end == len(data)
        data = _read_all(self._file[0], self._offset)
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        for change in self._changes(data[:end]):
            if change.pop("pid", None) == pid:
                continue  # this process applied its own when it made them
            fold(self._state, change, self.static)
            self._apply(apply, change)
        self._offset += end
        return end == len(data)

    def _fold_lines(self, data: bytes) -> tuple[State, int]:
        """The state the file's whole lines make, and where they end."""
        end = data.rfind(b"\n") + 1
        state: State = {}
        for change in self._changes(data[:end]):
            change.pop("pid", None)
            fold(state, change, self.static)
        return state, end

    def _changes(self, data: bytes) -> Iterator[dict]:
        for line in data.splitlines():
            try:
                change = json.loads(line)
                if not isinstance(change, dict) or not isinstance(change.get("op"), str) \
                        or not isinstance(change.get("url"), str):
                    raise ValueError("not a change")
            except ValueError as e:
                self._bad_line.warning("admin changes of the other workers: skipped a bad line in %s (%s): %.200r",
                                  self.path, e, line)
                continue
            yield change

    def _apply(self, apply: Callable[[dict], None], change: dict) -> None:
        try:
            apply(change)
        except Exception as e:  # noqa: BLE001 - a change this worker cannot make must not fail its requests
            self._bad_change.warning("admin changes of the other workers: cannot apply %.200r: %s: %s", change,
                              type(e).__name__, e)


def _read_all(fd: int, offset: int) -> bytes:
    chunks = []
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def fold(state: State, change: dict, static: frozenset[str]) -> None:
    """`change` made to `state` (an ejection is health, not state: it changes nothing here)."""
    op, url = change.get("op"), change.get("url")
    if not isinstance(url, str):
        return
    if op == "add":
        state[url] = {"add": {k: v for k, v in change.items() if k != "pid"}, "removed": False, "draining": False}
    elif op == "remove":
        if url in static:
            state[url] = {"add": None, "removed": True, "draining": False}
        else:
            state.pop(url, None)
    elif op in ("drain", "undrain"):
        s = state.get(url)
        if s is None:
            if url not in static:
                return  # a discovered instance: discovery keeps its drain mark
            s = state[url] = {"add": None, "removed": False, "draining": False}
        if not s["removed"]:
            s["draining"] = op == "drain"
        if url in static and s["add"] is None and not s["removed"] and not s["draining"]:
            del state[url]  # a flag instance as its flag made it


def snapshot(state: State) -> Iterator[dict]:
    """Changes that make `state` from nothing (what a replacement worker applies)."""
    for url, s in state.items():
        if s["removed"]:
            yield {"op": "remove", "url": url}
            continue
        if s["add"] is not None:
            yield s["add"]
        if s["draining"]:
            yield {"op": "drain", "url": url}


def _status(state: State, url: str, static: frozenset[str]) -> tuple[bool, dict | None, bool]:
    """(the instance is there, the add change it came from (None: its flag), draining) after `state`."""
    s = state.get(url)
    if s is None:
        return url in static, None, False
    if s["removed"]:
        return False, None, False
    return True, s["add"], s["draining"]


def diff(old: State, new: State, static: frozenset[str]) -> Iterator[dict]:
    """Changes that turn a worker that applied `old` into one that applied `new`."""
    for url in [*old, *(u for u in new if u not in old)]:
        there, add, draining = _status(old, url, static)
        will, new_add, new_draining = _status(new, url, static)
        if not will:
            if there:
                yield {"op": "remove", "url": url}
            continue
        if new_add is not None and (not there or new_add != add):
            if there:
                yield {"op": "remove", "url": url}
            yield new_add
            draining = False  # added anew: not draining
        if new_draining != draining:
            yield {"op": "drain" if new_draining else "undrain", "url": url}
