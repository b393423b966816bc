"""Sizes that fit in a head: no module of the package over ~400 lines, no function over 80.

Read with :mod:`ast`, so a function's length is from its ``def`` (decorators aside) to its
last line, docstring and comments included.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kombu_delay"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80

#: Known to be over a limit, to be split; nothing may join them.
KNOWN_LONG_MODULES: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[str] = set()


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def name(path: Path, root: Path = PACKAGE) -> str:
    return path.relative_to(root).as_posix()


def long_functions(path: Path, root: Path = PACKAGE) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                found.append(f"{name(path, root)}:{node.name}")
    return found


def test_no_module_is_too_long() -> None:
    assert len(modules()) > 20  # the walk found the package
    too_long = {name(p) for p in modules() if len(p.read_text().splitlines()) > MAX_MODULE_LINES}
    assert too_long <= KNOWN_LONG_MODULES


def test_no_function_is_too_long() -> None:
    too_long = {found for path in modules() for found in long_functions(path)}
    assert too_long <= KNOWN_LONG_FUNCTIONS


def test_the_function_walk_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n")
    assert long_functions(tmp_path / "long.py", tmp_path) == ["long.py:f"]
