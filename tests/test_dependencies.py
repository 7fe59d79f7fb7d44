"""Every third-party module the installed code imports is declared in pyproject.toml."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ("pagedjax", "models", "pallas_kernels")  # what the wheel holds
OWN = {"pagedjax", "models", "pallas_kernels"}


def imported_top_level(folder: Path) -> dict[str, str]:
    """Top-level module names imported anywhere under ``folder`` -> a file importing it."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {normalize(re.match(r"[A-Za-z0-9_.-]+", s)[0]) for s in specs}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_declared():
    declared = declared_distributions()
    providers = importlib.metadata.packages_distributions()
    imports: dict[str, str] = {}
    for folder in INSTALLED:
        imports.update(imported_top_level(ROOT / folder))
    undeclared = {}
    for module, where in sorted(imports.items()):
        if module in OWN or module in sys.stdlib_module_names:
            continue
        dists = {normalize(d) for d in providers.get(module, [module])}
        if not dists & declared:
            undeclared[module] = where
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_scan_sees_imports_inside_functions(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n    import prometheus_client.core\n")
    assert imported_top_level(tmp_path / "pkg") == {"prometheus_client": "pkg/m.py"}
