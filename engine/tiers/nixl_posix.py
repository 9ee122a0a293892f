"""The disk tier with NIXL's POSIX plugin moving the chunk bytes (LMCache's NIXL storage,
``extra_config: {enable_nixl_storage: true, nixl_backend: POSIX, nixl_path: ...}``).

Files, names, headers, checks and the writer thread are the disk tier's (engine/tiers/disk.py):
only the chunk's payload goes between memory and the file through a NIXL WRITE or READ (a DRAM
descriptor to a FILE descriptor at the header's end), so a chunk written by either back-end is
read by the other, and a damaged file is the same counted miss."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

from kvferry.common.errors import UnavailableError
from kvferry.engine.tiers.disk import HEADER_BYTES, DiskTier

XFER_TIMEOUT = 30.0  # seconds one chunk's file I/O may take


class NixlStorageError(UnavailableError, OSError):
    """NIXL's POSIX plugin failed or timed out (the disk tier counts it as a failed write or read)."""


class NixlPosixDiskTier(DiskTier):
    def __init__(self, root: Path, layout_digest: bytes, max_pending_bytes: int = 2 << 30) -> None:
        from nixl import nixl_agent, nixl_agent_config

        self.agent_name = f"kvferry-posix-{os.getpid()}-{id(self):x}"
        # No progress thread: POSIX I/O completes on the calls that poll it.
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=["POSIX"]))
        self._nixl = threading.Lock()  # the writer thread and the reader share the agent
        super().__init__(root, layout_digest, max_pending_bytes)

    def _move(self, op: str, fd: int, view: memoryview) -> int:
        """NIXL `op` (WRITE: memory to file, READ: file to memory) of `view` at the header's end."""
        n = len(view)
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
        with self._nixl:
            mem = self.agent.register_memory([(addr, n, 0, "")], "DRAM")
            files = self.agent.register_memory([(HEADER_BYTES, n, fd, "")], "FILE")
            handle = None
            try:
                handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs([(addr, n, 0)], "DRAM"),
                                                    self.agent.get_xfer_descs([(HEADER_BYTES, n, fd)], "FILE"),
                                                    self.agent_name)
                state = self.agent.transfer(handle)
                deadline = time.monotonic() + XFER_TIMEOUT
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise NixlStorageError(f"NIXL POSIX {op} of {n} bytes took over {XFER_TIMEOUT:.0f} s")
                    time.sleep(0.0002)
                    state = self.agent.check_xfer_state(handle)
                if state != "DONE":
                    raise NixlStorageError(f"NIXL POSIX {op} of {n} bytes failed ({state})")
            finally:
                if handle is not None:
                    self.agent.release_xfer_handle(handle)
                self.agent.deregister_memory(files)
                self.agent.deregister_memory(mem)
        return n

    def _read_payload(self, fd: int, view: memoryview) -> int:
        return self._move("READ", fd, view)

    def _write_file(self, fd: int, head: bytes, view: memoryview) -> None:
        try:
            if os.pwrite(fd, head, 0) != len(head):
                raise NixlStorageError("short header write")
            self._move("WRITE", fd, view)
        finally:
            os.close(fd)
