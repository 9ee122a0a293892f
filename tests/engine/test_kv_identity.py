"""KV identity beyond token ids, from vLLM's Request to the offload keys and the proxy's index:
the LoRA adapter (by its files), cache_salt, multimodal inputs at their offsets and prompt
embeddings each change the keys of the chunks they touch and every chunk after them; a request
with none of them keys exactly as before; a form kvferry does not know is refused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvferry.common.config import load_config
from kvferry.common.hashing import EXTRA_BYTES, chunk_keys, extra_digest
from kvferry.connector.request_identity import IdentityReader, Unkeyable, portable
from kvferry.connector.vllm_kv_events import to_vllm
from kvferry.engine.api import PLAIN, OffloadPlanner
from kvferry.proxy.routing.cache import PromptKeys
from kvferry.proxy.routing.identity import prompt_root
from kvferry.proxy.routing.kv_event_subscription import KVEventSubscription
from kvferry.proxy.routing.prefix_index import GPU, PrefixIndex, identity_root, prefix_keys

CHUNK = 256
TOKENS = list(range(100, 100 + 3 * CHUNK + 40))  # three full chunks and a partial one


def request(rid: str = "r", tokens: list[int] | None = TOKENS, **kw: object) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, **kw)  # type: ignore[arg-type]


def keys_of(req: Request, reader: IdentityReader | None = None) -> list[bytes]:
    identity = (reader or IdentityReader(CHUNK)).read(req)
    n = req.num_prompt_tokens
    tokens = req.prompt_token_ids if req.prompt_token_ids is not None else [0] * n
    return chunk_keys(tokens, CHUNK, b"salt", extras=identity.extras)


def adapter(folder: Path, weights: bytes = b"weights") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_identity_a_plain_request_keys_as_before() -> None:
    assert IdentityReader(CHUNK).read(request()) is PLAIN
    assert keys_of(request()) == chunk_keys(TOKENS, CHUNK, b"salt")


def test_identity_extras_change_their_chunk_and_every_chunk_after_it() -> None:
    plain = chunk_keys(TOKENS, CHUNK, b"s")
    x = extra_digest(b"x")
    assert len(x) == EXTRA_BYTES
    mixed = chunk_keys(TOKENS, CHUNK, b"s", extras=[None, x])
    assert mixed[0] == plain[0]
    assert all(a != b for a, b in zip(mixed[1:], plain[1:], strict=True))
    assert chunk_keys(TOKENS, CHUNK, b"s", extras=[None, extra_digest(b"y")])[1:] != mixed[1:]
    with pytest.raises(ValueError, match="32-byte digest"):
        chunk_keys(TOKENS, CHUNK, b"s", extras=[b"short"])


def test_isolation_cache_salt_keys_every_chunk_apart_and_only_the_first_carries_it() -> None:
    reader = IdentityReader(CHUNK)
    a, b = request(cache_salt="tenant-a"), request(cache_salt="tenant-b")
    ka, kb = keys_of(a, reader), keys_of(b, reader)
    plain = keys_of(request(), reader)
    assert all(x != y for x, y in zip(ka, kb, strict=True))
    assert all(x != y for x, y in zip(ka, plain, strict=True))
    assert keys_of(request("again", cache_salt="tenant-a"), reader) == ka
    ident = reader.read(a)
    assert ident.extras[0] is not None and all(e is None for e in ident.extras[1:])
    assert ident.event_keys[0] == ("tenant-a",)


def test_identity_a_lora_adapter_is_keyed_by_its_files_not_its_name_or_path(tmp_path: Path) -> None:
    reader = IdentityReader(CHUNK)
    one = adapter(tmp_path / "one")
    two = shutil.copytree(one, tmp_path / "elsewhere")  # the same adapter on another path (another machine)
    k1 = keys_of(request(lora_request=LoRARequest("sql", 1, str(one))), reader)
    k2 = keys_of(request(lora_request=LoRARequest("also-sql", 7, str(two))), reader)
    base = keys_of(request(), reader)
    assert k1 == k2
    assert all(x != y for x, y in zip(k1, base, strict=True))
    ident = reader.read(request(lora_request=LoRARequest("sql", 1, str(one))))
    assert ident.lora_name == "sql" and all(e is not None for e in ident.extras)
    # The name re-pointed at other weights (files rewritten in place) never finds the old KV.
    (one / "adapter_model.safetensors").write_bytes(b"other weights")
    st = (one / "adapter_model.safetensors").stat()
    os.utime(one / "adapter_model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert keys_of(request(lora_request=LoRARequest("sql", 1, str(one))), reader) != k1


def test_identity_an_adapter_that_cannot_be_read_or_an_unknown_key_is_unkeyable(tmp_path: Path) -> None:
    reader = IdentityReader(CHUNK)
    with pytest.raises(Unkeyable, match="not a folder on this machine"):
        reader.read(request(lora_request=LoRARequest("hub", 1, "org/some-adapter")))
    with pytest.raises(Unkeyable, match="holds no files"):
        reader.read(request(lora_request=LoRARequest("empty", 1, str(tmp_path))))
    with pytest.raises(Unkeyable, match="does not know"):
        portable(("speaker_embedding", b"x"), lambda p: b"")
    with pytest.raises(Unkeyable, match="does not know"):
        portable("bare-string", lambda p: b"")


def mm(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_identity_multimodal_inputs_key_the_chunks_they_fall_in_by_content_and_offset() -> None:
    reader = IdentityReader(CHUNK)
    at_300 = keys_of(request(mm_features=[mm("img-a", 300, 100)]), reader)
    other = keys_of(request(mm_features=[mm("img-b", 300, 100)]), reader)
    moved = keys_of(request(mm_features=[mm("img-a", 310, 100)]), reader)
    plain = keys_of(request(), reader)
    # Chunk 0 (tokens 0-255) holds no image: the same key; from chunk 1 on, each differs.
    assert at_300[0] == other[0] == moved[0] == plain[0]
    for k in (other, moved, plain):
        assert all(x != y for x, y in zip(at_300[1:], k[1:], strict=True))
    # An image across a chunk boundary keys both chunks.
    ident = reader.read(request(mm_features=[mm("img-a", 500, 100)]))
    assert ident.extras[0] is None and ident.extras[1] is not None and ident.extras[2] is not None


def test_identity_prompt_embeds_key_each_chunk_by_its_embeddings() -> None:
    reader = IdentityReader(CHUNK)
    g = torch.Generator().manual_seed(0)
    e1 = torch.randn(len(TOKENS), 16, generator=g)
    e2 = e1.clone()
    e2[600] += 1.0  # chunk 2 differs
    k1 = keys_of(request(tokens=None, prompt_embeds=e1), reader)
    k2 = keys_of(request(tokens=None, prompt_embeds=e2), reader)
    assert k1 == keys_of(request("again", tokens=None, prompt_embeds=e1.clone()), reader)
    assert k1[:2] == k2[:2] and all(x != y for x, y in zip(k1[2:], k2[2:], strict=True))
    # Placeholders alone (vLLM's zeros) never match: a plain prompt of zeros keys otherwise.
    assert set(k1).isdisjoint(chunk_keys([0] * len(TOKENS), CHUNK, b"salt"))


def planner() -> OffloadPlanner:
    cfg = load_config({"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.01})
    return OffloadPlanner(cfg, b"salt", 16, 1024)


def test_isolation_the_planner_finds_a_prompt_only_under_the_identity_it_was_stored_with() -> None:
    reader = IdentityReader(CHUNK)
    salted = reader.read(request(cache_salt="tenant-a"))
    p = planner()
    p.store("a", TOKENS, list(range(60)), salted)
    assert p.match("same", TOKENS, 0, identity=reader.read(request(cache_salt="tenant-a"))) == len(TOKENS) - 1
    assert p.match("other-salt", TOKENS, 0, identity=reader.read(request(cache_salt="tenant-b"))) == 0
    assert p.match("no-salt", TOKENS, 0) == 0
    # And the other way: a prompt stored with no identity (keys of the old format) is not read for a salted one.
    q = planner()
    q.store("plain", TOKENS, list(range(60)))
    assert q.match("plain-again", TOKENS, 0) == len(TOKENS) - 1
    assert q.match("salted", TOKENS, 0, identity=salted) == 0
    q.unkeyable()
    assert q.stats()["unkeyable_requests"] == 1


def test_isolation_tier_events_carry_the_identity_the_proxy_predicts_with(tmp_path: Path) -> None:
    """The planner's tier events, through the connector's vLLM events and the proxy's decoder, index
    the chunks under the prompt's adapter and salt: only a request of the same identity predicts them."""
    reader = IdentityReader(CHUNK)
    lora = LoRARequest("sql", 1, str(adapter(tmp_path / "sql")))
    cfg = load_config({"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.01})
    p = OffloadPlanner(cfg, b"salt", 16, 1024, tier_events=True)
    p.store("a", TOKENS, list(range(60)), reader.read(request(lora_request=lora, cache_salt="t1")))
    p.store("b", TOKENS[:CHUNK + 1], list(range(60)),
            reader.read(request("b", tokens=TOKENS[:CHUNK + 1], mm_features=[mm("img", 0, 10)])))
    events = to_vllm(p.take_events(), CHUNK)
    from vllm.distributed.kv_events import EventBatch
    payload = msgspec.msgpack.encode(EventBatch(ts=0.0, events=events))
    index = PrefixIndex(1000)
    KVEventSubscription("d0", "ipc:///nowhere", None, index, 60.0).apply(0, payload)
    assert index.adapters == {"sql"}

    def held(body: dict) -> int:
        root = prompt_root(body, index.adapters)
        return 0 if root is None else index.cached_tokens(PromptKeys(TOKENS, root).of(index.block_size or 0))
    assert held({"model": "sql", "cache_salt": "t1"}) == 3 * CHUNK
    assert held({"model": "sql", "cache_salt": "t2"}) == 0
    assert held({"model": "sql"}) == 0
    assert held({"model": "tiny", "cache_salt": "t1"}) == 0  # the base model
    assert held({"model": "tiny"}) == 0  # the image prompt's chunk is indexed under no prediction
    assert prompt_root({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, set()) is None
    assert prompt_root({"prompt_embeds": "..."}, set()) is None


def test_isolation_vllm_block_events_of_an_adapter_and_a_salt_match_only_that_identity() -> None:
    bs = 16
    index = PrefixIndex(1000)
    n = 4
    hashes = list(range(1, n + 1))
    extra: list[list[object] | None] = [["sql", "tenant"]] + [["sql"]] * (n - 1)
    index.stored(None, hashes, TOKENS[:n * bs], bs, GPU, lora_name="sql", extra_keys=extra)
    root = identity_root("sql", "tenant")
    assert index.cached_tokens(prefix_keys(TOKENS, bs, n, root)) == n * bs
    assert index.cached_tokens(prefix_keys(TOKENS, bs, n)) == 0
    assert index.cached_tokens(prefix_keys(TOKENS, bs, n, identity_root("sql"))) == 0
    # A block with an input the proxy cannot hash (an embeddings digest): nothing from it on is predicted.
    index.stored(None, [9, 10], TOKENS[:2 * bs], bs, GPU, extra_keys=[None, [b"\x00" * 32]])
    assert index.cached_tokens(prefix_keys(TOKENS, bs, 2)) == bs
