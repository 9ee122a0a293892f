"""The KV engine without vLLM (LMCache's standalone mode): for tests, CPU-only setups and custom integrations.

    python -m kvferry.launcher.standalone --config FILE [--device cpu] [--model_name NAME]
        [--kvcache_shape_spec '(2,2,256,4,16):float16:2'] [--num-tokens N]

builds the engine from a kvferry/LMCache config file (the offload tiers: ``local_cpu``,
``max_local_cpu_size``, ``local_disk``, ``max_local_disk_size``, ``chunk_size``,
``save_unfull_chunk``), stores random KV for N tokens, looks it up, retrieves it, checks every
byte, and prints one JSON line.

Python API (the same tiers, index and copies as the vLLM connector)::

    eng = StandaloneEngine(load_config(path="cfg.yaml"), parse_shape_spec("(2,4,4096,8,64):bfloat16:1"))
    eng.kv[layer][0, :n] = keys; eng.kv[layer][1, :n] = values    # [2, tokens, heads, head_size]
    eng.store(token_ids)             # chunks of eng.kv[:, :len(token_ids)] -> tiers
    hit = eng.lookup(token_ids)      # tokens of the longest cached prefix
    n = eng.retrieve(token_ids)      # that prefix's KV -> eng.kv[:, :n]
    eng.close()                      # waits (bounded) for disk writes

A shape spec ``(2, L, T, H, D):dtype:G`` is K/V, L layers, T tokens, H KV heads, head size D,
repeated for G groups (G x L layers in all); specs of the same shape may be joined with ``;``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from kvferry.common.config import ConfigError, KVFerryConfig, load_config
from kvferry.common.log import configure_logging, get_logger
from kvferry.engine.offload.copier import OffloadCopier
from kvferry.engine.offload.ops import layout_digest, offload_salt
from kvferry.engine.offload.planner import OffloadPlanner
from kvferry.kernels.layout import KVLayout
from kvferry.kernels.paged_copy import PagedKV

logger = get_logger(__name__)

_SPEC = re.compile(r"^\(\s*2\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)\s*:\s*(\w+)\s*(?::\s*(\d+))?$")
DEFAULT_SPEC = "(2,4,4096,8,64):bfloat16:1"


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


def parse_shape_spec(spec: str) -> KVShape:
    """`(2, L, T, H, D):dtype[:G]` (several joined by ';' must have the same shape)."""
    shapes = []
    for part in spec.split(";"):
        mt = _SPEC.match(part.strip())
        if not mt:
            raise ValueError(f"kvcache_shape_spec {part.strip()!r} is not '(2, layers, tokens, kv_heads, head_size)"
                             ":dtype[:groups]', e.g. '(2,2,256,4,16):float16:2'")
        layers, tokens, heads, head, dname, groups = mt.groups()
        dtype = getattr(torch, dname, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"kvcache_shape_spec: {dname!r} is not a torch dtype (e.g. float16, bfloat16, float32)")
        if min(int(layers), int(tokens), int(heads), int(head), int(groups or 1)) <= 0:
            raise ValueError(f"kvcache_shape_spec {part.strip()!r}: every size must be positive")
        shapes.append(KVShape(int(layers) * int(groups or 1), int(tokens), int(heads), int(head), dtype))
    first = shapes[0]
    if any((s.num_tokens, s.num_kv_heads, s.head_size, s.dtype) != (first.num_tokens, first.num_kv_heads,
                                                                   first.head_size, first.dtype) for s in shapes):
        raise ValueError("kvcache_shape_spec: groups of different shapes are not supported; give one shape")
    return KVShape(sum(s.num_layers for s in shapes), first.num_tokens, first.num_kv_heads, first.head_size,
                   first.dtype)


class StandaloneEngine:
    """The offload tiers around one in-memory KV cache of `shape`, one request at a time."""

    def __init__(self, cfg: KVFerryConfig, shape: KVShape, model_name: str = "standalone",
                 device: str = "cpu") -> None:
        cs = cfg.chunk_size
        self.shape, self.cfg = shape, cfg
        tokens = -(-shape.num_tokens // cs) * cs  # whole chunks
        # vLLM's flash (NHD) layout with one block per chunk: token t of layer l is kv[l][:, t].
        self._caches = [torch.zeros(2, tokens // cs, cs, shape.num_kv_heads, shape.head_size, dtype=shape.dtype,
                                    device=device) for _ in range(shape.num_layers)]
        self.kv = [c.view(2, tokens, shape.num_kv_heads, shape.head_size) for c in self._caches]
        layout = KVLayout("flash_nhd", tokens // cs, cs, shape.num_kv_heads, shape.head_size, shape.dtype)
        paged = PagedKV(self._caches, layout)
        dname = str(shape.dtype).removeprefix("torch.")
        salt = offload_salt(model_name, dname, shape.num_layers, shape.num_kv_heads, shape.head_size, cs, cs, 1)
        self.planner = OffloadPlanner(cfg, salt, cs, paged.chunk_nbytes("block", cs))
        if not self.planner.enabled:
            raise ConfigError("the standalone engine has no tier: set local_cpu: true (max_local_cpu_size > 0) "
                              "or local_disk with max_local_disk_size")
        digest = layout_digest(msgspec.msgpack.encode([model_name, dname, shape.num_layers, shape.num_kv_heads,
                                                       shape.head_size, cs, "flash_nhd"]))
        self.copier = OffloadCopier(cfg, paged, 0, digest)
        self._blocks = list(range(tokens // cs))
        self._ids = itertools.count()

    @property
    def capacity(self) -> int:
        """Tokens the engine's KV cache holds (a request may be at most this long)."""
        return self.kv[0].shape[1]

    def _check(self, tokens: Sequence[int]) -> None:
        if not 0 < len(tokens) <= self.capacity:
            raise ValueError(f"{len(tokens)} tokens: the engine's KV cache holds 1 to {self.capacity} "
                             "(raise the tokens in --kvcache_shape_spec)")

    def _sync(self) -> None:
        self.planner.forget(self.copier.take_lost())

    def lookup(self, tokens: Sequence[int]) -> int:
        """Tokens of the longest prefix of `tokens` whose KV a tier holds."""
        self._check(tokens)
        self._sync()
        look = self.planner.keys(tokens)
        return min(len(self.planner.index.prefix(look)) * self.cfg.chunk_size, len(tokens))

    def store(self, tokens: Sequence[int]) -> int:
        """Store the chunks of ``kv[:, :len(tokens)]`` that no tier has; returns the tokens copied."""
        self._check(tokens)
        self._sync()
        rid = f"standalone-{next(self._ids)}"
        before = self.copier.counters.offloaded_tokens
        self.planner.store(rid, tokens, self._blocks)
        _, saves = self.planner.take()
        self.copier.save(saves)
        self.planner.finished(rid)
        return self.copier.counters.offloaded_tokens - before

    def retrieve(self, tokens: Sequence[int]) -> int:
        """Load the longest cached prefix of `tokens` into ``kv[:, :n]``; returns n (0 on a miss)."""
        self._check(tokens)
        self._sync()
        rid = f"standalone-{next(self._ids)}"
        n = self.planner.match(rid, tokens, 0, leave_one=False)
        if n:
            self.planner.after_alloc(rid, tokens, self._blocks, n)
        loads, saves = self.planner.take()
        failed = any(self.copier.load(op) for op in loads)
        self.copier.save(saves)
        self.planner.finished(rid)
        self._sync()
        return 0 if failed else n

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait (bounded) until every disk write is on disk."""
        return self.copier.disk.flush(timeout) if self.copier.disk is not None else True

    def stats(self) -> dict[str, float]:
        return {**self.planner.stats(), **self.copier.stats()}

    def close(self) -> None:
        self.copier.close()


def _self_check(eng: StandaloneEngine, num_tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 30000, (num_tokens,), generator=gen).tolist()
    want = []
    for t in eng.kv:
        src = torch.randn(t[:, :num_tokens].shape, generator=gen).to(t.dtype)
        t[:, :num_tokens] = src
        want.append(src)
    t0 = time.perf_counter()
    stored = eng.store(tokens)
    t1 = time.perf_counter()
    for t in eng.kv:
        t.zero_()
    hit = eng.lookup(tokens)
    t2 = time.perf_counter()
    got = eng.retrieve(tokens)
    t3 = time.perf_counter()
    ok = got == num_tokens and all(torch.equal(t[:, :num_tokens], w) for t, w in zip(eng.kv, want, strict=True))
    nbytes = sum(w.numel() * w.element_size() for w in want)
    return {"ok": ok, "tokens": num_tokens, "stored_tokens": stored, "hit_tokens": hit, "retrieved_tokens": got,
            "bytes": nbytes, "store_ms": round((t1 - t0) * 1e3, 3), "retrieve_ms": round((t3 - t2) * 1e3, 3),
            "retrieve_gbps": round(nbytes / max(t3 - t2, 1e-9) / 1e9, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvferry.launcher.standalone",
                                 description="Run kvferry's KV engine without vLLM: store, look up and retrieve "
                                             "random KV through the configured tiers, check every byte.")
    ap.add_argument("--config", help="kvferry/LMCache YAML config (default: KVFERRY_CONFIG_FILE / "
                                     "LMCACHE_CONFIG_FILE / env / defaults)")
    ap.add_argument("--device", default="cpu", help="where the KV cache lives: cpu (default) or cuda[:N]")
    ap.add_argument("--model_name", "--model-name", default="standalone", help="part of every chunk key")
    ap.add_argument("--kvcache_shape_spec", "--kvcache-shape-spec", default=DEFAULT_SPEC,
                    help=f"(2, layers, tokens, kv_heads, head_size):dtype[:groups] (default {DEFAULT_SPEC})")
    ap.add_argument("--num-tokens", type=int, default=0, help="tokens in the self-check (default: the cache size)")
    ap.add_argument("--use_mla", action="store_true", help="accepted for LMCache compatibility; not supported")
    args = ap.parse_args(argv)
    configure_logging()
    if args.use_mla:
        ap.error("--use_mla: kvferry's standalone engine has no MLA layout yet")
    if args.device != "cpu" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here; use --device cpu")
    try:
        cfg = load_config(path=args.config)
        shape = parse_shape_spec(args.kvcache_shape_spec)
        eng = StandaloneEngine(cfg, shape, args.model_name, args.device)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        n = args.num_tokens or shape.num_tokens
        if not 0 < n <= eng.capacity:
            print(f"error: --num-tokens {n}: the KV cache holds 1 to {eng.capacity} tokens", file=sys.stderr)
            return 2
        report = _self_check(eng, n, seed=0)
        report["tiers"] = {t.name: {"chunks": len(t), "bytes": t.used, "capacity": t.capacity}
                           for t in eng.planner.index.tiers}
        print(json.dumps(report))
        return 0 if report["ok"] else 1
    finally:
        eng.close()


if __name__ == "__main__":
    sys.exit(main())
