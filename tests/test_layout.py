"""The tree shows the architecture: layers without import cycles, leaf packages that import
nothing above them, imports without side effects, short modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "lang", "radix", "constrained")


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_the_import_graph_between_layers_has_no_cycle():
    result = run_python("scripts/import_graph.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runtime/server" in result.stdout and "no cycles" in result.stdout


def test_constrained_and_radix_import_no_runtime_module():
    for package in ("spruce.constrained", "spruce.radix"):
        code = f"import {package}; import {package}.{'spec' if 'constrained' in package else 'radix_cache'}"
        result = run_python("-X", "importtime", "-c", code)
        assert result.returncode == 0, result.stderr
        loaded = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
        assert not [m for m in loaded if m.startswith(("spruce.runtime", "spruce.lang"))], package


def test_importing_the_packages_leaves_the_environment_alone():
    code = (
        "import os; before = dict(os.environ)\n"
        "import spruce.runtime, spruce.lang, spruce.radix, spruce.constrained\n"
        "import spruce.runtime.server.launch, spruce.runtime.engine.offline, spruce.runtime.cli\n"
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


def test_modules_are_short_and_the_runtime_root_holds_only_entry_points():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    ]
    assert not long
    root_modules = {p.name for p in (ROOT / "runtime").glob("*.py")} - {
        "__init__.py",
        "__main__.py",
    }
    assert len(root_modules) <= 6, root_modules
