"""Chunk keys are a stable hash chain, identical across processes whatever PYTHONHASHSEED is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvferry.common.hashing import KEY_BYTES, chunk_keys, token_bytes

TOKENS = list(range(1000, 1000 + 1100))
SCRIPT = (
    "import json,sys; from kvferry.common.hashing import chunk_keys; "
    "print(json.dumps([k.hex() for k in chunk_keys(list(range(1000, 2100)), 256, b'm')] + [str(hash('x'))]))"
)


def keys_in_subprocess(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         check=True, cwd="/")
    return json.loads(out.stdout)


def test_same_keys_with_different_pythonhashseed() -> None:
    a, b = keys_in_subprocess("0"), keys_in_subprocess("12345")
    assert a[-1] != b[-1], "the subprocesses really had different str hashes"
    assert a[:-1] == b[:-1] == [k.hex() for k in chunk_keys(TOKENS, 256, b"m")]


def test_chain_shape() -> None:
    keys = chunk_keys(TOKENS, 256)
    assert len(keys) == 5 and all(len(k) == KEY_BYTES for k in keys)  # 4 full + 1 partial (76)
    assert len(chunk_keys(TOKENS, 256, include_partial=False)) == 4
    assert len(set(keys)) == 5
    # A prefix has the same leading keys; a changed token changes its chunk and all after it.
    assert chunk_keys(TOKENS[:512], 256) == keys[:2]
    changed = TOKENS.copy()
    changed[600] += 1
    k2 = chunk_keys(changed, 256)
    assert k2[:2] == keys[:2] and all(x != y for x, y in zip(k2[2:], keys[2:], strict=True))
    # Same chunk content at a different position has a different key (it is a chain).
    rep = [7] * 512
    assert len(set(chunk_keys(rep, 256))) == 2


def test_salt_separates_models_and_partial_differs_from_full() -> None:
    assert chunk_keys(TOKENS, 256, b"model-a") != chunk_keys(TOKENS, 256, b"model-b")
    assert chunk_keys(TOKENS[:300], 256)[1] != chunk_keys(TOKENS[:301], 256)[1]


def test_token_bytes_little_endian_int32() -> None:
    assert token_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_offload_keys_of_another_tp_size_or_head_split_never_match() -> None:
    """A chunk a TP=2 instance stored (half the KV heads per rank) is keyed apart from a TP=1 one's:
    no tier or peer serves it across TP sizes, MLA included (docs/pd.md, the compatibility matrix)."""
    from kvferry.engine.offload.ops import offload_salt

    toks = list(range(512))
    shapes = {(8, 1), (4, 2), (1, 1), (1, 2)}  # (KV heads per rank, TP size): GQA TP=1/2, MLA TP=1/2
    keys = {s: chunk_keys(toks, 256, offload_salt("tiny", "bfloat16", 8, s[0], 64, 16, 256, s[1])) for s in shapes}
    assert len({k for ks in keys.values() for k in ks}) == 2 * len(shapes)
