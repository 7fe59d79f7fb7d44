"""Import paths for a run from a checkout, installed or not: the repository and benchmarks/ on
sys.path, and for an uninstalled checkout a temporary tree laying out ``pagedjax`` as an install
does. Imported first (the package's ``__init__``), before anything imports pagedjax."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

for _p in (ROOT, ROOT / "benchmarks"):  # run from anywhere, nothing installed
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def installed_layout() -> bool:
    """Whether ``import pagedjax.pallas_kernels`` works here as things stand: pagedjax installed
    (pallas_kernels/ inside the package, or an editable install's finder mapping it)."""
    import importlib.machinery
    import importlib.util

    spec = importlib.util.find_spec("pagedjax")  # a top-level spec: nothing is executed
    if spec is None or spec.origin is None:
        return False
    if (Path(spec.origin).parent / "pallas_kernels").is_dir():
        return True
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
            continue
        with contextlib.suppress(Exception):
            if finder.find_spec("pagedjax.pallas_kernels", None) is not None:
                return True
    return False


def source_tree() -> Path | None:
    """For a checkout that is not installed: a temporary directory holding ``pagedjax/`` as an
    install lays it out (links to each entry of pagedjax/, plus models/ and pallas_kernels/,
    which pyproject's package-dir maps to pagedjax.models and pagedjax.pallas_kernels), put
    first on sys.path; None when pagedjax is installed."""
    if installed_layout():
        return None
    tree = Path(tempfile.mkdtemp(prefix="pagedjax-source-"))
    atexit.register(shutil.rmtree, tree, True)  # the links only: rmtree follows none
    (tree / "pagedjax").mkdir()
    for child in (ROOT / "pagedjax").iterdir():
        if child.name != "__pycache__":
            (tree / "pagedjax" / child.name).symlink_to(child)
    for name in ("models", "pallas_kernels"):
        (tree / "pagedjax" / name).symlink_to(ROOT / name)
    sys.path.insert(0, str(tree))
    # Imported now, so that it stays the package even after a module that puts the checkout
    # itself first on sys.path (benchmarks/paged_attention_gpu.py does).
    importlib.import_module("pagedjax")
    return tree


SOURCE_TREE = source_tree()
