"""What a module imports itself, checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def assert_imports_no_jax(*modules: str) -> None:
    """Importing ``modules`` (dotted names under pagedjax) loads no jax, jaxlib or flax. A bare
    package stands in for pagedjax/__init__.py (which imports the engine, hence jax): what is
    checked is what these modules import themselves."""
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('pagedjax')\n"
        f"pkg.__path__ = [{str(REPO / 'pagedjax')!r}]\n"
        "sys.modules['pagedjax'] = pkg\n"
        f"import {', '.join(modules)}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
