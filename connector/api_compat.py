"""Does kvferry's connector fit a vLLM release's connector API? Checked from vLLM's Python source,
without importing it (no GPU, no CUDA torch): the installed vLLM, or a release's wheel file.

What is checked (docs/compatibility.md):

- every ``from vllm... import X`` in connector/ resolves in that release;
- each connector class that subclasses a vLLM class (KVFerryConnector on KVConnectorBase_V1, the
  metadata and stats classes) implements every abstract method, with a signature vLLM can call;
  every method it overrides still exists in vLLM with a compatible signature; every hook whose
  base default would be a lie for kvferry (:data:`MUST_OVERRIDE`) is overridden; every attribute
  it reads from the vLLM base (``self._x``, ``super().x``) exists there, and a private one only if
  :data:`PRIVATE_NAMES` lists it with the test that exercises it;
- every vLLM attribute the connector reads (:data:`FIELDS`: the scheduler output, requests,
  ``KVCacheConfig``, vLLM's config) exists, with the annotation the connector expects where the
  shape matters;
- the KV event types: the proxy's decoder (proxy/routing/kv_event_subscription.py) finds the fields, required-ness,
  tags and array layout it decodes, and the connector's encoder (connector/vllm_kv_events.py) passes
  every required field of ``BlockStored`` / ``BlockRemoved`` and no unknown one.

Run: ``python -m kvferry.connector.api_compat [--wheel PATH | --source DIR]`` (JSON out, exit 1 on a
problem); ``benchmarks/vllm_compat.py`` (``make vllm-compat``) runs it for every checked release.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.connector.vllm_source import (
    ClassInfo,
    DirTree,
    Index,
    SourceTree,
    WheelTree,
    call_problem,
    installed_tree,
    norm_annotation,
    own_classes,
    signature,
    signature_problem,
    tree_version,
)

__all__ = ["FIELDS", "MUST_OVERRIDE", "NEWER_HOOKS", "PRIVATE_NAMES", "DirTree", "Report", "WheelTree", "check",
           "connector_sources", "installed_tree", "main", "private_name_tests_exist", "tree_version"]

CONNECTOR_DIR = Path(__file__).resolve().parent
BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
EVENTS_MODULE = "vllm.distributed.kv_events"

# Hooks whose vLLM default is wrong for kvferry: inheriting one would silently claim something.
MUST_OVERRIDE = {
    "KVFerryConnector": {
        "supports_sleep_mode": "the base answers True: kvferry must say itself whether it follows sleep mode",
        "unregister_kv_caches": "the base does nothing: kvferry's NIXL registrations would outlive the memory",
        "restore_kv_caches": "the base does nothing: kvferry's NIXL registrations would not come back",
    },
}

# Private vLLM names the connector reads, each with the test that fails if its meaning changes.
_PD_1P1D = "tests/e2e/test_connector.py::test_1p1d_gives_the_same_tokens_and_logprobs_as_one_plain_instance"
PRIVATE_NAMES = {
    "_kv_transfer_config": "tests/e2e/test_connector.py::test_kv_that_never_arrives_is_recomputed_within_the_timeout",
    "_connector_metadata": _PD_1P1D,
    "_get_connector_metadata": _PD_1P1D,
    "_gauge_cls": "tests/transfer/test_pd_metrics.py::test_labelled_counters_and_gauges_reach_prometheus",
    "_counter_cls": "tests/transfer/test_pd_metrics.py::test_labelled_counters_and_gauges_reach_prometheus",
    "_histogram_cls": "tests/transfer/test_pd_metrics.py::test_histograms_get_each_observation_of_each_rank",
}

# Hooks kvferry implements that older releases in the range do not have yet (never called there).
NEWER_HOOKS = {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}


@dataclass(frozen=True)
class Field:
    """A vLLM attribute the connector reads; `annotation`, when given, must match (the shape)."""

    module: str
    cls: str
    attr: str
    annotation: str | None = None
    where: str = ""


FIELDS: list[Field] = [
    # connector/block_table.py and scheduler_side.py: the scheduler output, each step.
    Field("vllm.v1.core.sched.output", "SchedulerOutput", "scheduled_new_reqs", "list[NewRequestData]", "block_table"),
    Field("vllm.v1.core.sched.output", "SchedulerOutput", "scheduled_cached_reqs", "CachedRequestData", "block_table"),
    Field("vllm.v1.core.sched.output", "SchedulerOutput", "num_scheduled_tokens", "dict[str, int]", "scheduler_side"),
    Field("vllm.v1.core.sched.output", "SchedulerOutput", "total_num_scheduled_tokens", "int", "scheduler_side"),
    Field("vllm.v1.core.sched.output", "NewRequestData", "req_id", "str", "block_table"),
    Field("vllm.v1.core.sched.output", "NewRequestData", "block_ids", "tuple[list[int], ...]", "block_table"),
    Field("vllm.v1.core.sched.output", "CachedRequestData", "req_ids", "list[str]", "block_table"),
    Field("vllm.v1.core.sched.output", "CachedRequestData", "resumed_req_ids", "set[str]", "block_table"),
    Field("vllm.v1.core.sched.output", "CachedRequestData", "new_block_ids", "list[tuple[list[int], ...] | None]",
          "block_table"),
    # The request, as the scheduler side sees it.
    Field("vllm.v1.request", "Request", "request_id", None, "scheduler_side"),
    Field("vllm.v1.request", "Request", "prompt_token_ids", None, "scheduler_side"),
    Field("vllm.v1.request", "Request", "kv_transfer_params", "dict[str, Any] | None", "scheduler_side"),
    Field("vllm.v1.request", "Request", "num_prompt_tokens", None, "scheduler_side"),
    Field("vllm.v1.request", "Request", "num_computed_tokens", None, "scheduler_side"),
    Field("vllm.v1.request", "Request", "output_token_ids", None, "scheduler_side"),
    Field("vllm.v1.request", "Request", "lora_request", None, "request_identity"),
    Field("vllm.lora.request", "LoRARequest", "lora_name", "str", "request_identity"),
    Field("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", "get_block_ids", None, "scheduler_side"),
    # KVCacheConfig: the offload planner's sizes.
    Field("vllm.v1.kv_cache_interface", "KVCacheConfig", "kv_cache_groups", "list[KVCacheGroupSpec]",
          "scheduler_side.planner"),
    Field("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "layer_names", "list[str]", "scheduler_side.planner"),
    Field("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "kv_cache_spec", "KVCacheSpec", "scheduler_side.planner"),
    Field("vllm.v1.kv_cache_interface", "KVCacheSpec", "page_size_bytes", None, "scheduler_side.planner"),
    # vLLM's config.
    Field("vllm.config.vllm", "VllmConfig", "model_config", None, "roles, worker_side"),
    Field("vllm.config.vllm", "VllmConfig", "cache_config", None, "roles, worker_side"),
    Field("vllm.config.vllm", "VllmConfig", "parallel_config", None, "roles, worker_side"),
    Field("vllm.config.vllm", "VllmConfig", "kv_transfer_config", None, "roles"),
    Field("vllm.config.vllm", "VllmConfig", "kv_events_config", None, "scheduler_side.kv_events_enabled"),
    Field("vllm.config.kv_transfer", "KVTransferConfig", "kv_role", None, "roles"),
    Field("vllm.config.kv_transfer", "KVTransferConfig", "kv_connector_extra_config", "dict[str, Any]", "roles"),
    Field("vllm.config.kv_transfer", "KVTransferConfig", "engine_id", None, "worker_side (p2p notices)"),
    Field("vllm.config.kv_transfer", "KVTransferConfig", "kv_load_failure_policy", "Literal['recompute', 'fail']",
          "kvferry_connector"),
    Field("vllm.config.kv_events", "KVEventsConfig", "enable_kv_cache_events", "bool", "scheduler_side"),
    Field("vllm.config.model", "ModelConfig", "model", None, "roles.model_name"),
    Field("vllm.config.model", "ModelConfig", "dtype", None, "roles.salt"),
    Field("vllm.config.model", "ModelConfig", "get_num_kv_heads", None, "worker_side, roles.salt"),
    Field("vllm.config.model", "ModelConfig", "get_total_num_kv_heads", None, "worker_side (hetero TP)"),
    Field("vllm.config.model", "ModelConfig", "get_head_size", None, "worker_side, roles.salt"),
    Field("vllm.config.parallel", "ParallelConfig", "tensor_parallel_size", "int", "roles.salt"),
    Field("vllm.config.cache", "CacheConfig", "block_size", None, "worker_side, roles.salt"),
    # What the worker side returns and is handed back.
    Field(BASE_MODULE, "KVConnectorTransferResults", "finished_recving", "set[str]", "worker_side.results"),
    Field("vllm.v1.outputs", "KVConnectorOutput", "kv_connector_worker_meta", "KVConnectorWorkerMetadata | None",
          "kvferry_connector.update_connector_output"),
    Field(BASE_MODULE, "KVConnectorRole", "SCHEDULER", None, "kvferry_connector"),
    Field("vllm.v1.metrics.cache_hit_source", "CacheHitSource", "HOST", None, "scheduler_side"),
    Field("vllm.v1.metrics.cache_hit_source", "CacheHitSource", "DISK", None, "scheduler_side"),
    Field("vllm.v1.metrics.cache_hit_source", "CacheHitSource", "P2P", None, "scheduler_side"),
    Field("vllm.v1.metrics.cache_hit_source", "CacheHitSource", "EXTERNAL_UNSPECIFIED", None, "scheduler_side"),
    Field("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorStats", "data", None, "stats"),
]


# ---------------------------------------------------------------- kvferry's side


@dataclass
class Ours:
    """One kvferry class defined on top of a vLLM class."""

    name: str
    path: str
    node: ast.ClassDef
    base_module: str
    base_name: str


def _vllm_imports(tree: ast.Module) -> dict[str, tuple[str, str, int]]:
    """local name -> (vllm module, name, line) for every `from vllm... import` in a file."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm" and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name, node.lineno)
    return out


def connector_sources(root: Path = CONNECTOR_DIR) -> dict[str, ast.Module]:
    return {f"connector/{p.name}": ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(root.glob("*.py"))}


def _self_reads(cls: ast.ClassDef) -> tuple[set[str], set[str], dict[str, list[ast.Call]]]:
    """(self.x read, self.x assigned, super().x -> its calls) inside a class's methods."""
    reads: set[str] = set()
    assigned: set[str] = set()
    sup: dict[str, list[ast.Call]] = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (assigned if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id == "super":
            sup.setdefault(node.attr, [])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name) and \
                node.func.value.func.id == "super":
            sup.setdefault(node.func.attr, []).append(node)
    return reads, assigned, sup


def private_name_tests_exist(tests_dir: Path) -> list[str]:
    """PRIVATE_NAMES entries whose named test does not exist (each private name needs a real test)."""
    bad = []
    for name, ref in PRIVATE_NAMES.items():
        path, _, test = ref.partition("::")
        p = tests_dir.parent / path
        if not p.is_file() or not re.search(rf"^def {re.escape(test)}\(", p.read_text(encoding="utf-8"), re.M):
            bad.append(f"{name}: {ref}")
    return bad


# ---------------------------------------------------------------- the check


@dataclass
class Report:
    source: str
    vllm_version: str
    problems: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"source": self.source, "vllm_version": self.vllm_version, "ok": self.ok,
                "problems": self.problems, "checked": self.checked}


def check(tree: SourceTree, sources: dict[str, ast.Module] | None = None) -> Report:
    """Every check in the module docstring against one vLLM source tree."""
    idx = Index(tree)
    rep = Report(tree.label, tree_version(tree))
    if idx.module(BASE_MODULE) is None:
        rep.problems.append(f"{BASE_MODULE} is missing: not a vLLM with the V1 connector API")
        return rep
    sources = connector_sources() if sources is None else sources
    _check_imports(idx, sources, rep)
    _check_subclasses(idx, sources, rep)
    _check_fields(idx, rep)
    _check_events(idx, sources, rep)
    return rep


def _check_imports(idx: Index, sources: dict[str, ast.Module], rep: Report) -> None:
    n = 0
    for path, tree in sources.items():
        for local, (mod, name, line) in _vllm_imports(tree).items():
            n += 1
            if idx.module(mod) is None:
                rep.problems.append(f"{path}:{line} imports {name} from {mod}, a module this vLLM does not have")
            elif idx.resolve(mod, name) is None and idx.module(f"{mod}.{name}") is None:
                rep.problems.append(f"{path}:{line} imports {name} from {mod}, which this vLLM does not define there")
            del local
    rep.checked["imports"] = n


def _our_classes(sources: dict[str, ast.Module]) -> list[Ours]:
    out = []
    for path, tree in sources.items():
        imports = _vllm_imports(tree)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                for b in node.bases:
                    if isinstance(b, ast.Name) and b.id in imports:
                        mod, name, _ = imports[b.id]
                        out.append(Ours(node.name, path, node, mod, name))
    return out


def _check_subclasses(idx: Index, sources: dict[str, ast.Module], rep: Report) -> None:
    n = 0
    for ours in _our_classes(sources):
        base = idx.cls(ours.base_module, ours.base_name)
        if base is None:
            rep.problems.append(f"{ours.path}: {ours.name} subclasses {ours.base_name}, which this vLLM does not "
                                f"define in {ours.base_module}")
            continue
        own = own_classes(ours.path, ast.Module(body=[ours.node], type_ignores=[]))[ours.name].members
        label = f"{ours.name} ({ours.path})"
        for name, m in base.members.items():
            if m.abstract and name not in own:
                n += 1
                rep.problems.append(f"{label} does not implement {base.name}.{name}, abstract in this vLLM "
                                    f"({m.where}): {signature(m.node)}")
        for name, m in own.items():
            if m.kind in ("field", "attr", "self"):
                continue
            n += 1
            b = base.members.get(name)
            if b is None:
                if not name.startswith("_") and name not in NEWER_HOOKS:
                    rep.problems.append(f"{label} defines {name}(), which {base.name} no longer has in this vLLM: "
                                        "a hook renamed or removed (vLLM never calls it)")
                continue
            why = signature_problem(b, m)
            if why is not None:
                rep.problems.append(f"{label}.{name}: {why}; vLLM ({b.where}): {signature(b.node)}"
                                    + (f"; kvferry: {signature(m.node)}" if m.node is not None else ""))
        for name, why in MUST_OVERRIDE.get(ours.name, {}).items():
            if name in base.members and name not in own:
                rep.problems.append(f"{label} must override {base.name}.{name} ({base.members[name].where}): {why}")
        reads, assigned, sup = _self_reads(ours.node)
        for name in sorted((reads - assigned - set(own)) | set(sup)):
            n += 1
            if name not in base.members:
                rep.problems.append(f"{label} reads {name} from {base.name}, which this vLLM does not have")
            elif name in sup and base.members[name].kind in ("method", "classmethod"):
                for call in sup[name]:
                    why = call_problem(base.members[name], call)
                    if why is not None:
                        rep.problems.append(f"{label} calls super().{name}(...) at line {call.lineno}: {why}; "
                                            f"vLLM ({base.members[name].where}): {signature(base.members[name].node)}")
            elif name.startswith("_") and not name.startswith("__") and name not in PRIVATE_NAMES:
                rep.problems.append(f"{label} reads vLLM's private {base.name}.{name}: add it to "
                                    "api_compat.PRIVATE_NAMES with the test that exercises it")
    rep.checked["subclass_members"] = n


def _check_fields(idx: Index, rep: Report) -> None:
    for f in FIELDS:
        info = idx.cls(f.module, f.cls)
        if info is None:
            rep.problems.append(f"{f.module}.{f.cls} is missing in this vLLM (read by connector/{f.where})")
            continue
        m = info.members.get(f.attr)
        if m is None:
            rep.problems.append(f"{f.cls}.{f.attr} is missing in this vLLM ({f.module}; read by connector/{f.where})")
        elif f.annotation is not None and (m.annotation is None
                                           or norm_annotation(m.annotation) != norm_annotation(f.annotation)):
            rep.problems.append(f"{f.cls}.{f.attr} is {m.annotation!r} in this vLLM ({m.where}); connector/{f.where} "
                                f"expects {f.annotation!r}")
    rep.checked["fields"] = len(FIELDS)


def _calls_kwargs(tree: ast.Module, name: str) -> list[tuple[set[str], int]]:
    return [({k.arg for k in n.keywords if k.arg}, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def _flag(info: ClassInfo, key: str) -> bool:
    return info.keywords.get(key, "False") not in ("False", "None")


def _check_events(idx: Index, sources: dict[str, ast.Module], rep: Report) -> None:
    n = 0
    # The proxy's decoder (read as source: the connector does not import the proxy).
    dec_path = CONNECTOR_DIR.parent / "proxy" / "routing" / "kv_event_subscription.py"
    decoder = own_classes("proxy/routing/kv_event_subscription.py",
                          ast.parse(dec_path.read_text(encoding="utf-8"), str(dec_path)))
    for ours_name, theirs in (("BlockStored", "BlockStored"), ("BlockRemoved", "BlockRemoved"),
                              ("AllBlocksCleared", "AllBlocksCleared"), ("EventBatch", "KVEventBatch")):
        ours = decoder[ours_name]
        info = idx.cls(EVENTS_MODULE, theirs)
        if info is None:
            rep.problems.append(f"{EVENTS_MODULE}.{theirs} is missing "
                                "(decoded by proxy/routing/kv_event_subscription.py)")
            continue
        want_tag, want_array = _flag(ours, "tag"), _flag(ours, "array_like")
        tag, array = _flag(info, "tag"), _flag(info, "array_like")
        if tag != want_tag or array != want_array:
            rep.problems.append(f"{theirs} is encoded with tag={tag}, array_like={array} in this vLLM; proxy/routing/"
                                f"kv_event_subscription.py decodes tag={want_tag}, array_like={want_array}")
        order = info.field_order
        for i, name in enumerate(ours.field_order):
            n += 1
            m = info.members.get(name)
            if m is None or m.kind != "field":
                rep.problems.append(f"{theirs}.{name} is missing in this vLLM ({EVENTS_MODULE}; decoded by "
                                    "proxy/routing/kv_event_subscription.py)")
                continue
            if not ours.members[name].has_default and m.has_default:
                rep.problems.append(f"{theirs}.{name} has a default in this vLLM ({m.where}): with omit_defaults "
                                    "it may be left out, and proxy/routing/kv_event_subscription.py requires it")
            if want_array and (i >= len(order) or order[i] != name):
                rep.problems.append(f"{theirs} is an array: field {i} is {order[i] if i < len(order) else None!r} "
                                    f"in this vLLM, proxy/routing/kv_event_subscription.py reads {name!r} there")
    # The connector's encoder: BlockStored(...) / BlockRemoved(...) calls take every required field.
    enc = sources.get("connector/vllm_kv_events.py")
    for cls in ("BlockStored", "BlockRemoved"):
        info = idx.cls(EVENTS_MODULE, cls)
        if info is None or enc is None:
            continue
        fields = {k: m for k, m in info.members.items() if m.kind == "field"}
        for kwargs, line in _calls_kwargs(enc, cls):
            n += 1
            for k in sorted(kwargs - set(fields)):
                rep.problems.append(f"connector/vllm_kv_events.py:{line} passes {k}= to {cls}, which this vLLM "
                                    "does not have")
            for k in sorted(k for k, m in fields.items() if not m.has_default and k not in kwargs):
                rep.problems.append(f"connector/vllm_kv_events.py:{line} does not pass {cls}.{k}, required in "
                                    f"this vLLM ({fields[k].where})")
    rep.checked["event_fields"] = n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--wheel", type=Path, help="a vLLM wheel file (read from the zip, not installed)")
    g.add_argument("--source", type=Path, help="a directory holding a vllm/ package (e.g. a doctored copy)")
    args = ap.parse_args(argv)
    tree = WheelTree(args.wheel) if args.wheel else DirTree(args.source) if args.source else installed_tree()
    rep = check(tree)
    print(json.dumps(rep.as_dict(), indent=2))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
