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

Pure torch, no Python loop per value: the same operations run on CPU tensors or, for a CUDA cache,
on the GPU (zstd itself runs on the CPU).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvferry.common.errors import BadDataError

CODEC_VERSION = 1
ANCHOR_RUN = 16  # tokens per anchor in a delta-coded group
ANCHOR_BINS = 255  # the anchors' own quantization (8 bits)
MIN_BINS, MAX_BINS = 4, 64
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


def _packed(bins: int) -> bool:
    return 2 * _levels(bins) + 1 <= 16


def _sym_bytes(bins: int, n: int) -> int:
    return (n + 1) // 2 if _packed(bins) else n


def _quantize(y: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbols in [0, 2L] as uint8, per-channel scale float32) of a [T, C] float32 matrix."""
    amax = y.abs().amax(0)
    scale = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    q = torch.round(y / scale).clamp_(-levels, levels).add_(levels).to(torch.uint8)
    return q, scale


def _pack(q: torch.Tensor) -> torch.Tensor:
    flat = q.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def _unpack(b: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(-1)[:n]


def encode(groups: list[torch.Tensor], bins: Bins, kinds: int) -> bytes:
    """The payload for `groups`: each a [tokens, channels] matrix of one layer's K or V (or latent)."""
    import zstandard

    if len(groups) != len(bins.per_group):
        raise ValueError(f"{len(groups)} groups, {len(bins.per_group)} bin settings")
    modes, scales, anchor_parts, syms = bytearray(), [], [], []
    for g, b in zip(groups, bins.per_group, strict=True):
        x = g.float()
        t = x.shape[0]
        anchors = x[::ANCHOR_RUN]
        delta = x - anchors.repeat_interleave(ANCHOR_RUN, dim=0)[:t]
        use_delta = t > 1 and bool(delta.abs().amax(0).sum() < x.abs().amax(0).sum())
        if use_delta:
            aq, ascale = _quantize(anchors, _levels(ANCHOR_BINS))
            # The deltas are taken from the anchors as the decoder will see them.
            back = (aq.float() - _levels(ANCHOR_BINS)) * ascale
            delta = x - back.repeat_interleave(ANCHOR_RUN, dim=0)[:t]
            anchor_parts += [ascale.cpu().numpy().tobytes(), aq.cpu().numpy().tobytes()]
        q, scale = _quantize(delta if use_delta else x, _levels(b))
        modes += bytes((b, _MODE_DELTA if use_delta else _MODE_DIRECT))
        scales.append(scale)
        syms.append(_pack(q) if _packed(b) else q.reshape(-1))
    stream = torch.cat(syms).cpu().numpy()
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(stream.data)
    head = _HEAD.pack(CODEC_VERSION, kinds, len(groups)) + bytes(modes)
    return b"".join([head, torch.cat(scales).cpu().numpy().tobytes(), *anchor_parts, frame])


def decode(payload: bytes | memoryview, tokens: int, channels: int, ngroups: int, kinds: int,
           sink: Callable[[int, torch.Tensor], None], device: torch.device | str = "cpu") -> None:
    """Decode each group to a [tokens, channels] float32 tensor on `device`, handed to
    `sink(group, values)` (which stores it); CodecError for a payload that cannot be this chunk's,
    raised before `sink` is first called."""
    import zstandard

    mv = memoryview(payload).cast("B")
    if len(mv) < _HEAD.size:
        raise CodecError("truncated cachegen header")
    version, their_kinds, n = _HEAD.unpack_from(mv)
    if version != CODEC_VERSION:
        raise CodecError(f"cachegen codec v{version}; this reader decodes v{CODEC_VERSION}: "
                         f"{'upgrade kvferry' if version > CODEC_VERSION else 'written by an older kvferry'}")
    if their_kinds != kinds or n != ngroups:
        raise CodecError(f"{n} groups of {their_kinds} planes per layer, expected {ngroups} of {kinds}")
    pos = _HEAD.size
    if len(mv) < pos + 2 * n:
        raise CodecError("truncated cachegen group table")
    table = bytes(mv[pos:pos + 2 * n])
    pos += 2 * n
    settings = [(table[2 * i], table[2 * i + 1]) for i in range(n)]
    for b, mode in settings:
        if not MIN_BINS <= b <= MAX_BINS or mode not in (_MODE_DIRECT, _MODE_DELTA):
            raise CodecError(f"cachegen group with {b} bins, mode {mode}")
    runs = (tokens + ANCHOR_RUN - 1) // ANCHOR_RUN
    delta_groups = sum(mode == _MODE_DELTA for _, mode in settings)
    fixed = 4 * n * channels + delta_groups * (4 * channels + runs * channels)
    if len(mv) < pos + fixed:
        raise CodecError(f"cachegen payload of {len(mv)} bytes, its scales alone need {pos + fixed}")
    scales = torch.frombuffer(bytearray(mv[pos:pos + 4 * n * channels]), dtype=torch.float32).view(n, channels)
    pos += 4 * n * channels
    if not bool(torch.isfinite(scales).all()):
        raise CodecError("cachegen scales that are not finite")
    anchors: dict[int, torch.Tensor] = {}
    for i, (_, mode) in enumerate(settings):
        if mode == _MODE_DELTA:
            ascale = torch.frombuffer(bytearray(mv[pos:pos + 4 * channels]), dtype=torch.float32)
            pos += 4 * channels
            aq = torch.frombuffer(bytearray(mv[pos:pos + runs * channels]), dtype=torch.uint8).view(runs, channels)
            pos += runs * channels
            if not bool(torch.isfinite(ascale).all()):
                raise CodecError("cachegen anchor scales that are not finite")
            anchors[i] = (aq.float() - _levels(ANCHOR_BINS)) * ascale
    want = sum(_sym_bytes(b, tokens * channels) for b, _ in settings)
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
    stream = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    at = 0
    for i, (b, _) in enumerate(settings):
        nb = _sym_bytes(b, tokens * channels)
        part = stream[at:at + nb]
        at += nb
        q = (_unpack(part, tokens * channels) if _packed(b) else part).to(device).view(tokens, channels)
        scale = scales[i].to(device)
        y = torch.addcmul(scale * -_levels(b), q.float(), scale)
        if i in anchors:
            y += anchors[i].to(device).repeat_interleave(ANCHOR_RUN, dim=0)[:tokens]
        sink(i, y)
