"""A request's KV identity beyond its token ids, read from vLLM's scheduler-side Request: what
keys its chunks in every offload tier and for P2P (engine/offload/ops.py ``PromptIdentity``).

vLLM's own prefix cache keys a block by its tokens and by the *extra keys* of
``generate_block_hash_extra_keys`` (vllm/v1/core/kv_cache_utils.py): the LoRA adapter, each
multimodal input at its offset, ``cache_salt`` (first block), and a digest of the prompt
embeddings in the block. kvferry asks that same function for each chunk's range, so whatever
vLLM counts as identity kvferry counts too, and maps each tagged key to a form that is the same
in every process and on every machine:

- ``("lora", name, path)``: a SHA-256 of the adapter's files (names and contents of the regular
  files in its folder), not the name or the path: a path differs between machines, and a name
  re-pointed at other weights must not find the old KV. Hashed once per adapter version (the
  files' sizes and mtimes), on the first request that uses it;
- ``("mm", identifier, offset)``: vLLM's content hash of the input and its offset in the chunk;
- ``("cache_salt", salt)``: the salt itself (only the first chunk carries it; the chain carries it on);
- ``("prompt_embeds", digest)``: vLLM's SHA-256 of the chunk's embeddings.

A key with another tag (a newer vLLM's input kvferry does not know), an adapter whose folder
cannot be read, or an entry of an unexpected shape makes the request *unkeyable*: it is neither
looked up nor stored (counted in ``kvferry:cache_unkeyable_requests_total``, logged once per
reason). vLLM's ``request.block_hashes`` are not used as keys: their algorithm and seed are
per-deployment settings (``--prefix-caching-hash-algo``; a random seed per process for the xxhash
choices unless ``PYTHONHASHSEED`` is set), they cover full blocks only, and they fold in the
adapter's local path; docs/offload.md "What a key covers" says more.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

from kvferry.common.errors import BadDataError
from kvferry.common.hashing import extra_digest
from kvferry.common.log import get_logger
from kvferry.engine.api import PLAIN, PromptIdentity

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = get_logger(__name__)

ADAPTERS_KEPT = 256  # adapter versions whose digest is remembered
MAX_ADAPTER_FILES = 64  # a LoRA folder holds a config and a weights file or two
READ_BYTES = 1 << 20


class Unkeyable(BadDataError, ValueError):
    """A request input kvferry cannot key; the message says which and why."""


def _adapter_signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of each regular file in the adapter's folder, sorted."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as err:
        raise Unkeyable(f"LoRA adapter folder {folder} cannot be read ({err.strerror or err})") from None
    out = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=True)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((entry.name, st.st_size, st.st_mtime_ns))
    if not out:
        raise Unkeyable(f"LoRA adapter folder {folder} holds no files")
    if len(out) > MAX_ADAPTER_FILES:
        raise Unkeyable(f"LoRA adapter folder {folder} holds {len(out)} files (at most {MAX_ADAPTER_FILES} are hashed)")
    return tuple(out)


def _adapter_digest(folder: Path, sig: tuple[tuple[str, int, int], ...]) -> bytes:
    h = hashlib.sha256(b"kvferry-lora-1")
    for name, size, _ in sig:
        h.update(len(name).to_bytes(4, "little") + name.encode() + size.to_bytes(8, "little"))
        try:
            with open(folder / name, "rb") as f:
                while block := f.read(READ_BYTES):
                    h.update(block)
        except OSError as e:
            raise Unkeyable(f"LoRA adapter file {folder / name} cannot be read ({e.strerror or e})") from None
    return h.digest()


def portable(key: Any, lora_digest: Callable[[str], bytes]) -> list[Any]:
    """One of vLLM's tagged extra keys in the form kvferry hashes; raises Unkeyable for a form it
    does not know. `lora_digest` maps an adapter's path to the digest of its files."""
    if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
        raise Unkeyable(f"vLLM gave an extra key of a form kvferry does not know ({type(key).__name__})")
    tag = key[0]
    if tag == "lora" and len(key) == 3 and isinstance(key[2], str):
        return ["lora", lora_digest(key[2])]
    if tag == "mm" and len(key) == 3 and isinstance(key[1], str) and isinstance(key[2], int):
        return ["mm", key[1], key[2]]
    if tag == "cache_salt" and len(key) == 2 and isinstance(key[1], str):
        return ["cache_salt", key[1]]
    if tag == "prompt_embeds" and len(key) == 2 and isinstance(key[1], bytes):
        return ["prompt_embeds", key[1]]
    raise Unkeyable(f"vLLM keys its cache by an input kvferry does not know ({tag!r}, {len(key)} fields)")


class IdentityReader:
    """Per-chunk extras of a request (see the module docstring); adapter digests are cached."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._adapters: OrderedDict[tuple[str, tuple[tuple[str, int, int], ...]], bytes] = OrderedDict()
        self._told: set[str] = set()

    def read(self, request: Request) -> PromptIdentity:
        """The request's identity (PLAIN for tokens alone); raises Unkeyable."""
        n = request.num_prompt_tokens
        extras: list[bytes | None] = []
        events: list[tuple[Any, ...] | None] = []
        adapters: dict[str, bytes] = {}  # this request's: its folder is read once, not once per chunk

        def lora_digest(path: str) -> bytes:
            got = adapters.get(path)
            if got is None:
                got = adapters[path] = self._lora(path)
            return got
        for start in range(0, n, self.chunk_size):
            keys, _ = generate_block_hash_extra_keys(request, start, min(n, start + self.chunk_size), 0)
            if not keys:
                extras.append(None)
                events.append(None)
                continue
            extras.append(extra_digest(msgspec.msgpack.encode([portable(k, lora_digest) for k in keys])))
            untagged = to_event_extra_keys([keys])
            events.append(untagged[0] if untagged else None)
        if all(x is None for x in extras):
            return PLAIN
        lora = request.lora_request
        return PromptIdentity(tuple(extras), lora.lora_name if lora is not None else None, tuple(events))

    def tell_once(self, request_id: str, why: str) -> None:
        """Log an unkeyable request, once per distinct reason."""
        if why in self._told or len(self._told) > 1024:
            return
        self._told.add(why)
        logger.warning("request %s is neither looked up nor stored in the offload tiers: %s (logged once per "
                       "reason; kvferry:cache_unkeyable_requests_total counts them)", request_id, why)

    def _lora(self, path: str) -> bytes:
        folder = Path(path)
        if not folder.is_dir():
            raise Unkeyable(f"LoRA adapter path {path!r} is not a folder on this machine (kvferry keys an adapter by "
                            "its files)")
        sig = _adapter_signature(folder)
        got = self._adapters.get((path, sig))
        if got is None:
            got = self._adapters[(path, sig)] = _adapter_digest(folder, sig)
            if len(self._adapters) > ADAPTERS_KEPT:
                self._adapters.popitem(last=False)
        else:
            self._adapters.move_to_end((path, sig))
        return got
