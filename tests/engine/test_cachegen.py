"""The cachegen codec (engine/remote/cachegen.py) and its serde format: a round trip within the
quantization's bound for every layer, anchors and deltas where the KV is smooth, LMCache's
per-layer bins, and a damaged, truncated or foreign payload refused before anything is written."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
import torch

from kvferry.common.config import ConfigError
from kvferry.engine.remote import cachegen as cg
from kvferry.engine.remote.serde import ChunkShape, Serde, SerdeError
from kvferry.kernels.layout import KVLayout
from tests.polling import until

LAYERS, HEADS, HEAD, BS = 4, 2, 16, 16


def shape(layout: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> ChunkShape:
    heads = 1 if layout == "mla" else HEADS
    return ChunkShape(dtype, LAYERS, heads, HEAD, b"L" * 16, layout, BS)


def chunk(s: ChunkShape, tokens: int, seed: int = 0, smooth: bool = False) -> torch.Tensor:
    """A flat "block" chunk whose K/V (or latent) views hold random (or slowly drifting) values."""
    nblk = -(-tokens // BS)
    lay = KVLayout(s.layout, nblk, BS, s.num_kv_heads, HEAD, s.dtype)
    out = torch.zeros(LAYERS * lay.chunk_nbytes("block", 1, tokens), dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    for v in views(s, out, tokens):
        n = v.shape[0] * v.shape[1]
        if smooth:
            x = torch.randn(1, v.shape[2], HEAD, generator=g) * 4 + torch.cumsum(
                torch.randn(n, v.shape[2], HEAD, generator=g) * 0.02, 0)
        else:
            x = torch.randn(n, v.shape[2], HEAD, generator=g) * (1 + torch.rand(1, v.shape[2], HEAD, generator=g))
        v.copy_(x.view(v.shape))
    return out


def views(s: ChunkShape, c: torch.Tensor, tokens: int) -> list[torch.Tensor]:
    """Each layer's K and V (or latent) in `c`: [blocks, block_size, kv_heads, head_size] views."""
    planes = s.chunk_kv(c, tokens)
    return [planes[kind][layer] for layer in range(planes[0].shape[0]) for kind in range(len(planes))]


def groups(s: ChunkShape, c: torch.Tensor, tokens: int) -> list[torch.Tensor]:
    return [v.reshape(-1, v.shape[2] * v.shape[3])[:tokens].float() for v in views(s, c, tokens)]


def roundtrip(serde: Serde, c: torch.Tensor, tokens: int) -> torch.Tensor:
    head, payload = serde.encode(c, tokens)
    return serde.decode(head, bytes(payload), tokens, c.numel())


@pytest.mark.parametrize("layout", ["cpu", "flash_nhd", "flash_hnd", "mla"])
def test_cachegen_round_trip_is_within_each_layers_quantization_bound(layout: str) -> None:
    s = shape(layout)
    serde = Serde("cachegen", s)
    tokens = 3 * BS - 5  # a partly filled last block
    c = chunk(s, tokens)
    back = roundtrip(serde, c, tokens)
    assert serde.bins is not None
    for want, got, bins in zip(groups(s, c, tokens), groups(s, back, tokens), serde.bins.per_group, strict=True):
        # Half a step of the channel's scale, plus the bf16 rounding of the result.
        step = want.abs().amax(0) / (bins // 2 - 1)
        assert bool(((got - want).abs() <= step / 2 + want.abs() / 128 + 1e-6).all())
        assert float((got - want).norm() / want.norm()) < (0.15 if bins == 16 else 0.08)
    for v in views(s, back, tokens):  # the last block's padding (random KV: coded directly): zeros, to rounding
        assert float(v.reshape(-1, v.shape[2], v.shape[3])[tokens:].abs().max()) < 1e-5


@pytest.mark.parametrize("head_size", [1, 15])
def test_cachegen_decodes_odd_head_sizes_through_torch(head_size: int) -> None:
    """An odd head size cannot pack two symbols a byte per half head, and the compiled kernel
    takes even ones only: the decode goes through torch, within the same bound."""
    s = ChunkShape(torch.bfloat16, 2, 2, head_size, b"L" * 16, "flash_nhd", BS)
    tokens = 2 * BS - 3
    c = torch.zeros(2 * 2 * 2 * BS * 2 * head_size * 2, dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)
    for v in s.chunk_kv(c, tokens):
        v.copy_(torch.randn(v.shape, generator=g))
    serde = Serde("cachegen", s)
    back = roundtrip(serde, c, tokens)
    assert serde.bins is not None
    for kind, (want, got) in enumerate(zip(s.chunk_kv(c, tokens), s.chunk_kv(back, tokens), strict=True)):
        for layer in range(2):
            w = want[layer].reshape(-1, 2 * head_size)[:tokens].float()
            d = (got[layer].reshape(-1, 2 * head_size)[:tokens].float() - w).abs()
            step = w.abs().amax(0) / (serde.bins.per_group[2 * layer + kind] // 2 - 1)
            assert bool((d <= step / 2 + w.abs() / 128 + 1e-6).all())


def test_a_full_cachegen_chunk_is_over_3_5x_smaller_than_naive() -> None:
    """Normal values (a random-weight model's KV is close to that); real KV is in the benchmark."""
    s = shape()
    tokens = 256
    c = chunk(s, tokens)
    head, payload = Serde("cachegen", s).encode(c, tokens)
    naive_head, naive = Serde("naive", s).encode(c, tokens)
    assert (len(naive_head) + len(naive)) / (len(head) + len(payload)) > 3.5


def test_cachegen_codes_smooth_kv_as_anchors_and_deltas_and_random_kv_directly() -> None:
    s = shape()
    tokens = 4 * BS
    smooth, rough = chunk(s, tokens, smooth=True), chunk(s, tokens)
    serde = Serde("cachegen", s)
    _, ps = serde.encode(smooth, tokens)
    _, pr = serde.encode(rough, tokens)
    modes = lambda p: [bytes(p)[4 + 2 * i + 1] for i in range(2 * LAYERS)]  # noqa: E731
    assert modes(ps) == [1] * (2 * LAYERS) and modes(pr) == [0] * (2 * LAYERS)
    back = roundtrip(serde, smooth, tokens)
    for want, got in zip(groups(s, smooth, tokens), groups(s, back, tokens), strict=True):
        # The deltas span far less than the values: the error is a small part of the spread.
        assert float((got - want).abs().max() / want.abs().max()) < 0.01


def test_cachegen_bins_follow_lmcache_for_32_layers_and_scale_with_depth() -> None:
    b = cg.Bins.for_model(32, 2).per_group
    assert b[0::2] == (32,) * 10 + (16,) * 22 and b[1::2] == (32,) * 2 + (16,) * 30
    assert cg.Bins.for_model(4, 2).per_group == (32, 32, 16, 16, 16, 16, 16, 16)
    assert cg.Bins.for_model(4, 1).per_group == (32, 16, 16, 16)  # MLA's latent follows K's schedule
    with pytest.raises(ValueError, match="from 4 to 64"):
        cg.Bins.for_model(4, 2, key=(128, 16))


def test_a_damaged_or_truncated_cachegen_chunk_is_refused() -> None:
    s = shape()
    tokens = 2 * BS
    serde = Serde("cachegen", s)
    c = chunk(s, tokens)
    head, payload = serde.encode(c, tokens)
    p = bytearray(payload)
    p[len(p) // 2] ^= 0x10
    with pytest.raises(SerdeError, match="checksum"):
        serde.decode(head, bytes(p), tokens, c.numel())
    with pytest.raises(SerdeError):
        serde.decode(head, bytes(payload)[:-7], tokens, c.numel())
    # Past the checksum (a store that rewrote the header too): the codec's own checks refuse it.
    scratch = torch.full_like(c, 0x5A)
    for cut in (2, 4 + 2 * 2 * LAYERS + 8, len(payload) - 9):
        with pytest.raises(cg.CodecError):
            cg.decode(bytes(payload)[:cut], tokens, s.chunk_kv(scratch, tokens))
    bad_scale = bytearray(payload)
    bad_scale[4 + 4 * LAYERS:4 + 4 * LAYERS + 4] = struct.pack("<f", float("nan"))
    with pytest.raises(cg.CodecError, match="not finite"):
        cg.decode(bytes(bad_scale), tokens, s.chunk_kv(scratch, tokens))
    # finite, but a symbol times it would leave float32's range (inf in the cache)
    bad_scale[4 + 4 * LAYERS:4 + 4 * LAYERS + 4] = struct.pack("<f", 1e38)
    with pytest.raises(cg.CodecError, match="up to 2"):
        cg.decode(bytes(bad_scale), tokens, s.chunk_kv(scratch, tokens))
    assert bool((scratch == 0x5A).all())  # refused before anything was written


def test_a_newer_cachegen_codec_version_is_refused_naming_the_upgrade() -> None:
    s = shape()
    tokens = BS
    c = chunk(s, tokens)
    _, payload = Serde("cachegen", s).encode(c, tokens)
    newer = bytes([cg.CODEC_VERSION + 1]) + bytes(payload)[1:]
    with pytest.raises(cg.CodecError, match="upgrade kvferry"):
        cg.decode(newer, tokens, s.chunk_kv(torch.empty_like(c), tokens))


def test_cachegen_refuses_a_cache_it_cannot_quantize() -> None:
    from kvferry.common.config import ConfigError

    with pytest.raises(ConfigError, match="use naive or zstd"):
        Serde("cachegen", shape(dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("smooth", [False, True], ids=["direct", "anchors"])
@pytest.mark.parametrize("layout", ["cpu", "flash_hnd", "mla"])
def test_cachegen_compiled_dequantizer_matches_the_torch_path(layout: str, smooth: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU decode's compiled kernel and the torch ops give the same KV, to one bfloat16
    rounding step: 4- and 8-bit symbols, rows and vLLM CPU's transposed K, coded directly or as
    deltas from anchors (both add them in float32 before the one rounding)."""
    from kvferry.kernels import native
    if native.dequantizer() is None:
        pytest.skip("no C compiler")
    s = shape(layout)
    serde = Serde("cachegen", s, cg.Bins(tuple([16, 32] * LAYERS)[:LAYERS * (1 if layout == "mla" else 2)]))
    tokens = 4 * BS + 5  # a partial last block and anchor run
    c = chunk(s, tokens, seed=5, smooth=smooth)
    head, payload = serde.encode(c, tokens)
    groups_n = LAYERS * (1 if layout == "mla" else 2)
    assert set(bytes(payload)[5:4 + 2 * groups_n:2]) == {1 if smooth else 0}  # each group's mode byte
    fast = serde.decode(head, bytes(payload), tokens, c.numel())
    monkeypatch.setattr(native, "_loaded", (True, None))
    slow = serde.decode(head, bytes(payload), tokens, c.numel())
    for f, w in zip(groups(s, fast, tokens), groups(s, slow, tokens), strict=True):
        # one bf16 rounding step at most, where float32 rounding tipped the value
        assert bool(((f - w).abs() <= w.abs() / 128 + 1e-6).all())
    assert float((groups(s, fast, tokens)[0] - groups(s, c, tokens)[0]).abs().max()) > 0  # it is lossy: not a copy


def test_cachegen_compiled_dequantizer_refuses_what_no_encoding_has_writing_nothing() -> None:
    """The kernel's own checks (the decoder checks the payload first; this is the last line):
    symbols past the end, bits or bins no encoding has, anchors of another shape."""
    import numpy as np

    from kvferry.kernels import native
    fast = native.dequantizer()
    if fast is None:
        pytest.skip("no C compiler")
    out = torch.full((2, 2, BS, HEADS, HEAD), 7.0, dtype=torch.bfloat16)
    n = 2 * BS * HEADS * HEAD  # symbols per layer
    scale = np.ones((2, HEADS * HEAD), np.float32)
    ok = dict(offsets=[0, n], bins=bytes([32, 32]), bits=bytes([8, 8]), scale=scale, anchors=[None, None], run=16)
    fast.dequantize(bytes(2 * n), out, **ok)  # type: ignore[arg-type]
    assert bool((out == -15).all())  # symbol 0 of 32 bins: -(32 // 2 - 1) steps
    out.fill_(7.0)
    bad = [dict(offsets=[0, n + 1]), dict(offsets=[-1, n]), dict(bits=bytes([8, 5])), dict(bins=bytes([32, 2])),
           dict(bits=bytes([8, 4])),  # 4 bits a symbol cannot hold 32 bins' levels
           dict(anchors=[None, np.zeros((1, HEADS * HEAD), np.float32)]), dict(scale=scale[:1])]
    for change in bad:
        with pytest.raises(ValueError, match="dequantize"):
            fast.dequantize(bytes(2 * n), out, **{**ok, **change})  # type: ignore[arg-type]
        assert bool((out == 7.0).all()), change


def test_cachegen_bins_are_configurable_and_bad_ones_are_refused_naming_the_range() -> None:
    from kvferry.common.config import ConfigError, load_config
    cfg = load_config(env={"LMCACHE_REMOTE_SERDE": "cachegen", "KVFERRY_CACHEGEN_KEY_BINS": "[64, 32]"})
    assert cfg.remote_serde == "cachegen" and cfg.cachegen_key_bins == [64, 32] and cfg.cachegen_value_bins == [32, 16]
    for bad in ("[64]", "[2, 16]", "[16, 65]"):
        with pytest.raises(ConfigError, match="cachegen_key_bins.*from 4 to 64"):
            load_config(env={"KVFERRY_CACHEGEN_KEY_BINS": bad})
    b = cg.Bins.for_model(32, 2, key=(64, 32), value=(32, 8))
    assert b.per_group[:2] == (64, 32) and b.per_group[2 * 10:2 * 10 + 2] == (32, 8) and b.per_group[-1] == 8


@pytest.fixture(params=["redis", "sentinel", "lm", "mooncake"])
def backend(request: pytest.FixtureRequest, tmp_path, redis_available) -> Iterator[tuple[str, dict]]:
    """A real store of each remote backend; yields its remote_url and RemoteTier keywords."""
    from kvferry.common.config import load_config
    from kvferry.engine.remote import mooncake_backend, mooncake_settings
    from kvferry.launcher.services import MooncakeMaster, mooncake_master_binary
    from kvferry.testing.store_servers import start_lm_server, start_redis, start_sentinel

    procs: list = []
    try:
        if request.param == "mooncake":
            if mooncake_master_binary() is None:
                pytest.skip("mooncake_master not installed")
            m = MooncakeMaster(tmp_path)
            procs.append(m)
            cfg = load_config({"remote_url": m.url, "extra_config": {**m.extra_config(64 << 20),
                                                                     "local_hostname": "127.0.0.1"}}, env={})
            yield m.url, {"mooncake": mooncake_settings.from_config(cfg)}
        elif request.param == "sentinel":
            procs.append(master := start_redis(tmp_path))
            procs.append(start_redis(tmp_path, replicaof=master.port))
            procs.append(s := start_sentinel(tmp_path, master.port))
            yield f"redis-sentinel://{s.url_hostport}", {}
        else:
            procs.append(p := start_redis(tmp_path) if request.param == "redis" else start_lm_server(tmp_path))
            yield f"{request.param}://{p.url_hostport}", {}
    finally:
        if request.param == "mooncake":
            mooncake_backend.close_all()  # while the master answers: a client of a dead one blocks exit
        for p in procs:
            p.stop()


def test_cachegen_chunks_round_trip_through_every_remote_backend_and_damage_is_a_counted_miss(
        backend: tuple[str, dict]) -> None:
    from kvferry.engine.remote.serde import HEADER_BYTES
    from kvferry.engine.tiers.remote import RemoteTier

    url, kw = backend
    s = shape()
    tokens = 3 * BS - 2
    c = chunk(s, tokens, seed=9)
    serde = Serde("cachegen", s)
    want = roundtrip(serde, c, tokens)  # what decoding this chunk gives, offline
    t = RemoteTier(url, 2.0, serde, **kw)
    try:
        def stored() -> bool:  # a Mooncake client joins its store inside its first call: retried
            return t.put(b"C" * 16, c, tokens) and t.flush(5) and t.exists([b"C" * 16]) == [True]
        until(stored, 30, f"{url} to hold the chunk")
        got = t.get(b"C" * 16, tokens, c.numel())
        assert got is not None and torch.equal(got, want)
        _, payload = serde.encode(c, tokens)
        # it travelled small: the payload (and, depending on the backend's count, its header)
        assert len(payload) <= t.stats()["remote_get_bytes"] <= HEADER_BYTES + len(payload) < c.numel() / 3
        # A cachegen value damaged on its way into the store: a miss, counted, never wrong KV.
        writer = RemoteTier(url, 2.0, Damaging("cachegen", s), **kw)
        try:
            until(lambda: writer.put(b"D" * 16, c, tokens) and writer.flush(5) and t.exists([b"D" * 16]) == [True],
                  30, f"{url} to hold the damaged chunk")
        finally:
            writer.close()
        assert t.get(b"D" * 16, tokens, c.numel()) is None and t.stats()["remote_corrupt"] == 1
    finally:
        t.close()


class Damaging(Serde):
    """Writes a cachegen value with one payload bit flipped after its checksum was taken."""

    def encode(self, data: torch.Tensor, tokens: int, mac=None, key: bytes = b""):  # type: ignore[no-untyped-def]
        head, payload = super().encode(data, tokens, mac, key)
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0x10
        return head, bytes(bad)


@pytest.mark.parametrize("layout", ["flash_nhd", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cachegen_encoding_leaves_the_chunk_it_reads_untouched(layout: str, dtype: torch.dtype) -> None:
    """The chunk is the one being stored (and, for a P2P or CPU tier, kept): coding works on a copy."""
    s = shape(layout, dtype)
    tokens = 2 * BS + 3
    c = chunk(s, tokens, seed=11, smooth=True)
    before = c.clone()
    Serde("cachegen", s).encode(c, tokens)
    assert torch.equal(c, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["flash_nhd", "mla"])
def test_cachegen_on_a_gpu_writes_the_cpus_bytes_and_decodes_to_its_values(layout: str) -> None:
    s = shape(layout)
    tokens = 4 * BS - 1
    for smooth in (False, True):
        c = chunk(s, tokens, seed=13, smooth=smooth)
        bins = Serde("cachegen", s).bins
        assert bins is not None
        on_cpu = cg.encode(s.chunk_kv(c, tokens), tokens, bins)
        on_gpu = cg.encode(s.chunk_kv(c.cuda(), tokens), tokens, bins)
        assert on_gpu == on_cpu
        a, b = torch.zeros_like(c), torch.zeros_like(c).cuda()
        cg.decode(on_cpu, tokens, s.chunk_kv(a, tokens))
        cg.decode(on_cpu, tokens, s.chunk_kv(b, tokens))
        for f, w in zip(groups(s, b.cpu(), tokens), groups(s, a, tokens), strict=True):
            assert bool(((f - w).abs() <= w.abs() / 128 + 1e-6).all())


@pytest.mark.parametrize("isa,bs", [("vec", 128), ("vec", 32), ("vec16", 16)])
def test_cachegen_reads_vllm_cpu_blocks_token_by_token(isa: str, bs: int) -> None:
    """vLLM CPU's own cache write (its vec kernels keep K transposed in a block) read back through
    the chunk's K and V views: every token's K and V where the codec expects them."""
    ops = pytest.importorskip("vllm._custom_ops")
    h, d, nb = 2, 64, 2
    tokens = nb * bs - 3
    g = torch.Generator().manual_seed(21)
    key, value = (torch.randn(tokens, h, d, generator=g).bfloat16() for _ in range(2))
    cache = torch.zeros(nb, h, bs, 2 * d, dtype=torch.bfloat16)  # one layer, "cpu" layout
    kc, vc = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(tokens), isa)
    s = ChunkShape(torch.bfloat16, 1, h, d, b"L" * 16, "cpu", bs, isa)
    k, v = s.chunk_kv(cache.view(-1).view(torch.uint8), tokens)
    assert torch.equal(k[0].reshape(-1, h, d)[:tokens], key)
    assert torch.equal(v[0].reshape(-1, h, d)[:tokens], value)
    with pytest.raises(ConfigError, match="AMX-packed"):
        Serde("cachegen", ChunkShape(torch.bfloat16, 1, h, d, b"L" * 16, "cpu", bs, "amx"))
