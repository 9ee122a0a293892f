"""What the PD path's two sides share: the layout fingerprint they must agree on, the chunk-key
salt, the pd_buffer's device and gauges."""

from __future__ import annotations

from kvferry.buffer.pd_buffer import PDBuffer
from kvferry.common.config import ConfigError, KVFerryConfig
from kvferry.common.errors import BadDataError
from kvferry.common.hashing import salt_for
from kvferry.common.wire import messages as m
from kvferry.kernels.layout import LayoutError
from kvferry.kernels.paged_copy import PagedKV

KV_LAYOUT_NAMES = {
    "cpu": "cpu:[blocks,kv_heads,block_size,2*head_size]",
    "flash_nhd": "flash_nhd:[2,blocks,block_size,kv_heads,head_size]",
    "flash_hnd": "flash_hnd:[2,blocks,kv_heads,block_size,head_size]",
    "mla": "mla:[blocks,block_size,kv_lora_rank+qk_rope_head_dim]",
}


def fingerprint(kv: PagedKV, model: str, chunk_size: int, chunk_format: str, tp_size: int = 1,
                total_kv_heads: int = 0, slices: bool = True, isa: str = "") -> m.LayoutFingerprint:
    """What a prefiller and a decoder must agree on, from the KV caches vLLM registered.
    `total_kv_heads`: the model's (vLLM's get_total_num_kv_heads); 0 means heads x TP size, which
    is wrong only for replicated heads (fewer than TP). `slices`: as a sender, this side writes
    each decoder rank only its heads, so a decoder of another TP size is accepted (docs/pd.md).
    `isa`: vLLM CPU attention's kernel family (connector/cpu_isa.py), which decides what a block
    holds: named in kv_layout, so two CPUs that pack blocks differently never exchange them."""
    lay = kv.layout
    if chunk_format == "block" and chunk_size % lay.block_size:
        raise LayoutError(f"chunk_size {chunk_size} is not a multiple of vLLM's block_size {lay.block_size}: "
                          f"set chunk_size to a multiple of {lay.block_size}, or pd_chunk_format: token")
    if chunk_format == "token" and kv.table("token") is None and kv.device.type != "cpu":
        raise LayoutError(f"pd_chunk_format: token is not supported for the {lay.name} layout on "
                          f"{kv.device}: use pd_chunk_format: block")
    return m.LayoutFingerprint(
        model=model, dtype=str(lay.dtype).removeprefix("torch."), num_layers=kv.num_layers,
        num_kv_heads=lay.num_kv_heads, head_size=lay.head_size, block_size=lay.block_size,
        kv_layout=KV_LAYOUT_NAMES[lay.name] + (f" isa={isa}" if isa else ""), chunk_format=chunk_format,
        chunk_size=chunk_size,
        tp_size=tp_size, page_bytes=kv.chunk_nbytes(chunk_format, chunk_size),
        kv_kind="mla" if lay.is_mla else "mha", slices=slices and not lay.is_mla,
        total_kv_heads=1 if lay.is_mla else total_kv_heads or lay.num_kv_heads * tp_size)


def key_salt(fp: m.LayoutFingerprint) -> bytes:
    """Keys of different models or layouts never match. A prefiller slicing heads for a decoder rank
    of another TP size salts with that rank's heads (slicing.as_decoder_rank), so the decoder's
    own keys match (and a same-TP cluster keeps the keys of earlier versions)."""
    return salt_for(fp.model, fp.dtype, fp.num_layers, fp.num_kv_heads, fp.head_size, fp.kv_layout,
                    fp.chunk_format, fp.chunk_size)  # kv_layout tells MLA from K/V caches


class StagingError(BadDataError, ValueError):
    """A prompt's blocks could not be gathered for sending (block ids that do not fit the KV cache)."""


def bump(d: dict[str, int], key: str) -> None:
    d[key] = d.get(key, 0) + 1


def buffer_gauges(buf: PDBuffer, rank: int) -> dict[str, float]:
    return {f"pd_buffer_free_pages|{rank}": buf.free_pages, f"pd_buffer_pages|{rank}": buf.num_pages}


def buffer_device(cfg: KVFerryConfig, kv: PagedKV) -> str:
    """The pd_buffer's device: the KV cache's, since the copy kernels read both; another is refused."""
    have = str(kv.device) if kv.device.type == "cuda" else "cpu"
    want = cfg.pd_buffer_device
    if want is not None and want != have and not (want == "cuda" and kv.device.type == "cuda"):
        raise ConfigError(f"pd_buffer_device is {want!r} but this worker's KV cache is on {have}: the pd_buffer "
                          f"must sit with the KV cache (its copies read both); set pd_buffer_device to "
                          f"{kv.device.type!r} or remove it")
    return have


