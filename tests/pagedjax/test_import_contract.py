"""The package's arrows, read from the source (no import runs): no import cycle inside pagedjax/
(imports for type checking and inside functions count too), and no module but
pagedjax/engine/llm_engine.py reads the engine's private attributes (``engine._x``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pagedjax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, tuple[ast.Module, bool]]:
    """module name -> (its syntax tree, whether it is a package's __init__)."""
    return {
        _module_name(p): (ast.parse(p.read_text(), str(p)), p.name == "__init__.py")
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _imports(name: str, tree: ast.Module, is_package: bool, known: set[str]) -> set[str]:
    """Modules of pagedjax/ that ``name`` imports anywhere in its file."""
    out = set()
    package = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {
        # A package's own __init__ re-exporting its modules is not an arrow back to it.
        n: {m for m in _imports(n, *mod, known) if not n.startswith(m + ".")}
        for n, mod in mods.items()
    }


def _engine_private_reads(tree: ast.Module) -> list[str]:
    """``X._name`` where X is ``engine``, ``<anything>.engine``, or a local bound to either."""
    bound = {"engine"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_engine(node.value, {"engine"}):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return [
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and _is_engine(node.value, bound)
    ]


def _is_engine(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr == "engine"


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def _private_readers(skip: set[str]) -> dict[str, list[str]]:
    offenders = {}
    for name, (tree, _) in _modules().items():
        if name in skip:
            continue
        reads = _engine_private_reads(tree)
        if reads:
            offenders[name] = reads
    return offenders


def test_only_the_engine_reads_its_private_attributes():
    assert _private_readers({"pagedjax.engine.llm_engine"}) == {}


def test_the_checks_can_fail():
    """The scans see a cycle and a private read where there is one."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    code = "def f(self):\n    e = self.engine\n    e._fail(1)\n    engine._rng\n"
    assert len(_engine_private_reads(ast.parse(code))) == 2


# Which packages each layer may not import (DESIGN.md: entrypoints -> engine -> {core, worker} ->
# models -> pallas_kernels; inspection beside worker, read by the engine; the OpenAI server
# through the engine's client). models/ and
# pallas_kernels/ live at the repository's top level and install as pagedjax.models and
# pagedjax.pallas_kernels. Imports under ``if TYPE_CHECKING:`` name types for annotations only and
# are not arrows here (the cycle check above still counts them).
FORBIDDEN = {
    "pagedjax.core": ("pagedjax.engine", "pagedjax.worker", "pagedjax.entrypoints", "jax"),
    "pagedjax.worker": ("pagedjax.engine", "pagedjax.entrypoints"),
    "pagedjax.inspection": ("pagedjax.engine", "pagedjax.entrypoints", "pagedjax.worker"),
    "pagedjax.models": ("pagedjax.engine", "pagedjax.worker", "pagedjax.entrypoints"),
    "pagedjax.pallas_kernels": ("pagedjax",),
    # The HTTP server codes against engine/client.py's EngineClient: never an engine or its host
    "pagedjax.entrypoints.openai": ("pagedjax.engine.hosting", "pagedjax.engine.llm_engine"),
}


def _layer_files() -> dict[str, Path]:
    """module name -> file, for pagedjax/ and the two top-level packages installed under it."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    for top in ("models", "pallas_kernels"):
        for p in (ROOT / top).rglob("*.py"):
            files["pagedjax." + _module_name(p)] = p
    return files


def _runtime_nodes(tree: ast.AST):
    """Every node, skipping the bodies of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _absolute_imports(name: str, path: Path) -> set[str]:
    """Every module named by a run-time import in the file, relative imports made absolute."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _arrow_violations(files: dict[str, Path]) -> list[str]:
    found = []
    for name, path in sorted(files.items()):
        for layer, banned in FORBIDDEN.items():
            if not _within(name, layer):
                continue
            for target in sorted(_absolute_imports(name, path)):
                if not _within(target, layer) and any(_within(target, b) for b in banned):
                    found.append(f"{name} imports {target}")
    return found


def test_layers_import_only_downward():
    assert _arrow_violations(_layer_files()) == []


def test_the_arrow_check_can_fail(tmp_path):
    bad = tmp_path / "scheduler.py"
    bad.write_text(
        "import jax.numpy as jnp\nfrom pagedjax.worker import runner\n"
        "if TYPE_CHECKING:\n    from pagedjax.engine import request\n"
    )
    kernel = tmp_path / "kernel.py"
    kernel.write_text("from pagedjax.core import sequence\n")
    found = _arrow_violations({"pagedjax.core.scheduler": bad, "pagedjax.pallas_kernels.k": kernel})
    assert found == [
        "pagedjax.core.scheduler imports jax.numpy",
        "pagedjax.core.scheduler imports pagedjax.worker",
        "pagedjax.core.scheduler imports pagedjax.worker.runner",
        "pagedjax.pallas_kernels.k imports pagedjax.core",
        "pagedjax.pallas_kernels.k imports pagedjax.core.sequence",
    ]
