"""The package's arrows, read from the source (no import runs): no import cycle inside pagedjax/
(imports for type checking and inside functions count too), and no module but pagedjax/engine.py
reads the engine's private attributes (``engine._x``)."""

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
    assert _private_readers({"pagedjax.engine"}) == {}


def test_the_checks_can_fail():
    """The scans see a cycle and a private read where there is one."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    code = "def f(self):\n    e = self.engine\n    e._fail(1)\n    engine._rng\n"
    assert len(_engine_private_reads(ast.parse(code))) == 2
