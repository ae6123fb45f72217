"""dcut_core is pure: numpy and the standard library only, never ray or torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[2] / "dcut_core"
ALLOWED = set(sys.stdlib_module_names) | {"numpy", "dcut_core"}


def imported_roots(path: pathlib.Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_core_modules_import_only_numpy_and_the_standard_library():
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 5
    for f in files:
        bad = imported_roots(f) - ALLOWED
        assert not bad, f"{f.name} imports {sorted(bad)}"


def test_importing_core_loads_neither_ray_nor_torch():
    modules = [f"dcut_core.{f.stem}" for f in sorted(CORE.glob("*.py")) if f.stem != "__init__"]
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_imports_run_one_way():
    """`tools → deployments → actors → dcut_core`: no layer imports one above it (lazy imports
    inside functions included)."""
    root = CORE.parent
    above = {"actors": {"deployments", "tools"}, "deployments": {"tools"}}
    for layer, banned in above.items():
        for f in sorted((root / layer).rglob("*.py")):
            bad = imported_roots(f) & banned
            assert not bad, f"{f.relative_to(root)} imports {sorted(bad)}"
