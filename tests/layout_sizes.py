"""The size report: library modules, classes and functions long enough that they may hold more
than one job. tests/conftest.py prints it after a run that checked the layout; nothing fails on
it, since a class split to count under a line is harder to read than the long class."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIBRARY = ("common", "kernels", "buffer", "sender", "receiver", "engine", "connector", "proxy", "controller",
           "launcher", "testing")
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 500, 300, 60


def oversized(root: Path = REPO) -> list[str]:
    """Library modules over MODULE_LINES, classes over CLASS_LINES, functions over FUNCTION_LINES."""
    big = []
    for folder in LIBRARY:
        for path in sorted((root / folder).rglob("*.py")):
            src, rel = path.read_text(), path.relative_to(root)
            if src.count("\n") > MODULE_LINES:
                big.append(f"{rel}: {src.count(chr(10))} lines")
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    kind, cap = (("class", CLASS_LINES) if isinstance(node, ast.ClassDef)
                                 else ("function", FUNCTION_LINES))
                    if n > cap:
                        big.append(f"{rel}:{node.name}: {kind} of {n} lines")
    return big
