"""Package layout: kvferry.* subpackages only, imports point down docs/architecture.md's layer table."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import api_guard
import pytest
from layout_sizes import CLASS_LINES, LIBRARY, MODULE_LINES, oversized

REPO = Path(__file__).resolve().parent.parent

# Which kvferry subpackages (and heavy libraries) each folder may import (docs/architecture.md "Layers").
ALLOWED = {
    "common": set(),
    "kernels": {"common"},
    "buffer": {"kernels", "common"},
    "sender": {"buffer", "common"},
    "receiver": {"buffer", "common"},
    "engine": {"buffer", "kernels", "sender", "receiver", "common"},
    "connector": {"engine", "common"},
    "proxy": {"common"},
    "controller": {"common"},
    "launcher": {"common", "proxy", "controller", "engine", "buffer", "kernels", "sender", "receiver",
                 "connector"},
    # Test support: may use the whole library; nothing of it imports testing (see below).
    "testing": {"common", "proxy", "controller", "engine", "buffer", "kernels", "sender", "receiver",
                "connector", "launcher"},
}
NO_TORCH = {"common", "proxy", "controller"}
NO_VLLM = set(ALLOWED) - {"connector", "launcher"}


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function bodies and TYPE_CHECKING blocks count:
    each still ties the two files); for `from a.b import c`, both a.b and a.b.c."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_down_the_layers(folder: str) -> None:
    for path in (REPO / folder).rglob("*.py"):
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "kvferry" and len(parts) > 1 and parts[1] != folder:
                assert parts[1] in ALLOWED[folder], f"{path.relative_to(REPO)} imports {name}"
            if folder in NO_TORCH:
                assert parts[0] not in ("torch", "vllm", "nixl"), f"{path.relative_to(REPO)} imports {name}"
            if folder in NO_VLLM:
                assert parts[0] != "vllm", f"{path.relative_to(REPO)} imports {name}"


def run_clean(code: str) -> subprocess.CompletedProcess:
    """Run in `/` so the repo root is not on sys.path: only what is installed counts."""
    return subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)


def test_subpackages_import_and_generic_names_do_not() -> None:
    r = run_clean("import kvferry.proxy, kvferry.buffer, kvferry.kernels, kvferry.common.config")
    assert r.returncode == 0, r.stderr
    for generic in ("proxy", "buffer", "kernels", "common", "engine"):
        r = run_clean(f"import {generic}")
        assert r.returncode != 0 and "No module named" in r.stderr, generic


def test_proxy_and_common_import_without_torch_or_vllm() -> None:
    code = ("import sys, kvferry.proxy, kvferry.common.config, kvferry.common.wire.messages, "
            "kvferry.common.hashing, kvferry.controller; "
            "bad = [m for m in ('torch', 'vllm', 'nixl') if m in sys.modules]; "
            "assert not bad, bad")
    r = run_clean(code)
    assert r.returncode == 0, r.stderr


def test_every_subpackage_is_packaged() -> None:
    """A folder with an __init__.py that pyproject.toml does not list is missing from a wheel install."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"kvferry." + ".".join(p.parent.relative_to(REPO).parts)
             for folder in ALLOWED for p in (REPO / folder).rglob("__init__.py")}
    assert found <= listed, f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"


def test_make_lint_type_checks_every_library_folder() -> None:
    """`make lint` runs mypy on the folders its LIBRARY names: a new folder left out would go unchecked."""
    import re
    import tomllib

    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    line = re.search(r"^LIBRARY := (.+)$", (REPO / "Makefile").read_text(), re.M)
    assert line, "the Makefile has no LIBRARY line (the folders `make lint` type-checks)"
    assert set(line.group(1).split()) == folders, f"make LIBRARY {line.group(1).split()} vs pyproject {sorted(folders)}"


def test_the_size_report_names_what_is_over(tmp_path: Path) -> None:
    """The report finds a module, a class and a function over their sizes (planted), and nothing else."""
    assert set(LIBRARY) == set(ALLOWED), "layout_sizes.LIBRARY lists the library's folders"
    (tmp_path / "common").mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(CLASS_LINES))
    (tmp_path / "common" / "big.py").write_text("class C:\n    def f(self) -> None:\n" + body + "\n" * MODULE_LINES)
    (tmp_path / "common" / "small.py").write_text("def g() -> None:\n    pass\n")
    assert oversized(tmp_path) == [f"common/big.py: {MODULE_LINES + CLASS_LINES + 2} lines",
                                   f"common/big.py:C: class of {CLASS_LINES + 2} lines",
                                   f"common/big.py:f: function of {CLASS_LINES + 1} lines"]


def library_trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text())
            for folder in ALLOWED for p in (REPO / folder).rglob("*.py")}


def test_no_private_api_of_another_library() -> None:
    """The library uses other libraries through their public API (tests/api_guard.py says what that
    means); what a library offers only privately is in its PRIVATE_ALLOWED, each with the reason."""
    found = api_guard.private_uses(library_trees())
    assert not found, "use the library's public API instead of: " + "; ".join(found)


PLANTED = {  # each use the guard exists for, put back in a module of its own
    "from prometheus_client.mmap_dict import MmapedDict, mmap_key": "prometheus_client.mmap_dict",
    "from prometheus_client.utils import floatToGoString": "prometheus_client.utils",
    "import uvicorn\ndef f(c):\n    kw = {}\n    kw['_loop'] = 1\n    uvicorn.Config(c, **kw)": "_loop",
    "import uvicorn\ndef f(c):\n    kw = {'_loop': 1}\n    uvicorn.Config(c, **kw)": "_loop",
    "import uvicorn\nuvicorn.Config(None, **{'_loop': 1})": "_loop",
    "import uvicorn\nclass S(uvicorn.Server):\n    def capture_signals(self): yield": "capture_signals",
    "import uvicorn\nclass S(uvicorn.Server):\n    def _serve(self): pass": "_serve",
    "from uvicorn.protocols.http.auto import AutoHTTPProtocol\nAutoHTTPProtocol(_loop=None)": "_loop",
    "from vllm.v1.attention.backends.cpu_attn import _get_attn_isa": "_get_attn_isa",
    "import torch\ntorch.cpu._is_amx_tile_supported()": "_is_amx_tile_supported",
    "import torch\ngetattr(torch.cpu, '_is_amx_tile_supported', None)": "_is_amx_tile_supported",
    "from nixl._api import nixl_agent": "nixl._api",
    "import nixl._api": "nixl._api",
    "from kubernetes.config.incluster_config import InClusterConfigLoader": "kubernetes.config.incluster_config",
    "from kubernetes import _private_thing": "_private_thing",
}


@pytest.mark.parametrize("code", sorted(PLANTED))
def test_the_private_api_guard_flags_each_use_put_back(code: str) -> None:
    """Planted in a module of its own (not under an allow-listed path), every use is flagged; the
    library's own names still count as its own (`self._x` of a class it defines passes)."""
    trees = library_trees()
    own = api_guard.own_names(trees.values())
    found = api_guard.private_uses({"planted/mod.py": ast.parse(code)}, own)
    assert any(f.endswith(": " + PLANTED[code]) for f in found), (code, found)


def test_the_private_api_guard_passes_public_uses() -> None:
    code = ("import prometheus_client\nfrom prometheus_client.registry import Collector\n"
            "class C(Collector):\n    def collect(self): return []\n"
            "class D:\n    def __init__(self): self._x = 1\n    def f(self): return self._x\n"
            "from nixl import nixl_agent\n"
            "def g(f):\n    d = {'_id': 1}\n    d['_rev'] = 2\n    return f(d, **{'limit': 1})\n")
    tree = ast.parse(code)
    assert api_guard.private_uses({"planted/mod.py": tree}) == []


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return "kvferry." + ".".join(rel.parts).removesuffix(".__init__")


def kvferry_imports(path: Path) -> set[str]:
    return {n for n in imports_of(path) if n.startswith("kvferry.")}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def library_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for folder in ALLOWED for p in (REPO / folder).rglob("*.py")}
    return {m: {d for d in kvferry_imports(p) if d in paths and d != m} for m, p in paths.items()}


def test_import_cycles_are_found() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_library_modules_import_each_other() -> None:
    """A cycle (even a deferred or TYPE_CHECKING import) means neither file reads without the
    other: what both need moves to a third module, or one side takes a callback or Protocol."""
    assert not import_cycles(library_graph()), "break these import cycles: " + "; ".join(
        " <-> ".join(c) for c in import_cycles(library_graph()))


def unit_of(module: str) -> str:
    """The package a module counts in for cycles: its subpackage (kvferry.proxy.flows.chat ->
    kvferry.proxy.flows), or itself for a module at a folder's top (kvferry.proxy.app)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) <= 3 else ".".join(parts[:-1])


def grouped(graph: dict[str, set[str]], unit: Callable[[str], str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    for deps in list(out.values()):
        for d in deps:
            out.setdefault(d, set())
    return out


def test_no_two_subpackages_or_folders_import_each_other() -> None:
    """docs/architecture.md's layers hold inside a folder too: its subpackages (proxy/flows,
    proxy/routing, ...) and its top modules import one way, as the folders do."""
    graph = library_graph()
    for unit in (unit_of, lambda m: ".".join(m.split(".")[:2])):
        cycles = import_cycles(grouped(graph, unit))
        edges = [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
                 if any(unit(m) in c and unit(d) in c and unit(m) != unit(d) for c in cycles)]
        assert not cycles, "break these cycles: " + "; ".join(" <-> ".join(c) for c in cycles) + ", made of: " + (
            "; ".join(edges))


def test_the_subpackage_cycle_check_finds_one() -> None:
    graph = {"kvferry.proxy.flows.a": {"kvferry.proxy.routing.b"}, "kvferry.proxy.routing.b": {"kvferry.proxy.http.c"},
             "kvferry.proxy.http.c": {"kvferry.proxy.flows.d"}, "kvferry.proxy.flows.d": set()}
    assert import_cycles(graph) == []
    assert import_cycles(grouped(graph, unit_of)) == [
        ["kvferry.proxy.flows", "kvferry.proxy.http", "kvferry.proxy.routing"]]


def test_the_connector_imports_only_engine_api_and_common() -> None:
    """vLLM's side of kvferry sees one face of the engine (engine/api.py), so the engine's files
    can move without touching the connector; and no library module imports kvferry.testing."""
    bad = []
    for m, deps in library_graph().items():
        for d in deps:
            if m.startswith("kvferry.connector.") and not d.startswith(
                    ("kvferry.connector", "kvferry.common", "kvferry.engine.api")):
                bad.append(f"{m} imports {d}")
    for folder in set(ALLOWED) - {"testing"}:
        for path in (REPO / folder).rglob("*.py"):
            bad += [f"{module_name(path)} imports {d}" for d in kvferry_imports(path)
                    if d.startswith("kvferry.testing")]
    assert not bad, bad


def imported_test_modules(path: Path) -> set[str]:
    """The test modules (tests.<folder>.test_*, tests.test_*, or test_* on sys.path) a file imports."""
    return {n for n in imports_of(path) if any(part.startswith("test_") for part in n.split("."))}


def test_no_test_file_imports_another() -> None:
    """What tests share lives in helper modules under tests/ (polling.py, stub_procs.py, ...): a test
    file imported by another is loaded twice (as tests.test_x beside pytest's test_x), each copy with
    its own globals."""
    bad = [f"{path.relative_to(REPO)} imports {name}"
           for path in sorted((REPO / "tests").rglob("*.py")) for name in sorted(imported_test_modules(path))]
    assert not bad, "move what they share into a helper module under tests/: " + "; ".join(bad)


def _sleeps(tree: ast.AST) -> list[ast.Call]:
    """The time.sleep and asyncio.sleep calls under `tree`."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "sleep" and isinstance(n.func.value, ast.Name)
            and n.func.value.id in ("time", "asyncio")]


# The two places a sleep is right in a test, and what its line says (`# a sleep (kind): why`).
SLEEP_KINDS = {
    "pacing": "the behaviour under test is timing the test makes: a slow engine, paced writes, a "
              "client that reads nothing, waiting out a timer the test set",
    "window": "nothing may happen within T: a refusal that must hold, a connection that must stay",
}
_SLEEP_LINE = re.compile(r"# a sleep \((\w+)\): \S")


def test_tests_wait_for_conditions_with_tests_polling() -> None:
    """A test waits for what it needs with tests/polling.py (until, until_async) on a condition the
    product shows (a counter, an acknowledgement, a state), not with a sleep before its assert nor a
    deadline loop of its own. A sleep stays only as one of SLEEP_KINDS, and its line says which."""
    bad, kinds = [], {k: 0 for k in SLEEP_KINDS}
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "polling.py":
            continue
        text = path.read_text()
        lines, tree, name = text.splitlines(), ast.parse(text), path.relative_to(REPO)
        for c in _sleeps(tree):
            said = _SLEEP_LINE.search(lines[c.lineno - 1])
            if said is None or said.group(1) not in SLEEP_KINDS:
                bad.append(f"{name}:{c.lineno}: a sleep whose line does not say `# a sleep (pacing|window): why`")
            else:
                kinds[said.group(1)] += 1
        bad += [f"{name}:{w.lineno}: a deadline loop (tests.polling.until)" for w in ast.walk(tree)
                if isinstance(w, ast.While) and _sleeps(w) and "deadline" in ast.unparse(w)]
    assert not bad, "; ".join(bad)
    assert all(kinds.values()), kinds  # both kinds are in use: the pattern still matches real lines


# tests/ mirrors the library: a folder per layer (transfer = sender, receiver, buffer, kernels and the
# PD engine), e2e for real-vLLM clusters, deploy for deploy/ (manifests); at its root only what checks the
# whole repository. Inside a folder, a subfolder per subpackage: tests/proxy/<p>/ for proxy/<p>/, and
# tests/transfer/<layer>/ for a layer of its own (kernels/, buffer/, sender/, receiver/); a test of
# several of them stays in the folder itself.
TEST_FOLDERS = {"common", "proxy", "transfer", "engine", "controller", "launcher", "e2e", "deploy"}
TRANSFER_LAYERS = {"kernels", "buffer", "sender", "receiver"}
REPO_WIDE_TESTS = {"test_layout.py", "test_docs.py", "test_errors.py", "test_benchmarks_run.py"}


def _mirrors(folder: str, sub: str) -> bool:
    """tests/<folder>/<sub>/ names a part of the library: proxy/<sub>/ is a subpackage, or <sub> is
    one of the transfer layers."""
    if folder == "transfer":
        return sub in TRANSFER_LAYERS and (REPO / sub / "__init__.py").is_file()
    return (REPO / folder / sub / "__init__.py").is_file()


def test_test_files_live_in_the_folder_of_what_they_test() -> None:
    """A new test file goes under tests/<folder>/ or tests/<folder>/<subpackage>/ (helpers stay at
    tests/, named *_helpers.py or for their job); pytest imports test files by basename, so two
    with one name would clash."""
    tests = REPO / "tests"
    at_root = {p.name for p in tests.glob("test_*.py")} - REPO_WIDE_TESTS
    folders = {p.parent.name for p in tests.glob("*/test_*.py")} - TEST_FOLDERS
    nested = [str(p.relative_to(tests)) for p in tests.glob("*/*/test_*.py")
              if p.parent.parent.name not in TEST_FOLDERS or not _mirrors(p.parent.parent.name, p.parent.name)]
    deeper = [str(p.relative_to(tests)) for p in tests.glob("*/*/*/**/test_*.py")]
    names = [p.name for p in tests.rglob("test_*.py")]
    clashes = sorted({n for n in names if names.count(n) > 1})
    assert not (at_root or folders or nested or deeper or clashes), (
        f"test files at tests/ {sorted(at_root)}, in unknown folders {sorted(folders)}, in subfolders that "
        f"name no subpackage {nested + deeper}, same basename {clashes}: put each under tests/<one of "
        f"{sorted(TEST_FOLDERS)}>/ (or its subfolder for one subpackage) with a name of its own")


def test_the_layout_rule_refuses_a_subfolder_that_names_no_subpackage() -> None:
    assert _mirrors("proxy", "routing") and _mirrors("transfer", "sender")
    assert not _mirrors("proxy", "sender") and not _mirrors("transfer", "routing") and not _mirrors("engine", "x")


def _defined(path: Path) -> set[str]:
    """`name` and `Class.name` for every function and class the module defines at its top level."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.ClassDef):
            out |= {f"{node.name}.{n.name}" for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def _walk(heading: str) -> list[str]:
    """The numbered rows of one of docs/architecture.md's file-by-file walks."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return [r for r in table.splitlines() if r.startswith("| ") and r[2].isdigit()]


@pytest.mark.parametrize("heading", ["One request, file by file", "A streamed chat chunk, file by file"])
def test_one_request_file_by_file_names_real_code(heading: str) -> None:
    """docs/architecture.md's walks through a request name files and functions that exist."""
    rows = _walk(heading)
    assert len(rows) >= 10, rows
    missing = []
    for row in rows:
        files, funcs = [c.strip() for c in row.strip("| ").split(" | ")][1:3]
        paths = [REPO / f for f in re.findall(r"`([\w/]+\.py)`", files)]
        names = re.findall(r"`([\w.]+)`", funcs)
        assert paths and names, row
        have = set().union(*(_defined(p) for p in paths if p.exists()))
        missing += [str(p.relative_to(REPO)) for p in paths if not p.exists()]
        missing += [f"{n} (in {files.strip()})" for n in names if n not in have]
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"


def test_a_streamed_chat_chunk_passes_through_at_most_15_files() -> None:
    """The walk of a streamed chat request names every file its chunk passes; a relay spread over
    more files than that is one to fold back."""
    files = {f for row in _walk("A streamed chat chunk, file by file")
             for f in re.findall(r"`([\w/]+\.py)`", row.split(" | ")[1])}
    assert 10 <= len(files) <= 15, sorted(files)


# Module names the library may repeat (a folder holds a name once, so once per package), and why.
REPEATED_MODULES = {
    "__init__.py": "a package's own file",
    "__main__.py": "a package's `python -m` entry",
    "errors.py": "each package's own error types, next to the code that raises them",
    "server.py": "the process a package runs as (kvferry-proxy, kvferry-controller)",
}


def test_no_name_means_two_things_in_the_library() -> None:
    """A class name is defined once in the library, and a module name is used once (less
    REPEATED_MODULES'), so a name in a log line, a traceback or a doc points at one thing."""
    classes: dict[str, list[str]] = {}
    modules: dict[str, list[str]] = {}
    for folder in ALLOWED:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            modules.setdefault(path.name, []).append(rel)
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, []).append(rel)
    twice = [f"class {n}: {', '.join(where)}" for n, where in sorted(classes.items()) if len(where) > 1]
    twice += [f"module {n}: {', '.join(where)}" for n, where in sorted(modules.items())
              if len(where) > 1 and n not in REPEATED_MODULES]
    assert not twice, "rename one of each: " + "; ".join(twice)
