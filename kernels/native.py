"""Compiled CPU kernels: the row copy (one memcpy per row, rows split over torch's threads) and the
cachegen codec's dequantizer.

torch has no op that copies rows at arbitrary addresses at memcpy speed: index_select over
paged_copy's overlapping span view moves 16-byte elements one by one (about 0.5x memcpy here).
``rowcopy.c`` (with ``dequant.c``) is compiled on first use with the system C compiler (``$CC``, else ``cc``) into
the user's cache, as Triton does for its kernels; without a compiler, or with
``KVFERRY_NATIVE_COPY=0``, callers fall back to the torch path (one log line says so).

The library is loaded into vLLM's processes, so it is trusted only when the current user made
it: its name is a hash of the C source, the flags and the compiler's version line; the folder
and the file must be the user's and writable by nobody else (checked on the open file, which is
what gets loaded, so nothing can be swapped in between); anything else is refused with the fix.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvferry.common.errors import ConfigurationError
from kvferry.common.log import get_logger
from kvferry.common.paths import cache_root

log = get_logger(__name__)

_SOURCES = [Path(__file__).with_name(n) for n in ("rowcopy.c", "dequant.c")]
_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp"]
# Below this many bytes per call a second thread costs more than it saves.
_PARALLEL_MIN_BYTES = 256 << 10

_DEQUANT_MAX_DIM = 1024  # dequant.c's MAX_DIM
_lock = threading.Lock()
_loaded: tuple[bool, Kernels | None] = (False, None)


def cache_dir() -> Path:
    return cache_root() / "native"


class UntrustedLibrary(ConfigurationError, OSError):
    """A cached library (or its folder) that another user could have written."""


def _check_owner(st: os.stat_result, what: str) -> None:
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedLibrary(f"{what} is not owned by this user or is writable by others (mode "
                               f"{stat.filemode(st.st_mode)}, uid {st.st_uid}): remove it, or set "
                               "KVFERRY_CACHE_DIR to a folder of your own")


def _compiler_version(cc: list[str]) -> bytes:
    """The compiler's first version line: a new compiler under the same name makes a new library."""
    try:
        r = subprocess.run([*cc, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return b""
    return r.stdout.split(b"\n", 1)[0]


def _build() -> Path:
    cc = shlex.split(os.environ.get("CC", "cc"))
    key = b"\0".join([*(s.read_bytes() for s in _SOURCES), " ".join(cc + _FLAGS).encode(), _compiler_version(cc)])
    out = cache_dir() / f"native-{hashlib.sha256(key).hexdigest()[:16]}.so"
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(out.parent)
    if st.st_uid == os.getuid() and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(out.parent, 0o700)  # ours, made under a loose umask: tighten rather than refuse
        st = os.stat(out.parent)
    _check_owner(st, f"the kernel cache folder {out.parent}")
    if out.exists():
        return out
    # Build beside the target and rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([*cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp], check=True, capture_output=True,
                       text=True, timeout=120)
        os.chmod(tmp, 0o755)  # whatever the umask: writable by this user only
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load(path: Path) -> ctypes.CDLL:
    """dlopen the file whose owner and mode were checked: through its open descriptor."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_owner(os.fstat(fd), f"the compiled kernels {path}")
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


class RowCopier:
    """Copies a chunk's rows between a row table (see row_table.RowTable) and a chunk buffer."""

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


class Dequantizer:
    """The cachegen codec's dequantizer into a bfloat16 cache view (see dequant.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._c = lib.kvf_dequant
        self._c.restype = ctypes.c_int
        self._c.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                            *[ctypes.c_int64] * 5, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                            ctypes.c_void_p, *[ctypes.c_int64] * 5, ctypes.c_int]

    @staticmethod
    def writes(out: torch.Tensor) -> bool:
        """Whether a [layers, blocks, slots, heads, dim] view is one the kernel writes: bfloat16 on
        the CPU with contiguous channels, or contiguous slots (a transposed K), an even head size up
        to 1,024, no element written twice (no zero stride)."""
        dim = out.shape[4]
        return out.device.type == "cpu" and out.dtype == torch.bfloat16 and 1 in (out.stride(4), out.stride(2)) \
            and 2 <= dim <= _DEQUANT_MAX_DIM and dim % 2 == 0 and all(st > 0 for st in out.stride())

    def dequantize(self, q: bytes, out: torch.Tensor, offsets: list[int], bins: bytes, bits: bytes,
                   scale: np.ndarray, anchors: list[np.ndarray | None], run: int) -> None:
        """Write `out`, a bfloat16 [layers, blocks, slots, heads, dim] view (`writes`), from the
        symbols in `q`: layer l's from byte offsets[l] on, bits[l] (8, or 4: two a byte) each,
        quantized with bins[l] bins; `scale`: float32 [layers, heads * dim] with contiguous rows;
        `anchors`, per layer, None or a float32 [runs, heads * dim] array added to each `run` token
        slots. ValueError, with nothing written, where any of these cannot be that view's."""
        layers, blocks, slots, heads, dim = out.shape
        width, runs = heads * dim, -(-blocks * slots // max(run, 1))
        if not self.writes(out) or not len(offsets) == len(bins) == len(bits) == len(anchors) == layers or \
                run < 1 or any(not 0 <= o <= len(q) for o in offsets) or scale.dtype != np.float32 or \
                scale.shape != (layers, width) or scale.strides[1] != 4 or scale.strides[0] <= 0 or \
                scale.strides[0] % 4 or not scale.flags.aligned or any(
                    a is not None and (a.dtype != np.float32 or a.shape != (runs, width) or not a.flags.c_contiguous
                                       or not a.flags.aligned) for a in anchors):
            raise ValueError("dequantize: a bfloat16 view with contiguous channels or slots, and per layer an "
                             "offset, bins, bits, scales and anchors of its shape")
        table = None
        if any(a is not None for a in anchors):
            table = (ctypes.c_void_p * layers)(*(None if a is None else a.ctypes.data for a in anchors))
        base = ctypes.cast(ctypes.c_char_p(q), ctypes.c_void_p).value
        threads = torch.get_num_threads() if out.numel() * out.element_size() >= _PARALLEL_MIN_BYTES else 1
        st = out.stride()
        # ctypes releases the GIL for the call; `q`, `scale` and `anchors` stay referenced until it returns.
        if self._c(base, len(q), (ctypes.c_int64 * layers)(*offsets), bins, bits, layers, blocks, slots, heads, dim,
                   scale.ctypes.data, scale.strides[0] // 4, table, run, out.data_ptr(), *st, threads):
            raise ValueError("dequantize: symbols past the end of q, bits or bins no encoding has, or a view "
                             "it cannot write")


class Kernels(NamedTuple):
    row_copier: RowCopier
    dequantizer: Dequantizer


def _library() -> Kernels | None:
    """The compiled kernels, built on first use; None where they cannot be built or are disabled."""
    global _loaded
    done, lib = _loaded
    if done:
        return lib
    with _lock:
        if _loaded[0]:
            return _loaded[1]
        lib = None
        if os.environ.get("KVFERRY_NATIVE_COPY", "1") == "0":
            log.info("KVFERRY_NATIVE_COPY=0: CPU gather/scatter use torch index_select, cachegen torch ops")
        else:
            try:
                so = _load(_build())
                lib = Kernels(RowCopier(so), Dequantizer(so))
            except UntrustedLibrary as e:
                log.warning("refusing the compiled kernels: %s; CPU gather/scatter use torch index_select", e)
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or e
                log.warning("no compiled kernels (%s); CPU gather/scatter use torch index_select, "
                            "about half as fast: install a C compiler (gcc) or set CC", str(detail).strip()[:300])
        _loaded = (True, lib)
        return lib


def row_copier() -> RowCopier | None:
    """The compiled row copy; None where the kernels cannot be built or are disabled."""
    lib = _library()
    return lib.row_copier if lib is not None else None


def dequantizer() -> Dequantizer | None:
    """The compiled cachegen dequantizer; None where the kernels cannot be built or are disabled."""
    lib = _library()
    return lib.dequantizer if lib is not None else None
