"""The package's arrows, read from the sources (no import runs), over pagedjax/ and the two
top-level packages installed inside it (models/ as pagedjax.models, pallas_kernels/ as
pagedjax.pallas_kernels). Every import counts: at module level, under ``if TYPE_CHECKING:`` and
inside functions.

- No import cycle between modules.
- No folder loop: within each package, its subpackages (each taken whole, with the packages
  under it) import one another without a cycle.
- Each package imports only what its rule in ``ALLOWED`` names (a positive list).
- No module but pagedjax/engine/llm_engine.py reads the engine's private attributes
  (``engine._x``).

Each check is also run on planted violations (string sources), so none can pass vacuously.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# import prefix -> the folder installed under it
TREES = {
    "pagedjax": ROOT / "pagedjax",
    "pagedjax.models": ROOT / "models",
    "pagedjax.pallas_kernels": ROOT / "pallas_kernels",
}

# Which packages each package may import, besides its own modules (DESIGN.md: entrypoints ->
# engine -> {core, worker} -> models -> pallas_kernels). A name allows that package's own
# modules, not its subpackages (each has its rule and is named where it is allowed); a module's
# name allows that module only. "pagedjax" is the root's shared vocabulary (config.py,
# sampling_params.py, outputs.py, inputs.py, compilation.py, distributed.py, executables.py,
# generation_config.py); "pagedjax.__init__" is the public facade (``from pagedjax import LLM``)
# and "pagedjax.__main__" ``python -m pagedjax``: nothing inside imports either.
ROOT_PACKAGE = "pagedjax"
ALLOWED: dict[str, tuple[str, ...]] = {
    "pagedjax.__init__": (
        "pagedjax",
        "pagedjax.engine",
        "pagedjax.entrypoints",
        "pagedjax.lora",
    ),
    "pagedjax.__main__": ("pagedjax.cli",),
    # The `pagedjax` command: dispatches to the front ends, the benchmarks and the compile
    "pagedjax.cli": (
        "pagedjax",
        "pagedjax.aot",
        "pagedjax.bench",
        "pagedjax.engine",
        "pagedjax.entrypoints",
        "pagedjax.entrypoints.serve_ray",
        "pagedjax.utils",
    ),
    # The shared vocabulary: the configs of the features it composes, nothing that runs
    "pagedjax": (
        "pagedjax.lora.config",
        "pagedjax.spec_decode.config",
        "pagedjax.spec_decode.metrics",
        "pagedjax.structured_output.grammar",
        "pagedjax.utils",
    ),
    # Small helpers and the log set-up: imports nothing of pagedjax
    "pagedjax.utils": (),
    # Adapters: the request, the limits, the host cache (reads adapters through models/)
    "pagedjax.lora": ("pagedjax.models",),
    # Constraints compiled with llguidance: below the sampler that applies their masks
    "pagedjax.structured_output": ("pagedjax.utils",),
    # Metric names, the offline reader of EngineStats, the server's Prometheus series
    "pagedjax.metrics": ("pagedjax",),
    # Host-side bookkeeping, pure Python (no jax: THIRD_PARTY_BANNED)
    "pagedjax.core": ("pagedjax", "pagedjax.lora", "pagedjax.utils"),
    # Reads exported state only: never the engine, the worker or a front end
    "pagedjax.inspection": ("pagedjax", "pagedjax.core", "pagedjax.models"),
    # The device side
    "pagedjax.worker": (
        "pagedjax",
        "pagedjax.core",
        "pagedjax.inspection",
        "pagedjax.lora",
        "pagedjax.models",
        "pagedjax.pallas_kernels",
        "pagedjax.structured_output",
        "pagedjax.utils",
    ),
    # Speculative decoding: proposers and the draft model's runner, over the worker
    "pagedjax.spec_decode": (
        "pagedjax",
        "pagedjax.core",
        "pagedjax.models",
        "pagedjax.worker",
    ),
    # The engine: the step loop over core/ and worker/, and the features it holds
    "pagedjax.engine": (
        "pagedjax",
        "pagedjax.core",
        "pagedjax.inspection",
        "pagedjax.lora",
        "pagedjax.models",
        "pagedjax.models.loading",
        "pagedjax.pallas_kernels",
        "pagedjax.pallas_kernels.native",
        "pagedjax.spec_decode",
        "pagedjax.structured_output",
        "pagedjax.utils",
        "pagedjax.worker",
    ),
    # An engine serving a front end (in a thread or a process): the engine, never a front end
    "pagedjax.engine.hosting": (
        "pagedjax",
        "pagedjax.engine",
        "pagedjax.metrics",
        "pagedjax.utils",
        "pagedjax.worker",
    ),
    # `pagedjax compile`: the engine's programs compiled for a TPU or GPU that is not here
    "pagedjax.aot": (
        "pagedjax",
        "pagedjax.engine",
        "pagedjax.models",
        "pagedjax.models.loading",
        "pagedjax.pallas_kernels",
        "pagedjax.worker",
    ),
    # `pagedjax bench`: runs LLM, engines and runners, or any OpenAI-compatible server over HTTP
    "pagedjax.bench": (
        "pagedjax",
        "pagedjax.core",
        "pagedjax.engine",
        "pagedjax.entrypoints",
        "pagedjax.lora.request",
        "pagedjax.models",
        "pagedjax.utils",
        "pagedjax.worker",
    ),
    # The front ends: LLM, the `pagedjax` command, the server's launch
    "pagedjax.entrypoints": (
        "pagedjax",
        "pagedjax.engine",
        "pagedjax.engine.hosting",
        "pagedjax.entrypoints.openai",
        "pagedjax.entrypoints.serve_ray",
        "pagedjax.lora",
        "pagedjax.metrics",
        "pagedjax.models",
        "pagedjax.models.loading",
        "pagedjax.utils",
        "pagedjax.worker",
    ),
    # The HTTP server codes against engine/client.py's EngineClient: never an engine or its host
    "pagedjax.entrypoints.openai": (
        "pagedjax",
        "pagedjax.core.request_queue",
        "pagedjax.engine.client",
        "pagedjax.engine.input_processor",
        "pagedjax.entrypoints.chat_template",
        "pagedjax.entrypoints.openai.tool_parsers",
        "pagedjax.lora.request",
        "pagedjax.lora.updates",
        "pagedjax.metrics",
        "pagedjax.models.loading",
        "pagedjax.worker.warmup",
    ),
    "pagedjax.entrypoints.openai.tool_parsers": (),
    # Ray Serve replicas: each a launched server (entrypoints/launch.py) behind an ingress
    "pagedjax.entrypoints.serve_ray": (
        "pagedjax.engine",
        "pagedjax.engine.hosting",
        "pagedjax.entrypoints",
        "pagedjax.entrypoints.openai",
        "pagedjax.models",
        "pagedjax.utils",
    ),
    # Models import nothing of the engine; kernels nothing of the models
    "pagedjax.models": ("pagedjax.models.loading", "pagedjax.pallas_kernels"),
    "pagedjax.models.loading": ("pagedjax.models",),
    "pagedjax.pallas_kernels": (
        "pagedjax.pallas_kernels.cpu",
        "pagedjax.pallas_kernels.native",
        "pagedjax.pallas_kernels.reference",
        "pagedjax.pallas_kernels.tpu",
        "pagedjax.pallas_kernels.triton",
    ),
    # One folder per backend, over the shared metadata and wrappers; none imports another's
    "pagedjax.pallas_kernels.cpu": (
        "pagedjax.pallas_kernels",
        "pagedjax.pallas_kernels.native",
        "pagedjax.pallas_kernels.reference",
    ),
    "pagedjax.pallas_kernels.native": (),
    "pagedjax.pallas_kernels.reference": ("pagedjax.pallas_kernels",),
    "pagedjax.pallas_kernels.tpu": ("pagedjax.pallas_kernels",),
    "pagedjax.pallas_kernels.triton": ("pagedjax.pallas_kernels",),
}
THIRD_PARTY_BANNED = {"pagedjax.core": ("jax", "jaxlib", "flax")}

# Arrows still to remove, each with its reason: left out of every check here, and the test
# fails once one is gone (so its entry goes too).
PENDING: dict[tuple[str, str], str] = {}


# ---- reading the sources ------------------------------------------------------------------------


def _module_name(prefix: str, top: Path, path: Path) -> str:
    parts = path.relative_to(top).with_suffix("").parts
    return ".".join([prefix, *(parts[:-1] if parts[-1] == "__init__" else parts)])


@functools.cache
def _sources() -> dict[str, tuple[str, bool]]:
    """module name -> (its source, whether it is a package's __init__)."""
    return {
        _module_name(prefix, top, p): (p.read_text(), p.name == "__init__.py")
        for prefix, top in TREES.items()
        for p in sorted(top.rglob("*.py"))
    }


def _imports(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """Every name the module imports anywhere in its file, relative imports made absolute.
    ``from a.b import c`` gives ``a.b.c`` where that is a module of ``known``, else ``a.b``
    (c is a name defined in a.b)."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return out


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _arrows(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules (of ``sources``) it imports, less PENDING's arrows. A module's
    own ancestors are left out: they are imported before it, whatever it says."""
    return {
        n: {
            m
            for m in _imports(n, src, pkg, set(sources))
            if m in sources and not _within(n, m) and (n, m) not in PENDING
        }
        for n, (src, pkg) in sources.items()
    }


# ---- cycles and folder loops --------------------------------------------------------------------


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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


def _folder_loops(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Per package, the cycles among its direct subpackages, each taken with everything under
    it: ``"pagedjax: pagedjax.a <-> pagedjax.b"``."""
    graph = _arrows(sources)
    packages = sorted(n for n, (_, pkg) in sources.items() if pkg)
    found = []
    for parent in packages:
        subs = [p for p in packages if p.rpartition(".")[0] == parent]

        def unit(module: str, subs=subs) -> str | None:
            return next((s for s in subs if _within(module, s)), None)

        folders: dict[str, set[str]] = {s: set() for s in subs}
        for n, targets in graph.items():
            if (a := unit(n)) is not None:
                folders[a] |= {b for t in targets if (b := unit(t)) not in (None, a)}
        found += [f"{parent}: {' <-> '.join(c)}" for c in _cycles(folders)]
    return found


def test_no_import_cycle():
    assert _cycles(_arrows(_sources())) == []


def test_no_folder_loop():
    assert _folder_loops(_sources()) == []


def test_the_cycle_checks_can_fail():
    """A cycle through a function-level import and one under TYPE_CHECKING, and a loop between
    two folders through modules that form no cycle themselves."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    planted = {
        "p": ("", True),
        "p.x": ("", True),
        "p.x.m": ("def f():\n    from p.y import n\n", False),
        "p.x.k": ("", False),
        "p.y": ("", True),
        "p.y.n": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..x import k\n",
            False,
        ),
    }
    assert _cycles(_arrows(planted)) == []
    assert _folder_loops(planted) == ["p: p.x <-> p.y"]
    planted["p.x.k"] = ("from p.x import m\n", False)
    planted["p.x.m"] = ("from . import k\n", False)
    assert _cycles(_arrows(planted)) == [["p.x.k", "p.x.m"]]


# ---- each package's rule ------------------------------------------------------------------------


def _owner(module: str, is_package: bool) -> str | None:
    """The rule a module follows: the longest ALLOWED key it lies within (a package's
    __init__ counts as ``package.__init__``, so the root's facade has a rule of its own)."""
    key = f"{module}.__init__" if is_package else module
    return max((k for k in ALLOWED if _within(key, k)), key=len, default=None)


def _allowed(target: str, own: str) -> bool:
    target_owner = _owner(target, target == ROOT_PACKAGE)
    if target_owner == own:
        return True
    return any(_within(target, e) and _owner(e, False) == target_owner for e in ALLOWED[own])


def _rule_violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    known = set(_sources()) | set(sources)
    found = []
    for name, (src, pkg) in sorted(sources.items()):
        own = _owner(name, pkg)
        banned = THIRD_PARTY_BANNED.get(own, ())
        for target in sorted(_imports(name, src, pkg, known)):
            if (name, target) in PENDING:
                continue
            ours = _within(target, ROOT_PACKAGE)
            if (ours and not _allowed(target, own)) or any(_within(target, b) for b in banned):
                found.append(f"{name} imports {target}")
    return found


def test_every_package_has_a_rule():
    packages = {
        f"{n}.__init__" if n == ROOT_PACKAGE else n for n, (_, p) in _sources().items() if p
    }
    assert packages | {"pagedjax", "pagedjax.__main__", "pagedjax.cli"} == set(ALLOWED)


def test_every_rule_names_a_module():
    known = set(_sources())
    for own, allowed in ALLOWED.items():
        for entry in allowed:
            assert entry in known, f"{own}'s rule names {entry}, which is no module"


def test_each_package_imports_only_what_its_rule_allows():
    assert _rule_violations(_sources()) == []


def test_the_rules_can_fail():
    """Planted imports that break rules: at module level, inside a function and under
    TYPE_CHECKING; a subpackage reached through its parent's name; jax in core/."""
    sources = {
        "pagedjax.core.scheduler": (
            "import jax.numpy as jnp\nfrom pagedjax.worker import runner\n"
            "if TYPE_CHECKING:\n    from pagedjax.engine import request\n",
            False,
        ),
        "pagedjax.pallas_kernels.k": ("def f():\n    from pagedjax.core import sequence\n", False),
        "pagedjax.entrypoints.openai.x": (
            "from pagedjax.engine.hosting import engine_loop\n",
            False,
        ),
        "pagedjax.models.loading.y": ("from ..decoder import f\nfrom ... import config\n", False),
        "pagedjax.worker.z": ("from pagedjax.core.block_manager import BlockManager\n", False),
    }
    assert _rule_violations(sources) == [
        "pagedjax.core.scheduler imports jax.numpy",
        "pagedjax.core.scheduler imports pagedjax.engine.request",
        "pagedjax.core.scheduler imports pagedjax.worker.runner",
        "pagedjax.entrypoints.openai.x imports pagedjax.engine.hosting.engine_loop",
        "pagedjax.models.loading.y imports pagedjax.config",
        "pagedjax.pallas_kernels.k imports pagedjax.core.sequence",
    ]


def test_pending_arrows_are_still_there():
    """An arrow in PENDING that the sources no longer have is removed from PENDING."""
    sources = _sources()
    for importer, imported in PENDING:
        assert imported in _imports(importer, *sources[importer], set(sources)), imported


# ---- the engine's private attributes ------------------------------------------------------------


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


def test_only_the_engine_reads_its_private_attributes():
    offenders = {}
    for name, (src, _) in _sources().items():
        if name != "pagedjax.engine.llm_engine" and (
            reads := _engine_private_reads(ast.parse(src))
        ):
            offenders[name] = reads
    assert offenders == {}


def test_the_private_read_check_can_fail():
    code = "def f(self):\n    e = self.engine\n    e._fail(1)\n    engine._rng\n"
    assert len(_engine_private_reads(ast.parse(code))) == 2
