"""Finds where the library reaches past another library's public API (tests/test_layout.py runs it).

What counts as reaching past it, in a library file:
- a private module path (`import x._api`, `from x._api import y`) or a private name imported
  (`from x import _y`);
- a submodule of a third-party package that is not in REVIEWED_MODULES, the module paths whose
  owners document them (`prometheus_client.core` is documented; `prometheus_client.mmap_dict` is
  not, though its name has no underscore);
- `obj._name`, or getattr/hasattr/setattr with a literal "_name", where kvferry defines no `_name`
  itself (its own classes' privates are its own);
- a private keyword argument (`f(_loop=...)`), which only a private signature takes, also when it
  comes in a dict the call splats (`kw["_loop"] = ...; f(**kw)`, `f(**{"_loop": ...})`);
- a class of kvferry overriding a method of another library's class that is not one of that
  class's documented extension points (OVERRIDABLE), or any private method of it.

What a library offers only privately is in PRIVATE_ALLOWED, each with the reason and the version
checked; the guard skips exactly those uses and nothing like them.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Iterable

from kvferry.connector.api_compat import PRIVATE_NAMES

# Private names of the standard library whose owners document them.
DOCUMENTED_PRIVATE = {
    "_exit",  # os._exit: the documented way for a forked child to end
    "_replace", "_asdict", "_fields", "_make",  # namedtuple's documented methods
}

# Third-party module paths below the top package that their owners document (import from these).
REVIEWED_MODULES = {
    "prometheus_client.core", "prometheus_client.registry", "prometheus_client.parser",
    "prometheus_client.metrics_core",  # Metric: the documented base of the *MetricFamily classes
    "opentelemetry.sdk.resources", "opentelemetry.sdk.trace", "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk.trace.id_generator", "opentelemetry.sdk.trace.sampling",
    "opentelemetry.trace", "opentelemetry.trace.propagation.tracecontext",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.proto.collector.trace.v1", "opentelemetry.proto.common.v1.common_pb2",
    "fastapi.responses", "fastapi.exceptions", "starlette.exceptions", "jinja2.sandbox",
    "kubernetes.client.exceptions", "redis.backoff", "redis.retry", "redis.sentinel", "urllib3.exceptions",
    "packaging.specifiers", "packaging.version", "safetensors.torch", "mooncake.store",
    "zmq.asyncio", "zmq.utils", "zmq.utils.monitor", "triton.language",
}

# Uses of what a library offers only privately: (file, name) -> why, and the version it was checked at.
# vLLM's connector API (vllm.distributed.kv_transfer, vllm.v1.*) is its documented plugin interface
# for KV connectors, though it lives in modules vLLM does not call public; those paths are reviewed
# as a whole, and the private names of its base classes the connector reads are
# connector/api_compat.PRIVATE_NAMES, each with the test that fails if its meaning changes (the
# compatibility check runs it against every vLLM release in its range).
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {
    ("connector/cpu_isa.py", "_get_attn_isa"): (
        "vLLM 0.32.0 decides its CPU attention kernel (and so the bytes a KV block holds) in this one "
        "function and exports no public equivalent; the ImportError fallback keeps 0.32's rule"),
    ("controller/http.py", "capture_signals"): (
        "uvicorn 0.54.0 installs SIGINT/SIGTERM handlers in Server.serve() and re-raises a caught one "
        "after shutdown, with no Config option to leave signals to the host; the controller owns its "
        "signals and stops the server itself"),
    ("controller/http.py", "uvicorn.protocols.http.auto"): (
        "uvicorn 0.54.0 takes a protocol class as Config(http=...) (documented) but documents no "
        "way to wrap its own; AutoHTTPProtocol is what Config(http='auto') loads"),
    ("controller/http.py", "_loop"): (
        "uvicorn 0.54.0 calls its http protocol class with `_loop=`; the wrapper passes it through"),
    ("proxy/metrics.py", "prometheus_client.mmap_dict"): (
        "prometheus_client 0.26.0's multiprocess values cannot drop a series from their files "
        "(tests/proxy/test_metrics.py shows it), so a gone instance's series would stay on "
        "/metrics; the proxy writes the same files itself (MmapedDict, mmap_key) and reads them with "
        "the documented MultiProcessCollector"),
    ("proxy/metrics.py", "prometheus_client.utils"): (
        "floatToGoString: prometheus_client 0.26.0's bucket label text, so the proxy's `le` labels "
        "match the ones MultiProcessCollector writes for the same buckets"),
    ("common/discovery/kube.py", "_preload_content"): (
        "the kubernetes client (37.0.2) documents `_preload_content=False` on every API method as the "
        "way to read the raw response; the watch reads the body itself, bounded"),
    ("common/discovery/kube.py", "_continue"): (
        "the kubernetes client (37.0.2) names the list call's `continue` query parameter `_continue` "
        "(`continue` is a Python keyword), as its API reference documents"),
    ("common/discovery/kube.py", "_request_timeout"): (
        "the kubernetes client (37.0.2) documents `_request_timeout` on every API method as its "
        "connect/read timeout"),
}
REVIEWED_PREFIXES = ("vllm.",)  # see PRIVATE_ALLOWED's comment

# Methods of another library's class that kvferry may override: its documented extension points.
OVERRIDABLE: dict[str, set[str] | None] = {  # None: a plugin interface, every public method is one
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1": None,
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorWorkerMetadata": None,
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorStats": None,
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorPromMetrics": None,
    "prometheus_client.registry.Collector": {"collect", "describe"},
    "opentelemetry.sdk.trace.id_generator.IdGenerator": {"generate_span_id", "generate_trace_id"},
    "fastapi.responses.JSONResponse": {"render"},  # starlette documents a custom render()
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc.TraceServiceServicer": {"Export"},
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top != "kvferry" and top not in sys.stdlib_module_names


def own_names(trees: Iterable[ast.AST]) -> set[str]:
    """Every name kvferry itself defines: functions, classes, stored attributes and names, and the
    strings of a `__slots__`."""
    own = set(DOCUMENTED_PRIVATE)
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
                own |= {c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return own


def _bindings(tree: ast.AST) -> dict[str, str]:
    """Each imported local name -> the dotted path it stands for."""
    out: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out |= {a.asname or a.name: f"{n.module}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {a.asname: a.name for a in n.names if a.asname}
            out |= {a.name.split(".")[0]: a.name.split(".")[0] for a in n.names if not a.asname}
    return out


def _base_class(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def private_uses(files: dict[str, ast.AST], own: set[str] | None = None) -> list[str]:
    """`rel/path.py:line: what` for each use the module docstring names, less PRIVATE_ALLOWED's."""
    own = own_names(files.values()) if own is None else own
    found: list[tuple[str, int, str]] = []
    for rel, tree in files.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                found += [(rel, n.lineno, a.name) for a in n.names
                          if _third_party(a.name) and (any(_private(p) for p in a.name.split("."))
                                                       or _unreviewed(a.name))]
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0 and _third_party(n.module):
                if any(_private(p) for p in n.module.split(".")) or _unreviewed(n.module):
                    found.append((rel, n.lineno, n.module))
                found += [(rel, n.lineno, a.name) for a in n.names if _private(a.name)]
            elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own:
                found.append((rel, n.lineno, n.attr))
            elif isinstance(n, ast.Call):
                if (isinstance(n.func, ast.Name) and n.func.id in ("getattr", "setattr", "hasattr") and len(n.args) > 1
                        and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                        and _private(n.args[1].value) and n.args[1].value not in own):
                    found.append((rel, n.lineno, n.args[1].value))
                found += [(rel, n.lineno, k.arg) for k in n.keywords if k.arg and _private(k.arg)]
                found += [(rel, n.lineno, key) for k in n.keywords if k.arg is None and isinstance(k.value, ast.Dict)
                          for key in _private_strings(k.value.keys)]
        found += _splatted_keys(rel, tree)
        found += _overrides(rel, tree)
    return [f"{rel}:{line}: {what}" for rel, line, what in found
            if (rel, what) not in PRIVATE_ALLOWED and not (rel.startswith("connector/") and what in PRIVATE_NAMES)]


def _splatted_keys(rel: str, tree: ast.AST) -> list[tuple[str, int, str]]:
    """Private keyword arguments a function passes in a dict it splats (`f(**kw)`): the dict's
    literal or stored keys (`kw = {"_x": 1}`, `kw["_x"] = 1`). A literal `f(**{"_x": 1})` is
    private_uses' own keyword check."""
    found: set[tuple[str, int, str]] = set()  # a nested function is walked with its outer one too
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        splat = {k.value.id for n in ast.walk(fn) if isinstance(n, ast.Call) for k in n.keywords
                 if k.arg is None and isinstance(k.value, ast.Name)}
        if not splat:
            continue
        for n in ast.walk(fn):
            keys: list[ast.expr | None] = []
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Dict):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(isinstance(t, ast.Name) and t.id in splat for t in targets):
                    keys = list(n.value.keys)
            elif (isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                  and n.value.id in splat):
                keys = [n.slice]
            found |= {(rel, n.lineno, key) for key in _private_strings(keys)}
    return sorted(found)


def _private_strings(nodes: list[ast.expr | None]) -> list[str]:
    """The private names among `nodes` that are string constants (a dict's keys, a subscript)."""
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str) and _private(n.value)]


def _unreviewed(module: str) -> bool:
    """A third-party submodule not in REVIEWED_MODULES (a top-level package is its own public face)."""
    return "." in module and module not in REVIEWED_MODULES and not module.startswith(REVIEWED_PREFIXES)


def _overrides(rel: str, tree: ast.AST) -> list[tuple[str, int, str]]:
    names = _bindings(tree)
    out = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for b in cls.bases:
            text = ast.unparse(b).split("[")[0]
            head, _, rest = text.partition(".")
            path = names.get(head, "") + (f".{rest}" if rest else "")
            if not path or not _third_party(path):
                continue
            base = _base_class(path)
            allowed = OVERRIDABLE.get(path, set())
            for m in cls.body:
                if not isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) or m.name.startswith("__"):
                    continue
                if base is not None and hasattr(base, m.name) and (
                        _private(m.name) or (allowed is not None and m.name not in allowed)):
                    out.append((rel, m.lineno, m.name))
    return out
