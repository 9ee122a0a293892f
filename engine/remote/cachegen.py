"""The ``cachegen`` codec: KV quantized per channel, per-layer bit widths, entropy coded.

A chunk's KV is, per layer, K and V (one latent for MLA), each a ``[tokens, kv_heads * head_size]``
matrix; each such matrix is one *group*. A group is coded on its own:

- **Anchors and deltas, where they pay.** The tokens are cut into runs of ``ANCHOR_RUN``; the first
  token of a run is its anchor, kept at 8 bits, and the others are coded as their difference from it.
  Trained models' KV changes slowly from token to token in many layers, and the differences are
  smaller than the values; where they are not (randomly initialised models, some layers of real
  ones) the group is coded directly. The encoder measures both and keeps the one with the smaller
  spread, and says which in the group's mode byte.
- **Quantization.** Symmetric, per channel: the channel's largest magnitude over the chunk's tokens
  is its scale, ``bins - 1`` levels span ``[-scale, scale]``. More bins where errors cost more: by
  default (LMCache's setting for 32-layer models, scaled to the model's depth) K of the first 10/32
  of the layers and V of the first 2/32 get 32 bins, the rest 16.
- **Entropy coding.** Groups of at most 16 bins are packed two symbols per byte; all groups' bytes go
  through one zstd frame (level 1), whose Huffman stage codes the skewed symbol histogram (most
  values are near zero) close to its entropy. zstd is already a dependency and decodes at memory
  speed; arithmetic coders in Python packages reach a few percent smaller but decode 10-100x slower.

The payload: a codec header (its own version, the group count, each group's bins and mode), the
per-channel scales (float32), the anchors' scales and 8-bit anchors of delta-coded groups, then the
zstd frame. Every length follows from the chunk's shape and the header, so a reader checks them all
before it allocates or decompresses; the outer chunk header (serde.py) checksums or MACs the payload.

Torch, no Python loop per value: the same operations run on CPU tensors or, for a CUDA cache, on
the GPU (zstd itself runs on the CPU). On the CPU a compiled kernel (kernels/dequant.c, built and
trusted like the row copy) decodes each plane (K, V or latent) in one call straight into a
bfloat16 cache, 4- and 8-bit symbols and anchors alike: several times torch's mixed-dtype ops into
the same strided view, and few enough Python steps that a small chunk's decode is not mostly
overhead (the small per-chunk arrays, scales and anchors, are numpy's for the same reason). Its
values are the torch path's to float32 rounding: both compute ``symbol * scale + bias (+ anchor)``
in float32 and round once to nearest even (torch fuses the multiply-add; whether the C build does
is the compiler's choice for the CPU).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.common.config import CACHEGEN_BINS
from kvferry.common.errors import BadDataError
from kvferry.kernels import native

CODEC_VERSION = 1
ANCHOR_RUN = 16  # tokens per anchor in a delta-coded group
ANCHOR_BINS = 255  # the anchors' own quantization (8 bits)
SAMPLE_RUNS = 4  # runs of ANCHOR_RUN tokens the choice between anchors and direct coding looks at
MIN_BINS, MAX_BINS = CACHEGEN_BINS
# The largest scale a reader accepts: far above any KV value, and low enough that no symbol times
# its scale plus an anchor leaves float32's range (a value that would decode to inf is refused).
MAX_SCALE = 2.0**100
# LMCache's CacheGen setting for 32-layer models (K: 10 layers at 32 bins, the rest at 16;
# V: 2 layers at 32 bins, the rest at 16), scaled to other depths by fraction of the layers.
DEFAULT_KEY_BINS, DEFAULT_VALUE_BINS = (32, 16), (32, 16)
DEFAULT_KEY_FIRST, DEFAULT_VALUE_FIRST = 10 / 32, 2 / 32
ZSTD_LEVEL = 1

_HEAD = struct.Struct("<BBH")  # codec version, kinds (K/V planes per layer), groups
_MODE_DIRECT, _MODE_DELTA = 0, 1


class CodecError(BadDataError, ValueError):
    """A payload that is not a valid cachegen encoding of the expected chunk."""


@dataclass(frozen=True)
class Bins:
    """Quantization bins of each group, in group order (layer-major, K before V)."""

    per_group: tuple[int, ...]

    @staticmethod
    def for_model(num_layers: int, kinds: int, key: tuple[int, int] = DEFAULT_KEY_BINS,
                  value: tuple[int, int] = DEFAULT_VALUE_BINS, key_first: float = DEFAULT_KEY_FIRST,
                  value_first: float = DEFAULT_VALUE_FIRST) -> Bins:
        """`key[0]` bins for K of the first `key_first` of the layers, `key[1]` for the rest; V alike.
        MLA's one latent plane (kinds 1) follows K's schedule."""
        for b in (*key, *value):
            check_bins(b)
        k_first = max(1, round(key_first * num_layers)) if key_first > 0 else 0
        v_first = max(1, round(value_first * num_layers)) if value_first > 0 else 0
        out = []
        for layer in range(num_layers):
            out.append(key[0] if layer < k_first else key[1])
            if kinds == 2:
                out.append(value[0] if layer < v_first else value[1])
        return Bins(tuple(out))


def check_bins(b: int) -> None:
    if not isinstance(b, int) or not MIN_BINS <= b <= MAX_BINS:
        raise ValueError(f"cachegen bins {b!r}: expected an integer from {MIN_BINS} to {MAX_BINS} (16 is 4 bits "
                         "a value, 32 is 5)")


def _levels(bins: int) -> int:
    """L: symbols run over [-L, L], `2L + 1 = bins - 1` levels (LMCache's convention)."""
    return bins // 2 - 1


def packs(bins: int, head_size: int) -> bool:
    """Two symbols a byte: the low nibble codes a channel of the first half of a head, the high
    one the same channel of the second half (so each half dequantizes in one pass, no interleave)."""
    return 2 * _levels(bins) + 1 <= 16 and head_size % 2 == 0


def _ranges(bins: list[int], head_size: int) -> list[tuple[int, int, bool]]:
    """Runs of layers [a, b) of one kind whose groups share a packing: each is coded in one pass."""
    out: list[tuple[int, int, bool]] = []
    for layer, b in enumerate(bins):
        p = packs(b, head_size)
        if out and out[-1][2] == p:
            out[-1] = (out[-1][0], layer + 1, p)
        else:
            out.append((layer, layer + 1, p))
    return out


def _amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude over dim 2 (the tokens) of a [layers, kinds, tokens, heads, dim] tensor
    (faster than torch.aminmax on CPU, measured)."""
    return x.abs().amax(2)


def encode(planes: list[torch.Tensor], tokens: int, bins: Bins) -> bytes:
    """The payload for `planes`, every layer's K and V (or MLA latent): one [layers, blocks,
    block_size, kv_heads, head_size] view per plane, of which the first `tokens` token slots hold
    KV. The rest of the last block (padding vLLM never reads) is coded as zeros (or its run's
    anchor)."""
    import zstandard

    kinds = len(planes)
    layers, nb, bs, h, d = planes[0].shape
    if layers * kinds != len(bins.per_group):
        raise ValueError(f"{layers * kinds} groups, {len(bins.per_group)} bin settings")
    slots = nb * bs
    # A copy (stack), whatever the cache's dtype: the padding and the deltas are written into it.
    x = torch.stack([p.reshape(layers, slots, h, d) for p in planes], 1).float()
    x[:, :, tokens:] = 0
    amax = _amax(x[:, :, :tokens])
    levels = torch.tensor([_levels(b) for b in bins.per_group], dtype=torch.float32,
                          device=x.device).view(layers, kinds, 1, 1)
    delta_groups = torch.zeros(layers, kinds, dtype=torch.bool, device=x.device)
    anchor_parts: list[bytes] = []
    if tokens > ANCHOR_RUN:
        # Which groups deltas pay for, judged on the first runs (the choice needs no exact maxima).
        sample = x[:, :, :min(tokens, SAMPLE_RUNS * ANCHOR_RUN)]
        runs = sample.unflatten(2, (-1, ANCHOR_RUN)) if sample.shape[2] % ANCHOR_RUN == 0 else None
        if runs is not None:
            spread = _amax((runs - runs[:, :, :, :1]).flatten(2, 3))
            delta_groups = spread.sum((-1, -2)) < _amax(sample).sum((-1, -2))
    if bool(delta_groups.any()):
        al = _levels(ANCHOR_BINS)
        anchors = x[:, :, ::ANCHOR_RUN]
        ascale = _amax(anchors)
        ascale = torch.where(ascale > 0, ascale / al, torch.ones_like(ascale))
        aq = torch.round(anchors / ascale.unsqueeze(2)).add_(al).to(torch.uint8)
        # The deltas are taken from the anchors as the decoder will see them.
        back = ((aq.float() - al) * ascale.unsqueeze(2)).repeat_interleave(ANCHOR_RUN, dim=2)[:, :, :slots]
        for layer, kind in delta_groups.nonzero().tolist():
            x[layer, kind] -= back[layer, kind]
            x[layer, kind, tokens:] = 0
            amax[layer, kind] = _amax(x[layer, kind, :tokens].unsqueeze(0).unsqueeze(0))[0, 0]
            anchor_parts += [ascale[layer, kind].cpu().numpy().tobytes(), aq[layer, kind].cpu().numpy().tobytes()]
    scale = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    # |x| <= amax = L * scale: rounding cannot leave [-L, L], so no clamp.
    q = torch.round(x.mul_((1 / scale).unsqueeze(2))).add_(levels.unsqueeze(2)).to(torch.uint8)
    syms = []
    for kind in range(kinds):
        for lo, hi, packed in _ranges(list(bins.per_group[kind::kinds]), d):
            part = q[lo:hi, kind]
            syms.append((part[..., :d // 2] | (part[..., d // 2:] << 4)).reshape(-1) if packed else part.reshape(-1))
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(torch.cat(syms).cpu().numpy().data)
    modes = bytes(v for b, m in zip(bins.per_group, delta_groups.reshape(-1).tolist(), strict=True)
                  for v in (b, _MODE_DELTA if m else _MODE_DIRECT))
    head = _HEAD.pack(CODEC_VERSION, kinds, layers * kinds) + modes
    return b"".join([head, scale.cpu().numpy().tobytes(), *anchor_parts, frame])


def decode(payload: bytes | memoryview, tokens: int, out: list[torch.Tensor]) -> None:
    """Decode into `out`, one writable [layers, blocks, block_size, kv_heads, head_size] view per
    plane (K and V, or MLA's latent). CodecError for a payload that cannot be this chunk's,
    raised before anything is written."""
    import zstandard

    mv = memoryview(payload).cast("B")
    kinds = len(out)
    layers, nb, bs, h, d = out[0].shape
    n, slots, channels = layers * kinds, nb * bs, h * d
    if len(mv) < _HEAD.size:
        raise CodecError("truncated cachegen header")
    version, their_kinds, their_n = _HEAD.unpack_from(mv)
    if version != CODEC_VERSION:
        raise CodecError(f"cachegen codec v{version}; this reader decodes v{CODEC_VERSION}: "
                         f"{'upgrade kvferry' if version > CODEC_VERSION else 'written by an older kvferry'}")
    if their_kinds != kinds or their_n != n:
        raise CodecError(f"{their_n} groups of {their_kinds} planes per layer, expected {n} of {kinds}")
    pos = _HEAD.size
    if len(mv) < pos + 2 * n:
        raise CodecError("truncated cachegen group table")
    table = bytes(mv[pos:pos + 2 * n])
    pos += 2 * n
    bins, modes = list(table[0::2]), list(table[1::2])
    for b, mode in zip(bins, modes, strict=True):
        if not MIN_BINS <= b <= MAX_BINS or mode not in (_MODE_DIRECT, _MODE_DELTA):
            raise CodecError(f"cachegen group with {b} bins, mode {mode}")
    runs = (slots + ANCHOR_RUN - 1) // ANCHOR_RUN
    fixed = 4 * n * channels + modes.count(_MODE_DELTA) * (4 * channels + runs * channels)
    if len(mv) < pos + fixed:
        raise CodecError(f"cachegen payload of {len(mv)} bytes, its scales alone need {pos + fixed}")
    # numpy for the small per-chunk arrays (a fraction of torch's cost per op); copies, so aligned
    scale = np.frombuffer(mv, np.float32, n * channels, pos).reshape(layers, kinds, channels).copy()
    pos += 4 * n * channels
    anchors: dict[tuple[int, int], np.ndarray] = {}  # (layer, kind): float32 [runs, kv_heads * head_size]
    for g, mode in enumerate(modes):
        if mode == _MODE_DELTA:
            ascale = np.frombuffer(mv, np.float32, channels, pos)
            aq = np.frombuffer(mv, np.uint8, runs * channels, pos + 4 * channels).reshape(runs, channels)
            pos += 4 * channels + runs * channels
            if not (np.abs(ascale) <= MAX_SCALE).all():  # also false for NaN
                raise CodecError("cachegen anchor scales that are not finite numbers up to 2^100")
            anchors[g // kinds, g % kinds] = (aq.astype(np.float32) - np.float32(_levels(ANCHOR_BINS))) * ascale
    if not (np.abs(scale) <= MAX_SCALE).all():
        raise CodecError("cachegen scales that are not finite numbers up to 2^100")
    # per plane, its runs of layers [lo, hi) that share a packing, with their symbols' bytes
    parts = [[(lo, hi, packed, (hi - lo) * slots * channels // (2 if packed else 1))
              for lo, hi, packed in _ranges(bins[kind::kinds], d)] for kind in range(kinds)]
    want = sum(p[3] for kparts in parts for p in kparts)
    frame = mv[pos:]
    try:
        size = zstandard.frame_content_size(frame)
        if size not in (want, -1):
            raise CodecError(f"cachegen symbol frame of {size} bytes, expected {want}")
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=want)
    except zstandard.ZstdError as e:
        raise CodecError(f"cachegen symbols: zstd: {e}") from None
    if len(raw) != want:
        raise CodecError(f"cachegen symbols decompressed to {len(raw)} bytes, expected {want}")
    fast = native.dequantizer() if out[0].device.type == "cpu" else None
    at = 0
    for kind, kparts in enumerate(parts):
        if fast is not None and fast.writes(out[kind]):
            offsets, bits = [], []
            for lo, hi, packed, nbytes in kparts:
                offsets += [at + (layer - lo) * nbytes // (hi - lo) for layer in range(lo, hi)]
                bits += [4 if packed else 8] * (hi - lo)
                at += nbytes
            try:
                fast.dequantize(raw, out[kind], offsets, bytes(bins[kind::kinds]), bytes(bits), scale[:, kind],
                                [anchors.get((layer, kind)) for layer in range(layers)], ANCHOR_RUN)
            except ValueError as e:  # checked above; the kernel checks again before it writes anything
                raise CodecError(f"cachegen symbols: {e}") from None
            continue
        at = _decode_with_torch(raw, at, kparts, out[kind], bins[kind::kinds], scale[:, kind],
                                {layer: a for (layer, k), a in anchors.items() if k == kind})


def _decode_with_torch(raw: bytes, at: int, parts: list[tuple[int, int, bool, int]], out: torch.Tensor,
                       bins: list[int], scale: np.ndarray, anchors: dict[int, np.ndarray]) -> int:
    """One plane's layers from `raw`'s symbols at `at` on, with torch ops on `out`'s device (a GPU, a
    cache of another dtype); the offset past them. Each value is computed in float32, anchor
    included, and rounded once into `out`, as the compiled kernel does."""
    layers, nb, bs, h, d = out.shape
    dev, slots = out.device, nb * bs
    s_all = torch.from_numpy(scale).to(dev).view(layers, 1, 1, h, d)
    b_all = s_all * -torch.tensor([_levels(b) for b in bins], dtype=torch.float32, device=dev).view(layers, 1, 1, 1, 1)
    stream = torch.frombuffer(bytearray(memoryview(raw)[at:at + sum(p[3] for p in parts)]), dtype=torch.uint8).to(dev)
    pos = 0
    for lo, hi, packed, nbytes in parts:
        s_, b_ = s_all[lo:hi], b_all[lo:hi]
        q, pos = stream[pos:pos + nbytes], pos + nbytes
        v = torch.empty(hi - lo, nb, bs, h, d, dtype=torch.float32, device=dev)
        if packed:
            half = d // 2
            q = q.view(hi - lo, nb, bs, h, half)
            torch.addcmul(b_[..., :half], q & 15, s_[..., :half], out=v[..., :half])
            torch.addcmul(b_[..., half:], q >> 4, s_[..., half:], out=v[..., half:])
        else:
            torch.addcmul(b_, q.view(hi - lo, nb, bs, h, d), s_, out=v)
        for layer in range(lo, hi):
            if layer in anchors:
                a = torch.from_numpy(anchors[layer]).to(dev).view(-1, h, d)
                v[layer - lo] += a.repeat_interleave(ANCHOR_RUN, dim=0)[:slots].view(nb, bs, h, d)
        out[lo:hi].copy_(v)
    return at + pos
