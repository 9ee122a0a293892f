"""gather/scatter: byte-exact against a naive per-token reference, all layouts and formats."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.kernels import native
from kvferry.kernels.layout import KVLayout, LayoutError, detect_layout
from kvferry.kernels.paged_copy import PagedKV, gather, scatter
from tests.kv_caches import make_caches

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32]


def ref_token_rows(lay: KVLayout, t: torch.Tensor, blk: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V bytes of one token, by explicit indexing of the documented layout."""
    b = t.cpu().view(torch.uint8)
    e = lay.elem_bytes
    d = lay.head_size * e
    if lay.name == "cpu":
        per_head = b[blk]  # [H, bs, 2*d] bytes
        k = torch.stack([per_head[h].reshape(2 * lay.block_size, d)[slot] for h in range(lay.num_kv_heads)])
        v = torch.stack([per_head[h].reshape(2 * lay.block_size, d)[lay.block_size + slot]
                         for h in range(lay.num_kv_heads)])
    elif lay.name == "mla":
        return b[blk, slot].reshape(-1), torch.empty(0, dtype=torch.uint8)
    elif lay.name == "flash_nhd":
        k, v = b[0, blk, slot], b[1, blk, slot]
    else:
        k, v = b[0, blk, :, slot], b[1, blk, :, slot]
    return k.reshape(-1), v.reshape(-1)


def ref_gather(lay: KVLayout, caches: list[torch.Tensor], ids: list[int], fmt: str, n: int) -> bytes:
    out = []
    if fmt == "block":
        for t in caches:
            b = t.cpu().view(torch.uint8)
            planes = [b] if lay.name in ("cpu", "mla") else [b[0], b[1]]
            for p in planes:
                for i in ids:
                    out.append(p[i].reshape(-1))
    else:
        for kv in range(2 if lay.name != "mla" else 1):
            for t in caches:
                for tok in range(n):
                    out.append(ref_token_rows(lay, t, ids[tok // lay.block_size], tok % lay.block_size)[kv])
    return torch.cat(out).numpy().tobytes()


@pytest.fixture(params=["native", "torch"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through the compiled row copy and through the torch fallback."""
    if request.param == "native":
        if native.row_copier() is None:
            pytest.skip("no C compiler: the compiled row copy is not built")
    else:
        monkeypatch.setattr(native, "_loaded", (True, None))
    return request.param


CASES = st.tuples(
    st.sampled_from(["cpu", "flash_nhd", "flash_hnd", "mla"]),
    st.sampled_from(["block", "token"]),
    st.sampled_from(DTYPES),
    st.sampled_from([1, 4, 16, 32]),  # block size
    st.integers(1, 3),  # kv heads
    st.sampled_from([8, 16, 64]),  # head size
    st.integers(1, 3),  # layers
    st.integers(1, 80),  # tokens in the chunk
    st.integers(0, 2**31),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(CASES)
def test_gather_matches_reference_and_scatter_round_trips(copy_path: str, case) -> None:
    name, fmt, dtype, bs, h, d, layers, n, seed = case
    nblk = -(-n // bs)
    nb = nblk + 3
    caches = make_caches(name, layers, nb, bs, h, d, dtype, seed=seed % 1000)
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))[:nblk].tolist()
    kv = PagedKV(caches, name)
    size = kv.chunk_nbytes(fmt, n)
    out = torch.full((size + 64,), 0xAB, dtype=torch.uint8)  # a page larger than the chunk
    assert kv.gather(ids, out, fmt, n) == size
    assert out[:size].numpy().tobytes() == ref_gather(kv.layout, caches, ids, fmt, n)
    assert out[size:].eq(0xAB).all(), "wrote past the chunk"

    # Scatter into a fresh cache, then gathering from it gives the same chunk back.
    fresh = make_caches(name, layers, nb, bs, h, d, dtype, seed=seed % 1000 + 1)
    before = [t.clone() for t in fresh]
    kv2 = PagedKV(fresh, name)
    kv2.scatter(out, ids, fmt, n)
    again = torch.zeros_like(out)
    kv2.gather(ids, again, fmt, n)
    assert torch.equal(again[:size], out[:size])
    # Blocks not in the chunk are untouched.
    others = [i for i in range(nb) if i not in ids]
    for t, t0 in zip(fresh, before, strict=True):
        tb, t0b = t.view(torch.uint8), t0.view(torch.uint8)
        if name in ("cpu", "mla"):
            assert torch.equal(tb[others], t0b[others])
        else:
            assert torch.equal(tb[:, others], t0b[:, others])


@pytest.mark.parametrize("name", ["cpu", "flash_nhd", "flash_hnd", "mla"])
def test_full_round_trip_restores_the_cache(name: str) -> None:
    """gather every chunk of a sequence, wipe the cache, scatter back: identical cache."""
    caches = make_caches(name, 4, 12, 16, 2, 64, torch.bfloat16)
    orig = [t.clone() for t in caches]
    kv = PagedKV(caches, name)
    blocks = list(range(11, -1, -1))
    chunks = []
    for fmt in ("block", "token"):
        chunks = []
        for start in range(0, 12, 4):  # 64-token chunks of 4 blocks
            buf = torch.empty(kv.chunk_nbytes(fmt, 64), dtype=torch.uint8)
            kv.gather(blocks[start:start + 4], buf, fmt)
            chunks.append(buf)
        for t in caches:
            t.zero_()
        for i, start in enumerate(range(0, 12, 4)):
            kv.scatter(chunks[i], blocks[start:start + 4], fmt)
        for t, o in zip(caches, orig, strict=True):
            assert torch.equal(t.view(torch.uint8), o.view(torch.uint8)), fmt


def test_token_format_moves_kv_between_layouts_and_block_sizes() -> None:
    """The portable format: NHD with block 16 -> vLLM CPU layout with block 32, same tokens."""
    n = 50
    src = make_caches("flash_nhd", 2, 8, 16, 2, 64, torch.bfloat16)
    dst = make_caches("cpu", 2, 4, 32, 2, 64, torch.bfloat16, seed=9)
    a, b = PagedKV(src, "flash_nhd"), PagedKV(dst, "cpu")
    buf = torch.empty(a.chunk_nbytes("token", n), dtype=torch.uint8)
    a.gather([5, 1, 7, 2], buf, "token", n)
    b.scatter(buf, [3, 0], "token", n)
    for tok in range(n):
        for layer in range(2):
            ks, vs = ref_token_rows(a.layout, src[layer], [5, 1, 7, 2][tok // 16], tok % 16)
            kd, vd = ref_token_rows(b.layout, dst[layer], [3, 0][tok // 32], tok % 32)
            assert torch.equal(ks, kd) and torch.equal(vs, vd)


def test_one_shot_functions_and_chunk_size() -> None:
    caches = make_caches("cpu", 8, 20, 32, 8, 64, torch.bfloat16)
    out = torch.empty(8 * 8 * 32 * 8 * 64 * 2 * 2, dtype=torch.uint8)  # 256 tokens: 4 MiB
    assert out.numel() == 4 << 20
    src, dst = [1, 2, 3, 4, 5, 6, 7, 8], [19, 17, 15, 13, 11, 9, 0, 12]
    assert gather(caches, src, out) == 4 << 20
    assert scatter(out, caches, dst) == 4 << 20
    for t in caches:
        assert torch.equal(t[dst].view(torch.uint8), t[src].view(torch.uint8))


def test_bad_input_is_rejected_clearly(copy_path: str) -> None:
    caches = make_caches("cpu", 2, 4, 16, 2, 64, torch.bfloat16)
    kv = PagedKV(caches, "cpu")
    small = torch.empty(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="chunk buffer holds 10 bytes"):
        kv.gather([0], small)
    strided = torch.empty(2, kv.chunk_nbytes("block", 16), dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):  # would otherwise fill a hidden copy
        kv.gather([0], strided)
    untouched = torch.full((kv.chunk_nbytes("block", 32),), 7, dtype=torch.uint8)
    with pytest.raises(IndexError, match=r"block ids must lie in \[0, 4\)"):
        kv.gather([0, 4], untouched)  # block 0 is valid: nothing may be copied before the check
    assert untouched.eq(7).all()
    with pytest.raises(IndexError):
        kv.scatter(untouched, torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="20 tokens do not fit the 1 blocks"):
        kv.gather([0], torch.empty(1 << 20, dtype=torch.uint8), num_tokens=20)
    with pytest.raises(ValueError, match="20 tokens need 2 blocks, got 3"):
        kv.gather([0, 1, 2], torch.empty(1 << 20, dtype=torch.uint8), num_tokens=20)
    with pytest.raises(LayoutError, match="layer 1"):
        PagedKV([caches[0], caches[1][:2]], "cpu")
    with pytest.raises(LayoutError, match="matches none"):
        detect_layout(torch.empty(3, 4, 5), 16, 2, 64)
    assert detect_layout(caches[0], 16, 2, 64).name == "cpu"
    nhd = make_caches("flash_nhd", 1, 4, 16, 2, 64, torch.bfloat16)[0]
    assert detect_layout(nhd, 16, 2, 64).name == "flash_nhd"
    hnd = make_caches("flash_hnd", 1, 4, 16, 2, 64, torch.bfloat16)[0]
    assert detect_layout(hnd, 16, 2, 64).name == "flash_hnd"


def test_layers_as_views_of_one_big_tensor() -> None:
    """vLLM may hand out layers as views of one allocation (block-major across layers)."""
    big = torch.randint(0, 256, (6, 3, 2, 16, 128), dtype=torch.uint8).view(torch.bfloat16)  # [NB, L, ...]
    layers = [big[:, i] for i in range(3)]  # non-contiguous per layer: stride(0) spans 3 layers
    kv = PagedKV(layers, "cpu")
    out = torch.empty(kv.chunk_nbytes("block", 32), dtype=torch.uint8)
    kv.gather([4, 1], out)
    expect = torch.cat([big[[4, 1], i].reshape(-1).view(torch.uint8) for i in range(3)])
    assert torch.equal(out, expect)


def test_without_a_compiler_the_torch_path_is_used_with_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                  kvf_logs: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", (False, None))
    assert native.row_copier() is None
    assert "install a C compiler" in kvf_logs.text
    assert not list(tmp_path.rglob("*.so")), "a failed build left a library behind"
    caches = make_caches("cpu", 2, 4, 16, 2, 64, torch.bfloat16)
    out = torch.empty(PagedKV(caches, "cpu").chunk_nbytes("block", 32), dtype=torch.uint8)
    gather(caches, [2, 0], out)
    assert out.numpy().tobytes() == ref_gather(PagedKV(caches, "cpu").layout, caches, [2, 0], "block", 32)


def test_the_compiled_copy_is_built_once_into_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", (False, None))
    if native.row_copier() is None:
        pytest.skip("no C compiler")
    libs = list(tmp_path.rglob("native-*.so"))
    assert len(libs) == 1
    mtime = libs[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_loaded", (False, None))
    assert native.row_copier() is not None
    assert libs[0].stat().st_mtime_ns == mtime, "rebuilt although the source did not change"


@pytest.mark.parametrize("name", ["cpu", "flash_nhd", "flash_hnd", "mla"])
@pytest.mark.parametrize("first", [1, 2, 3])
def test_scatter_blocks_writes_only_the_blocks_after_first(name: str, first: int) -> None:
    """A decoder whose prefix cache holds the first blocks of a chunk writes only the others."""
    src = make_caches(name, 3, 10, 16, 2, 32, torch.bfloat16, seed=1)
    dst = make_caches(name, 3, 10, 16, 2, 32, torch.bfloat16, seed=2)
    orig = [t.clone() for t in dst]
    a, b = PagedKV(src, name), PagedKV(dst, name)
    chunk = torch.empty(a.chunk_nbytes("block", 64), dtype=torch.uint8)
    a.gather([0, 1, 2, 3], chunk, "block")
    ids = [9, 5, 7, 2]
    assert b.scatter_blocks(chunk, ids, first) == 3 * a.layout.planes * (4 - first) * a.layout.block_bytes
    for i, blk in enumerate(ids):
        for layer in range(3):
            got = b.layout.block_planes(dst[layer])
            want = a.layout.block_planes(src[layer]) if i >= first else b.layout.block_planes(orig[layer])
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g[blk].view(torch.uint8), w[i if i >= first else blk].view(torch.uint8))
    untouched = set(range(10)) - set(ids)
    for layer in range(3):
        for g, o in zip(b.layout.block_planes(dst[layer]), b.layout.block_planes(orig[layer]), strict=True):
            assert all(torch.equal(g[k].view(torch.uint8), o[k].view(torch.uint8)) for k in untouched)
    with pytest.raises(ValueError, match="outside"):
        b.scatter_blocks(chunk, ids, 4)


def test_scatter_blocks_can_stop_before_the_chunk_ends() -> None:
    """A chunk of 4 blocks loaded into a request that has only 3 of them allocated."""
    src = make_caches("cpu", 2, 8, 16, 2, 32, torch.bfloat16, seed=3)
    dst = make_caches("cpu", 2, 8, 16, 2, 32, torch.bfloat16, seed=4)
    orig = [t.clone() for t in dst]
    a, b = PagedKV(src, "cpu"), PagedKV(dst, "cpu")
    chunk = torch.empty(a.chunk_nbytes("block", 64), dtype=torch.uint8)
    a.gather([0, 1, 2, 3], chunk, "block")
    b.scatter_blocks(chunk, [6, 4, 5], 1, chunk_blocks=4)
    for layer in range(2):
        s, d, o = (t.view(torch.uint8) for t in (src[layer], dst[layer], orig[layer]))
        assert torch.equal(d[4], s[1]) and torch.equal(d[5], s[2])
        assert all(torch.equal(d[k], o[k]) for k in (0, 1, 2, 3, 6, 7))
    with pytest.raises(ValueError, match="outside"):
        b.scatter_blocks(chunk, [1, 2, 3, 4, 5], 0, chunk_blocks=4)


def test_a_cached_library_others_can_write_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                      kvf_logs: pytest.LogCaptureFixture) -> None:
    """The row copy is loaded into vLLM: a library someone else could have written never is."""
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", (False, None))
    if native.row_copier() is None:
        pytest.skip("no C compiler")
    lib = next(tmp_path.rglob("native-*.so"))
    assert lib.stat().st_mode & 0o022 == 0 and lib.parent.stat().st_mode & 0o077 == 0
    lib.chmod(0o777)
    monkeypatch.setattr(native, "_loaded", (False, None))
    assert native.row_copier() is None
    assert "writable by others" in kvf_logs.text and str(lib) in kvf_logs.text


def test_the_library_name_follows_the_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Another compiler (or other flags) under the same source builds another library, not the old one."""
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", (False, None))
    if native.row_copier() is None:
        pytest.skip("no C compiler")
    first = {p.name for p in tmp_path.rglob("native-*.so")}
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "other-cc 9.9"; exit 0; }\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(native, "_loaded", (False, None))
    assert native.row_copier() is not None
    assert len({p.name for p in tmp_path.rglob("native-*.so")} - first) == 1


def test_mla_cpu_shape_with_a_head_dim_of_one_is_the_mla_layout() -> None:
    """vLLM CPU_MLA hands out [blocks, 1, block_size, latent]: detected as mla, copied as the 3-D cache."""
    caches = make_caches("mla", 2, 6, 16, 1, 576, torch.bfloat16)
    cpu_shaped = [t.unsqueeze(1) for t in caches]
    assert tuple(cpu_shaped[0].shape) == (6, 1, 16, 576)
    lay = detect_layout(cpu_shaped[0], 16, 1, 576)
    assert lay.name == "mla" and lay.num_blocks == 6
    a, b = PagedKV(caches, "mla"), PagedKV(cpu_shaped, lay)
    for fmt in ("block", "token"):
        x = torch.empty(a.chunk_nbytes(fmt, 40), dtype=torch.uint8)
        y = torch.empty_like(x)
        a.gather([4, 0, 2], x, fmt, 40)
        b.gather([4, 0, 2], y, fmt, 40)
        assert torch.equal(x, y) and x.numpy().tobytes() == ref_gather(a.layout, caches, [4, 0, 2], fmt, 40)
    with pytest.raises(LayoutError, match="matches none"):
        detect_layout(torch.empty(6, 2, 16, 576), 16, 1, 576)
