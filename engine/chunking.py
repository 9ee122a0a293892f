"""How a prompt's tokens map onto chunks and vLLM blocks, for every tier of the engine."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvferry.kernels.paged_copy import PagedKV


def chunk_plan(num_tokens: int, block_ids: Sequence[int], chunk_size: int, block_size: int
               ) -> list[tuple[list[int], int]]:
    """(block ids, tokens) of each chunk covering the first `num_tokens` tokens."""
    need = -(-num_tokens // block_size)
    if len(block_ids) < need:
        raise ValueError(f"{num_tokens} tokens need {need} blocks, the request has {len(block_ids)}")
    plan = []
    for start in range(0, num_tokens, chunk_size):
        n = min(chunk_size, num_tokens - start)
        b0 = start // block_size
        plan.append((list(block_ids[b0:b0 + -(-n // block_size)]), n))
    return plan


def chunk_tokens(num_tokens: int, chunk_size: int) -> list[int]:
    """Tokens in each chunk of a `num_tokens`-token prompt (the last may be partial)."""
    return [min(chunk_size, num_tokens - s) for s in range(0, num_tokens, chunk_size)]


def loaded_blocks(block_ids: Sequence[int], skip_tokens: int, num_tokens: int, block_size: int) -> list[int]:
    """The blocks a load of tokens [skip_tokens, num_tokens) writes: vLLM recomputes them if it fails."""
    return list(block_ids[skip_tokens // block_size:-(-num_tokens // block_size)])


def scatter_chunks(kv: PagedKV, fmt: str, chunk_size: int, chunks: Sequence[torch.Tensor],
                   tokens: Sequence[int], first_chunk: int, block_ids: Sequence[int], skip_tokens: int,
                   num_tokens: int) -> int:
    """Write tokens [skip_tokens, num_tokens) of a request from its chunks into its blocks.

    `chunks[i]` holds `tokens[i]` tokens of chunk number `first_chunk + i`; `block_ids` are the
    request's blocks from token 0. Blocks before `skip_tokens` belong to vLLM's prefix cache and
    may be read by running requests; blocks past `num_tokens` may not be allocated: neither is
    written. Returns the bytes copied."""
    bs = kv.layout.block_size
    usable = list(block_ids[:-(-num_tokens // bs)])
    first_block = skip_tokens // bs
    per = chunk_size // bs
    ids, bufs, ntoks = [], [], []
    nbytes = 0
    for i, (buf, n) in enumerate(zip(chunks, tokens, strict=True)):
        c = first_chunk + i
        held = -(-n // bs)  # blocks in this chunk's data
        blocks = usable[c * per:c * per + held]
        first = max(0, first_block - c * per)
        if first >= len(blocks):
            continue
        if first == 0 and len(blocks) == held:
            ids.append(blocks)
            bufs.append(buf)
            ntoks.append(n)
            continue
        if fmt != "block":
            raise ValueError(f"chunk {c} is only partly loadable (prefix cache hit of {skip_tokens} tokens, or "
                             "a recomputed last token); with pd_chunk_format token it is recomputed")
        nbytes += kv.scatter_blocks(buf, blocks, first, chunk_blocks=held)
    if ids:
        nbytes += kv.copy_batch(ids, bufs, fmt, ntoks, to_chunk=False)
    return nbytes
