"""How a chunk travels to and from a remote store (``remote_serde``).

A stored chunk is two parts: a small header and the payload. The header names the format that
wrote it, the KV dtype and the chunk's shape (layers, tokens, KV heads, head size), the raw and
stored payload lengths, an xxh3-64 checksum of the raw bytes, the writer's 16-byte layout digest
and, with the cluster secret, a 16-byte keyed MAC (common/wire/chunk_mac.py) over the store key, the
rest of the header and the stored payload. A reader with another model, dtype or memory layout,
a damaged, truncated, oversize or forged value, or another key's value, gets a miss and never
reads wrong KV.

- ``naive``: the payload is the raw chunk bytes (no copy on the way out: the backends send the
  header and the tensor's memory as separate buffers).
- ``zstd``: the payload is zstd-compressed (level 1); smaller values for slow links, at the cost
  of CPU time on both ends.
- ``cachegen``: lossy (engine/remote/cachegen.py): the chunk's real tokens' K and V quantized per
  channel with per-layer bit widths, entropy coded; about 4x smaller than ``naive``. The padding
  of a partly filled last block (slots vLLM never reads) is coded as zeros; the checksum covers
  the stored payload, as the decoded bytes differ from the written ones by design.

A reader decodes either format whatever its own ``remote_serde`` (which only picks how it writes),
so a cluster with mixed settings shares its chunks. Every length is checked against the chunk
size the reader expects before anything is allocated or decompressed.

The MAC: a reader with the cluster secret refuses a value without a tag or with a wrong one
(:class:`ForgedError`); a reader without one ignores tags and relies on the checksum, so a
cluster part-way through turning the secret on keeps working (its secret-less readers cannot
tell a forged value from a good one: that is what the secret buys).
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvferry.common.config import SERDES, ConfigError
from kvferry.common.errors import BadDataError
from kvferry.common.wire.chunk_mac import TAG_BYTES, ChunkMAC
from kvferry.engine.remote import cachegen
from kvferry.kernels.layout import KVLayout

MAGIC = b"KVFR"
VERSION = 2  # 1: no MAC field (refused as "an older kvferry", a miss)
# The header's format number of each serde in config.SERDES; numbers are on the wire, never reused.
FORMATS = {"naive": 0, "zstd": 1, "cachegen": 2}
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
           torch.int8]
# magic, version, format, dtype, flags, shape[4], raw, stored, xxh3, layout, MAC tag (last: it covers the rest)
_HEADER = struct.Struct(f"<4sBBBB4IQQQ16s{TAG_BYTES}s")
HEADER_BYTES = _HEADER.size
_TAGGED = 1  # flags: the tag field holds a MAC (else zeros)
_NO_TAG = bytes(TAG_BYTES)


class SerdeError(BadDataError, ValueError):
    """A stored value that cannot be this reader's chunk (damaged, foreign or truncated)."""


class ForgedError(SerdeError):
    """A value whose MAC is missing or wrong: forged, written without the secret, or another key's."""


@dataclass(frozen=True)
class ChunkShape:
    """What every chunk of one worker looks like, apart from its token count."""

    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_size: int
    layout_digest: bytes
    layout: str = ""  # the KV layout's name and block size: cachegen reads K and V out of the chunk's blocks
    block_size: int = 0
    isa: str = ""  # vLLM CPU's attention kernel family ("cpu" layout): it orders K within a block

    def chunk_kv(self, chunk: torch.Tensor, tokens: int) -> list[torch.Tensor]:
        """A flat uint8 "block" chunk of `tokens` tokens as views of every layer's K and V (or MLA
        latent), one per plane: [layers, blocks, block_size, kv_heads, head_size]."""
        if not self.layout or self.block_size <= 0:
            raise ValueError("this chunk shape has no layout: cachegen needs the layout and block size")
        nblk = -(-tokens // self.block_size)
        lay = KVLayout(self.layout, nblk, self.block_size, self.num_kv_heads, self.head_size, self.dtype)
        return lay.chunk_kv(chunk, self.num_layers, self.isa)


def check_name(name: str) -> None:
    """Refuse a `remote_serde` kvferry cannot write, naming the ones it can."""
    if name not in SERDES:
        raise ConfigError(f"remote_serde {name!r} is not available in kvferry: use naive (raw bytes), zstd "
                         "(compressed) or cachegen (quantized, lossy)")


def max_stored(nbytes: int) -> int:
    """The most payload bytes any format stores for an `nbytes` chunk (zstd's worst case,
    ZSTD_compressBound, is below this), so larger values are refused unread."""
    return nbytes + (nbytes >> 7) + 1024


def peek(head: bytes | memoryview) -> tuple[str, torch.dtype, tuple[int, int, int, int]]:
    """The format, dtype and shape (layers, tokens, KV heads, head size) a stored value's header
    claims, unchecked: for tools that look at a store (the benchmarks), never for loading KV."""
    if len(head) != HEADER_BYTES:
        raise SerdeError(f"header of {len(head)} bytes, expected {HEADER_BYTES}")
    magic, _version, fmt, dtype, _flags, *rest = _HEADER.unpack(bytes(head))
    names = {v: k for k, v in FORMATS.items()}
    if magic != MAGIC or fmt not in names or dtype >= len(_DTYPES):
        raise SerdeError("not a kvferry chunk header")
    return names[fmt], _DTYPES[dtype], (rest[0], rest[1], rest[2], rest[3])


class Serde:
    """Encodes this worker's chunks in its `remote_serde`; decodes chunks of any format."""

    def __init__(self, name: str, shape: ChunkShape, bins: cachegen.Bins | None = None) -> None:
        check_name(name)
        self.name, self.fmt, self.shape = name, FORMATS[name], shape
        self._dtype = _DTYPES.index(shape.dtype) if shape.dtype in _DTYPES else 255
        self._cctx: Any = None  # zstandard's, made only for the zstd format
        self._dctx: Any = None
        if name == "zstd":
            import zstandard

            self._cctx = zstandard.ZstdCompressor(level=1)
        self._kinds = 1 if shape.layout == "mla" else 2
        self.bins = bins
        if name == "cachegen":
            if shape.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise ConfigError(f"remote_serde cachegen codes 16- and 32-bit float KV; this cache is {shape.dtype}: "
                                  "use naive or zstd")
            if shape.layout == "cpu" and shape.isa == "amx":
                raise ConfigError("remote_serde cachegen cannot read vLLM CPU's AMX-packed KV blocks (16-token tiles): "
                                  "use naive or zstd on this machine")
            self.bins = bins or cachegen.Bins.for_model(shape.num_layers, self._kinds)

    def encode(self, data: torch.Tensor, tokens: int, mac: ChunkMAC | None = None,
               key: bytes = b"") -> tuple[bytes, memoryview | bytes]:
        """(header, payload) for a flat uint8 chunk holding `tokens` tokens; with `mac`, tagged
        for the store key `key`."""
        raw = data.numpy().data.cast("B")
        if self.fmt == FORMATS["cachegen"]:
            assert self.bins is not None
            payload: memoryview | bytes = cachegen.encode(self.shape.chunk_kv(data, tokens), tokens, self.bins)
            checked: memoryview | bytes = payload
        else:
            payload = raw if self.fmt == 0 else self._cctx.compress(raw)
            checked = raw
        s = self.shape
        fields = (MAGIC, VERSION, self.fmt, self._dtype, _TAGGED if mac else 0, s.num_layers, tokens, s.num_kv_heads,
                  s.head_size, len(raw), len(payload), xxhash.xxh3_64_intdigest(checked), s.layout_digest)
        head = _HEADER.pack(*fields, _NO_TAG)
        if mac is not None:
            head = head[:-TAG_BYTES] + mac.tag(key, head[:-TAG_BYTES], payload)
        return head, payload

    def decode(self, head: bytes | memoryview, payload: bytes | memoryview, tokens: int, nbytes: int,
               mac: ChunkMAC | None = None, key: bytes = b"") -> torch.Tensor:
        """The raw chunk (`nbytes` bytes of `tokens` tokens) or SerdeError; with `mac`, only a
        value tagged for the store key `key` (else ForgedError)."""
        if len(head) != HEADER_BYTES:
            raise SerdeError(f"header of {len(head)} bytes, expected {HEADER_BYTES}")
        head = bytes(head)
        magic, version, fmt, dtype, flags, *rest = _HEADER.unpack(head)
        shape, (raw_len, stored_len, checksum, digest, tag) = tuple(rest[:4]), rest[4:]
        s = self.shape
        if magic != MAGIC:
            raise SerdeError(f"not a kvferry chunk (magic {magic!r})")
        if version != VERSION:
            raise SerdeError(f"written by {'an older' if version < VERSION else 'a newer'} kvferry (chunk format "
                             f"v{version}, this reader v{VERSION})")
        if fmt not in FORMATS.values():
            raise SerdeError(f"unknown remote_serde format #{fmt}")
        want = (s.num_layers, tokens, s.num_kv_heads, s.head_size)
        if dtype != self._dtype or shape != want:
            raise SerdeError(f"shape {shape} dtype #{dtype}, expected {want} dtype #{self._dtype}")
        if digest != s.layout_digest:
            raise SerdeError("written by a worker with another KV layout")
        stored = len(payload) if isinstance(payload, bytes) else memoryview(payload).nbytes
        if raw_len != nbytes or stored != stored_len or stored_len > max_stored(nbytes) or \
                (fmt == FORMATS["naive"] and stored_len != nbytes):
            raise SerdeError(f"{stored} of {stored_len} stored bytes, {raw_len} raw bytes (expected {nbytes})")
        if mac is not None:
            if not flags & _TAGGED:
                raise ForgedError("no MAC: written without the cluster secret (or by a forger)")
            if not mac.check(tag, key, head[:-TAG_BYTES], payload):
                raise ForgedError("MAC mismatch: forged, damaged, or another key's value")
        if fmt == FORMATS["cachegen"]:
            if mac is None and xxhash.xxh3_64_intdigest(payload) != checksum:
                raise SerdeError("checksum mismatch")
            return self._decode_cachegen(payload, tokens, nbytes)
        if fmt == FORMATS["zstd"]:
            payload = self._decompress(payload, nbytes)
        # A good MAC already vouches for these bytes (decompression is deterministic).
        if mac is None and xxhash.xxh3_64_intdigest(payload) != checksum:
            raise SerdeError("checksum mismatch")
        with warnings.catch_warnings():  # read-only bytes from the client: only ever read from
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(payload, dtype=torch.uint8)

    def _decode_cachegen(self, payload: bytes | memoryview, tokens: int, nbytes: int) -> torch.Tensor:
        """The chunk rebuilt from a cachegen payload (a block's padding past `tokens` as coded)."""
        s = self.shape
        if not s.layout:
            raise SerdeError("a cachegen value, and this reader has no KV layout to decode it into")
        out = torch.empty(nbytes, dtype=torch.uint8)  # every byte is written, or the chunk is refused
        try:
            cachegen.decode(payload, tokens, s.chunk_kv(out, tokens))
        except cachegen.CodecError as e:
            raise SerdeError(str(e)) from None
        return out

    def _decompress(self, payload: bytes | memoryview, nbytes: int) -> bytes:
        """`nbytes` bytes out of a zstd frame, never allocating more (a frame's own content size
        would otherwise size the output: a bomb of a few KiB could ask for GiBs)."""
        try:
            import zstandard
        except ImportError:
            raise SerdeError("a zstd value, and the zstandard package is not installed: pip install "
                             "zstandard") from None
        if self._dctx is None:
            self._dctx = zstandard.ZstdDecompressor()
        try:
            size = zstandard.frame_content_size(payload)
            if size not in (nbytes, -1):
                raise SerdeError(f"zstd frame of {size} bytes, expected {nbytes}")
            out = self._dctx.decompress(payload, max_output_size=nbytes)
        except zstandard.ZstdError as e:
            raise SerdeError(f"zstd: {e}") from None
        if len(out) != nbytes:
            raise SerdeError(f"decompressed to {len(out)} bytes, expected {nbytes}")
        return out
