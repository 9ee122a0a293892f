"""sender/descs.py: the descriptors of a write with byte runs equal one row per (chunk, run), in
order, whatever runs the chunks share; a run outside its chunk is refused before anything is posted."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.common.wire import messages as m
from kvferry.sender.descs import write_descs
from kvferry.sender.errors import ChunkError

REGION = m.Region(addr=1 << 40, page_bytes=1 << 16, num_pages=32, device_id=3)


def reference(chunks, pages, runs, device_id):
    """One row per run, in a plain loop: what the vectorized build must equal."""
    local, remote = [], []
    for (a, _), p, rs in zip(chunks, pages, runs, strict=True):
        for src, dst, n in np.asarray(rs).reshape(-1, 3).tolist():
            local.append((a + src, n, device_id))
            remote.append((REGION.addr + p * REGION.page_bytes + dst, n, REGION.device_id))
    return local, remote


def random_runs(rng, count: int, size: int) -> np.ndarray:
    starts = np.sort(rng.choice(size // 64, count, replace=False)) * 64
    lens = rng.integers(1, 64, count)
    return np.stack([starts, rng.permutation(starts), lens], axis=1).astype(np.int64)


@pytest.mark.parametrize("shared", ["all", "last_differs", "none", "some_empty"])
def test_write_descs_runs_equal_a_row_per_run(shared: str) -> None:
    rng = np.random.default_rng(7)
    size = 1 << 15
    chunks = [(0x10000 + i * size, size) for i in range(6)]
    pages = [5, 1, 9, 2, 30, 0]
    one = random_runs(rng, 12, size)
    runs = {"all": [one] * 6, "last_differs": [one] * 5 + [random_runs(rng, 3, size)],
            "none": [random_runs(rng, 4 + i, size) for i in range(6)],
            "some_empty": [one, np.zeros((0, 3), np.int64), one, one, np.zeros((0, 3), np.int64), one]}[shared]
    local, remote, nbytes, widest = write_descs(chunks, pages, REGION, 2, runs)
    want_l, want_r = reference(chunks, pages, runs, 2)
    assert [tuple(x) for x in local.tolist()] == want_l
    assert [tuple(x) for x in remote.tolist()] == want_r
    assert nbytes == sum(n for _, n, _ in want_l)
    assert widest == max(int((np.asarray(r)[:, 1] + np.asarray(r)[:, 2]).max()) for r in runs if len(r))
    again = write_descs(chunks, pages, REGION, 2, [r.copy() for r in runs])  # equal content, new arrays
    assert np.array_equal(again[0], local) and np.array_equal(again[1], remote)


@pytest.mark.parametrize("bad", [(-1, 0, 8), (0, -8, 8), (0, 0, 0), (1000, 0, 25), (0, 0, -4)])
def test_write_descs_refuses_a_run_outside_its_chunk(bad: tuple[int, int, int]) -> None:
    chunks = [(0x10000, 1024), (0x20000, 1024)]
    ok = np.array([[0, 0, 8]], np.int64)
    with pytest.raises(ChunkError):
        write_descs(chunks, [0, 1], REGION, 0, [ok, np.array([bad], np.int64)])


def test_write_descs_checks_the_shortest_chunk_sharing_runs() -> None:
    runs = np.array([[0, 0, 512], [512, 512, 512]], np.int64)
    write_descs([(0, 1024), (4096, 1024)], [0, 1], REGION, 0, [runs, runs])
    with pytest.raises(ChunkError):
        write_descs([(0, 1024), (4096, 1000)], [0, 1], REGION, 0, [runs, runs])  # the last chunk is short


def test_write_descs_refuses_mismatched_or_empty_runs() -> None:
    runs = np.array([[0, 0, 8]], np.int64)
    with pytest.raises(ChunkError):
        write_descs([(0, 64)], [0], REGION, 0, [runs, runs])
    with pytest.raises(ChunkError):
        write_descs([(0, 64), (64, 64)], [0], REGION, 0, [runs, runs])
    with pytest.raises(ChunkError):
        write_descs([(0, 64)], [0], REGION, 0, [np.zeros((0, 3), np.int64)])


def test_write_descs_template_cache_stays_bounded() -> None:
    """Many distinct run arrays (a shorter last chunk per prompt length) and a huge one: the cache of
    checked templates keeps at most MAX_TEMPLATES entries, none of them huge."""
    from kvferry.sender import descs

    size = 1 << 20
    for k in range(1, 3 * descs.MAX_TEMPLATES):
        runs = np.array([[0, 0, k]], np.int64)
        write_descs([(0, size)], [0], REGION, 0, [runs])
    huge = np.stack([np.arange(0, size, 64), np.arange(0, size, 64), np.full(size // 64, 8)], axis=1)
    local, _, nbytes, _ = write_descs([(0, size)], [0], REGION, 0, [huge])
    assert len(local) == size // 64 and nbytes == 8 * (size // 64)
    assert len(descs._TEMPLATES) <= descs.MAX_TEMPLATES
    assert all(len(key[0]) <= descs.MAX_TEMPLATE_KEY_BYTES for key in descs._TEMPLATES)
