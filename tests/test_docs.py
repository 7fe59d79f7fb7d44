"""docs/ARCHITECTURE.md names the code as it is: every file or folder it points to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("pagedjax", "models", "pallas_kernels", "benchmarks", "tests", "docs", "notebooks")
# A repository path in backticks or plain text: a known top folder, then / and more.
PATH = re.compile(rf"\b(?:{'|'.join(TOP)})/[\w./-]*")
# Short forms the page uses inside a section about pagedjax/: core/..., worker/..., ...
SHORT = re.compile(r"(?<![\w/])(?:core|worker|entrypoints|spec_decode)/[\w./-]*")
# A bare module name (`request.py`): it must be a file somewhere in the installed code.
BARE = re.compile(r"(?<![\w/.])[a-z_]+\.py\b")


def named_paths(text: str) -> set[str]:
    found = {m.group(0).rstrip(".") for m in PATH.finditer(text)}
    found |= {"pagedjax/" + m.group(0).rstrip(".") for m in SHORT.finditer(text)}
    return {p for p in found if not p.endswith("/...")}


def test_every_path_in_the_architecture_page_exists():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paths = named_paths(text)
    assert len(paths) > 20, sorted(paths)  # the page does point at the code
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_bare_module_name_in_the_architecture_page_exists():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    names = {m.group(0) for m in BARE.finditer(text)}
    assert len(names) > 10, sorted(names)
    have = {p.name for top in TOP[:3] for p in (ROOT / top).rglob("*.py")}
    missing = sorted(names - have)
    assert not missing, f"docs/ARCHITECTURE.md names modules that do not exist: {missing}"


def test_a_moved_file_is_caught():
    assert named_paths("see `worker/no_such_module.py` and pallas_kernels/gone/") == {
        "pagedjax/worker/no_such_module.py",
        "pallas_kernels/gone/",
    }
