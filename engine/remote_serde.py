"""How a chunk travels to and from a remote store (``remote_serde``).

A stored chunk is two parts: a small header and the payload. The header names the format, the
KV dtype and the chunk's shape (layers, tokens, KV heads, head size), the raw and stored payload
lengths, an xxh3-64 checksum of the raw bytes and the writer's 16-byte layout digest, so a reader
with another model, dtype or memory layout, or a damaged or truncated value, gets a miss and
never reads wrong KV.

- ``naive``: the payload is the raw chunk bytes (no copy on the way out: the backends send the
  header and the tensor's memory as separate buffers).
- ``zstd``: the payload is zstd-compressed (level 1); smaller values for slow links, at the cost
  of CPU time on both ends.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"KVFR"
VERSION = 1
FORMATS = {"naive": 0, "zstd": 1}
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
           torch.int8]
_HEADER = struct.Struct("<4sBBBB4IQQQ16s")  # magic, version, format, dtype, ndim, shape[4], raw, stored, xxh3, layout
HEADER_BYTES = _HEADER.size


class SerdeError(ValueError):
    """A stored value that cannot be this reader's chunk (damaged, foreign or truncated)."""


@dataclass(frozen=True)
class ChunkShape:
    """What every chunk of one worker looks like, apart from its token count."""

    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_size: int
    layout_digest: bytes


def check_name(name: str) -> None:
    if name not in FORMATS:
        raise ValueError(f"remote_serde {name!r} is not available in kvferry: use naive (raw bytes) or zstd "
                         "(compressed)")


class Serde:
    def __init__(self, name: str, shape: ChunkShape) -> None:
        check_name(name)
        self.name, self.fmt, self.shape = name, FORMATS[name], shape
        self._dtype = _DTYPES.index(shape.dtype) if shape.dtype in _DTYPES else 255
        if name == "zstd":
            import zstandard

            self._cctx, self._dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

    def encode(self, data: torch.Tensor, tokens: int) -> tuple[bytes, memoryview | bytes]:
        """(header, payload) for a flat uint8 chunk holding `tokens` tokens."""
        raw = memoryview(data.numpy()).cast("B")
        payload = raw if self.fmt == 0 else self._cctx.compress(raw)
        s = self.shape
        head = _HEADER.pack(MAGIC, VERSION, self.fmt, self._dtype, 4, s.num_layers, tokens, s.num_kv_heads,
                            s.head_size, len(raw), len(payload), xxhash.xxh3_64_intdigest(raw), s.layout_digest)
        return head, payload

    def decode(self, head: bytes | memoryview, payload: bytes | memoryview, tokens: int, nbytes: int) -> torch.Tensor:
        """The raw chunk (`nbytes` bytes of `tokens` tokens) or SerdeError."""
        if len(head) < HEADER_BYTES:
            raise SerdeError(f"header of {len(head)} bytes, expected {HEADER_BYTES}")
        magic, version, fmt, dtype, ndim, *rest = _HEADER.unpack(bytes(head[:HEADER_BYTES]))
        shape, (raw_len, stored_len, checksum, digest) = tuple(rest[:4]), rest[4:]
        s = self.shape
        if magic != MAGIC or version != VERSION:
            raise SerdeError(f"not a kvferry chunk (magic {magic!r}, version {version})")
        if fmt not in FORMATS.values():
            raise SerdeError(f"unknown format {fmt}")
        if dtype != self._dtype or ndim != 4 or shape != (s.num_layers, tokens, s.num_kv_heads, s.head_size):
            raise SerdeError(f"shape {shape} dtype #{dtype}, expected {(s.num_layers, tokens, s.num_kv_heads, s.head_size)}"
                             f" dtype #{self._dtype}")
        if digest != s.layout_digest:
            raise SerdeError("written by a worker with another KV layout")
        if raw_len != nbytes or len(payload) != stored_len:
            raise SerdeError(f"{len(payload)} of {stored_len} stored bytes, {raw_len} raw bytes (expected {nbytes})")
        if fmt == FORMATS["zstd"]:
            import zstandard

            try:
                payload = self._dctx.decompress(payload, max_output_size=raw_len)
            except zstandard.ZstdError as e:
                raise SerdeError(f"zstd: {e}") from None
            if len(payload) != raw_len:
                raise SerdeError(f"decompressed to {len(payload)} bytes, expected {raw_len}")
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise SerdeError("checksum mismatch")
        with warnings.catch_warnings():  # read-only bytes from the client: only ever read from
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(payload, dtype=torch.uint8)
