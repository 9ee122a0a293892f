"""Compiled row copy for the CPU path: one memcpy per row, rows split over torch's threads.

torch has no op that copies rows at arbitrary addresses at memcpy speed: index_select over
paged_copy's overlapping span view moves 16-byte elements one by one (about 0.5x memcpy here).
``rowcopy.c`` is compiled on first use with the system C compiler (``$CC``, else ``cc``) into
the user's cache, as Triton does for its kernels; without a compiler, or with
``KVFERRY_NATIVE_COPY=0``, callers fall back to the torch path (one log line says so).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kvferry.common.log import get_logger
from kvferry.common.paths import cache_root

log = get_logger(__name__)

_SOURCE = Path(__file__).with_name("rowcopy.c")
_FLAGS = ["-O2", "-shared", "-fPIC", "-fopenmp"]
# Below this many bytes per call a second thread costs more than it saves.
_PARALLEL_MIN_BYTES = 256 << 10

_lock = threading.Lock()
_loaded: tuple[bool, RowCopier | None] = (False, None)


def cache_dir() -> Path:
    return cache_root() / "native"


def _build() -> Path:
    cc = shlex.split(os.environ.get("CC", "cc"))
    src = _SOURCE.read_bytes()
    tag = hashlib.sha256(src + " ".join(cc + _FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / f"rowcopy-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([*cc, *_FLAGS, str(_SOURCE), "-o", tmp], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class RowCopier:
    """Copies a chunk's rows between a row table (see paged_copy.RowTable) and a chunk buffer."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._c = lib.kvf_copy_table
        self._c.restype = ctypes.c_int
        self._c.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]

    def copy(self, bases: torch.Tensor, strides: torch.Tensor, rows: torch.Tensor, row_limit: int,
             row_bytes: int, chunk_addr: int, to_chunk: bool) -> None:
        """`bases`/`strides`: int64 bytes per plane; `rows`: contiguous int64 row numbers, each
        checked against `row_limit` before anything is copied."""
        n = bases.numel() * rows.numel()
        threads = torch.get_num_threads() if n * row_bytes >= _PARALLEL_MIN_BYTES else 1
        # ctypes releases the GIL for the call.
        if self._c(bases.data_ptr(), strides.data_ptr(), bases.numel(), rows.data_ptr(), rows.numel(), row_limit,
                   row_bytes, chunk_addr, int(to_chunk), threads):
            raise IndexError(f"row numbers must lie in [0, {row_limit})")


def row_copier() -> RowCopier | None:
    """The compiled row copy, built on first use; None where it cannot be built or is disabled."""
    global _loaded
    done, rc = _loaded
    if done:
        return rc
    with _lock:
        if _loaded[0]:
            return _loaded[1]
        rc = None
        if os.environ.get("KVFERRY_NATIVE_COPY", "1") == "0":
            log.info("KVFERRY_NATIVE_COPY=0: CPU gather/scatter use torch index_select")
        else:
            try:
                rc = RowCopier(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or e
                log.warning("no compiled row copy (%s); CPU gather/scatter use torch index_select, "
                            "about half as fast: install a C compiler (gcc) or set CC", str(detail).strip()[:300])
        _loaded = (True, rc)
        return rc

