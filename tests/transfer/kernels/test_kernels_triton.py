"""The Triton (CUDA) copy kernel: checked in Triton's CPU interpreter here, on the GPU where one is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it comes with torch on CUDA hosts)")

HERE = Path(__file__).resolve().parents[2]  # tests/, where kv_caches.py lives

CHECK = r"""
import sys, torch
sys.path.insert(0, {tests!r})
from kv_caches import make_caches
from kvferry.kernels.paged_copy import PagedKV
from kvferry.kernels import triton_copy
dev = {device!r}
bad = []

def run(k, ids, bufs, fmt, ns, to_chunk):
    # The Triton path directly (on CPU tensors under TRITON_INTERPRET=1).
    table = k.table(fmt)
    if table is None:  # layouts without memory rows never reach the kernel
        return k.copy_batch(ids, bufs, fmt, ns, to_chunk)
    rows, counts, got = k.host_rows_batch(ids, fmt, ns)
    return triton_copy.copy_rows(k.device, table, rows, counts, bufs, [k.chunk_nbytes(fmt, n) for n in got], to_chunk)

def scatter_tail(k, chunk, ids, first):
    # scatter_blocks' Triton call (the CUDA branch), run directly.
    if dev == "cuda":
        return k.scatter_blocks(chunk, ids, first)
    rb = k.layout.block_bytes
    return triton_copy.copy_rows(k.device, k.table("block"), torch.tensor(ids[first:]).numpy(), [len(ids) - first],
                                 [chunk], [len(k._planes) * len(ids) * rb], False, plane_rows=[len(ids)], first=[first])

for name in ["cpu", "flash_nhd", "flash_hnd", "mla"]:
    for fmt in ["block", "token"]:
        for dtype in [torch.bfloat16, torch.float8_e4m3fn]:
            ids, ns = [[3, 1, 7], [0, 9], [5]], [40, 32, 3]
            src = make_caches(name, 3, 10, 16, 2, 64, dtype)
            ref = PagedKV(src, name)  # CPU torch path: the reference
            refs = [torch.zeros(ref.chunk_nbytes(fmt, n), dtype=torch.uint8) for n in ns]
            for i, r, n in zip(ids, refs, ns):
                ref.gather(i, r, fmt, n)
            kv = PagedKV([t.to(dev) for t in src], name)
            outs = [torch.full((ref.chunk_nbytes(fmt, n) + 64,), 7, dtype=torch.uint8, device=dev) for n in ns]
            run(kv, ids, outs, fmt, ns, True)
            if not all(torch.equal(o[:-64].cpu(), r) and bool((o[-64:] == 7).all()) for o, r in zip(outs, refs)):
                bad.append(("gather", name, fmt, str(dtype)))
            dst = PagedKV([t.to(dev) for t in make_caches(name, 3, 10, 16, 2, 64, dtype, seed=4)], name)
            run(dst, ids, outs, fmt, ns, False)
            back = [torch.zeros(ref.chunk_nbytes(fmt, n), dtype=torch.uint8, device=dev) for n in ns]
            for i, b, n in zip(ids, back, ns):
                dst.gather(i, b, fmt, n)
            if not all(torch.equal(b.cpu(), r) for b, r in zip(back, refs)):
                bad.append(("scatter", name, fmt, str(dtype)))
            if fmt == "block":
                # The leading block of the chunk is not written (it belongs to the prefix cache).
                want = PagedKV(make_caches(name, 3, 10, 16, 2, 64, dtype, seed=5), name)
                got = PagedKV([t.to(dev) for t in make_caches(name, 3, 10, 16, 2, 64, dtype, seed=5)], name)
                want.scatter_blocks(refs[0], ids[0], 1)
                scatter_tail(got, outs[0], ids[0], 1)
                if not all(torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
                           for a, b in zip(want.caches, got.caches)):
                    bad.append(("scatter_blocks", name, fmt, str(dtype)))
print("BAD", bad)
assert not bad, bad
"""


def test_triton_kernel_in_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = CHECK.format(tests=str(HERE), device="cpu")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_on_gpu() -> None:
    code = CHECK.format(tests=str(HERE), device="cuda")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_scatter_api_on_gpu_dispatches_to_triton() -> None:
    from kvferry.kernels.paged_copy import PagedKV
    from tests.kv_caches import make_caches

    caches = make_caches("flash_nhd", 4, 64, 16, 8, 128, torch.bfloat16, device="cuda")
    kv = PagedKV(caches, "flash_nhd")
    out = torch.empty(kv.chunk_nbytes("token", 256), dtype=torch.uint8, device="cuda")
    kv.gather(list(range(16)), out, "token")
    kv.scatter(out, list(range(16, 32)), "token")
    # Bytes, not values: random bytes hold NaNs, and NaN != NaN.
    for c in caches:
        assert torch.equal(c[:, 16:32].contiguous().view(torch.uint8), c[:, :16].contiguous().view(torch.uint8))
