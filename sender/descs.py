"""The NIXL descriptors of one write: whole chunks into whole pages, or byte runs of each chunk
into its page (a prefiller rank slicing K/V heads for a decoder rank of another TP size,
docs/pd.md "Different TP with K/V heads"; the runs come from kernels/head_map.py `chunk_runs`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvferry.common.wire import messages as m
from kvferry.sender.errors import ChunkError

Desc = tuple[int, int, int]  # (address, bytes, device id)

# Checked run arrays by content (their bytes and the device ids): one layout's runs are the same
# for every full chunk of every write, so each write checks and lays them out once, not per chunk.
# Keyed by content, not identity: a caller that changes its array afterwards gets a new entry.
# Bounded in entries and in size: a large run array (thousands of runs: the token-major format) is
# checked afresh each time, its descriptors' numpy work small next to its transfer.
_TEMPLATES: dict[tuple[bytes, int, int], _Template] = {}
MAX_TEMPLATES = 32
MAX_TEMPLATE_KEY_BYTES = 64 << 10


class _Template:
    """One checked run array as descriptor rows relative to its chunk (local) and page (remote)."""

    __slots__ = ("both", "end", "widest", "nbytes")

    def __init__(self, r: np.ndarray, device_id: int, remote_device_id: int) -> None:
        lens = r[:, 2]
        if r.min() < 0 or lens.min() == 0:
            raise ChunkError("a byte run lies outside its chunk (or is empty)")
        self.end = int((r[:, 0] + lens).max())  # the chunk must hold this many bytes
        self.widest = int((r[:, 1] + lens).max())
        self.nbytes = int(lens.sum())
        dev = np.full(len(r), device_id, dtype=np.int64)
        rdev = np.full(len(r), remote_device_id, dtype=np.int64)
        # [local, remote][1][run][address, bytes, device]: a chunk's and a page's start add to it.
        self.both = np.stack([np.stack([r[:, 0], lens, dev], axis=1), np.stack([r[:, 1], lens, rdev], axis=1)])[:, None]


_I64 = np.dtype(np.int64)


def _template(runs: object, device_id: int, remote_device_id: int) -> _Template | None:
    r = runs if type(runs) is np.ndarray and runs.dtype is _I64 and runs.ndim == 2 and runs.shape[1] == 3 \
        else np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if not r.size:
        return None
    key = (r.tobytes(), device_id, remote_device_id)
    t = _TEMPLATES.get(key)
    if t is None:
        t = _Template(r, device_id, remote_device_id)
        if len(key[0]) <= MAX_TEMPLATE_KEY_BYTES:
            if len(_TEMPLATES) >= MAX_TEMPLATES:
                _TEMPLATES.clear()
            _TEMPLATES[key] = t
    return t


def write_descs(chunks: Sequence[tuple[int, int]], pages: Sequence[int], region: m.Region, device_id: int,
                runs: Sequence[np.ndarray] | None = None
                ) -> tuple[list[Desc] | np.ndarray, list[Desc] | np.ndarray, int, int]:
    """(local descriptors, remote descriptors, bytes written, the most bytes of one page written);
    with runs the descriptors are ``[n, 3]`` int64 arrays (NIXL takes those as they are).
    `runs[i]`: ``[n, 3]`` rows ``(src_offset, dst_offset, length)`` within chunk i and its page; a
    run outside either is refused here, before anything is posted (it would read or write memory
    that is not the chunk's or the page's)."""
    if runs is None:
        local = [(a, n, device_id) for a, n in chunks]
        remote = [(region.addr + p * region.page_bytes, n, region.device_id)
                  for p, (_, n) in zip(pages, chunks, strict=True)]
        return local, remote, sum(n for _, n in chunks), max((n for _, n in chunks), default=0)
    if len(runs) != len(chunks) or len(pages) != len(chunks):
        raise ChunkError(f"{len(runs)} run lists and {len(pages)} pages for {len(chunks)} chunks")
    # The caller is vLLM's forward thread, and this is on the way to the post: a handful of numpy
    # calls per distinct run array (one for a write's full chunks, one for a shorter last chunk),
    # none per chunk or per run: a Python loop per run would add milliseconds to every write.
    locs, rems = [], []
    nbytes = widest = 0
    i = 0
    while i < len(chunks):
        j = i + 1
        while j < len(chunks) and runs[j] is runs[i]:
            j += 1
        t = _template(runs[i], device_id, region.device_id)
        if t is not None:
            seg = chunks[i:j]
            if t.end > min([n for _, n in seg]):
                raise ChunkError("a byte run lies outside its chunk (or is empty)")
            starts = [a for a, _ in seg]
            starts += [region.addr + p * region.page_bytes for p in pages[i:j]]
            offs = np.zeros((2, j - i, 1, 3), dtype=np.int64)  # a start moves the address column only
            offs.reshape(-1, 3)[:, 0] = starts
            both = t.both + offs
            locs.append(both[0].reshape(-1, 3))
            rems.append(both[1].reshape(-1, 3))
            nbytes += t.nbytes * (j - i)
            widest = max(widest, t.widest)
        i = j
    if not locs:
        raise ChunkError("the byte runs of this write are all empty: nothing to write")
    if len(locs) == 1:
        return locs[0], rems[0], nbytes, widest
    return np.concatenate(locs), np.concatenate(rems), nbytes, widest
