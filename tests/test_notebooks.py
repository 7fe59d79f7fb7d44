"""The notebooks run top to bottom, and the committed ones carry current outputs.

Regular runs execute them fast (a tiny random-weight model and small settings, through the
PAGEDJAX_NB_* variables); the slow test runs them as a user does, with nothing set (the embedded
SmolLM2-135M-Instruct). ``python tests/test_notebooks.py [name ...]`` executes them that way and
writes them back with their outputs and, in their metadata, a hash of their code cells, which
``test_committed_outputs_are_current`` compares with the sources.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
FAST_SETTINGS = ("PAGEDJAX_NB_MODEL", "PAGEDJAX_NB_MAX_TOKENS", "PAGEDJAX_NB_SMALL")


def code_hash(nb) -> str:
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    return hashlib.sha256("\0".join(sources).encode()).hexdigest()


def execute(name: str, timeout: int) -> tuple[nbformat.NotebookNode, float]:
    """Run a notebook in a fresh kernel (with this process's environment); (notebook, seconds)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    return nb, time.perf_counter() - start


def errors(nb) -> list[str]:
    return [
        f"{o.ename}: {o.evalue}"
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.output_type == "error"
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import make_tiny_model, save_word_tokenizer

    path = tmp_path_factory.mktemp("nb_tiny")
    make_tiny_model("llama_gqa", path, max_position_embeddings=1024)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    save_word_tokenizer(path, chat_template=template)
    return str(path)


def test_all_notebooks_are_listed():
    assert NAMES == ["01_tour.ipynb", "02_paper_figures.ipynb", "03_serving_under_load.ipynb"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tiny, monkeypatch):
    monkeypatch.setenv("PAGEDJAX_NB_MODEL", tiny)
    monkeypatch.setenv("PAGEDJAX_NB_MAX_TOKENS", "12")
    monkeypatch.setenv("PAGEDJAX_NB_SMALL", "1")
    nb, seconds = execute(name, timeout=300)
    print(f"{name}: {seconds:.1f} s")
    assert not errors(nb)


@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_are_current(name):
    """Committed with the outputs of a run with the embedded model, of these very code cells
    (rerun ``python tests/test_notebooks.py NAME`` after changing one), plots included."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    run = nb.metadata.get("pagedjax", {})
    assert run.get("code_sha256") == code_hash(nb), f"{name}: outputs are stale, rerun it"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{name}: not every cell ran"
    assert not errors(nb)
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{name}: no plot in the outputs"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_as_a_user_runs_it(name, monkeypatch):
    """Nothing set: the embedded model and full settings."""
    for var in FAST_SETTINGS:
        monkeypatch.delenv(var, raising=False)
    nb, seconds = execute(name, timeout=1800)
    print(f"{name}: {seconds:.1f} s with the embedded model")
    assert not errors(nb)


def main(names: list[str]) -> int:
    """Execute notebooks as a user does and write them back with outputs and code hash."""
    for var in FAST_SETTINGS:
        os.environ.pop(var, None)
    for name in names or NAMES:
        nb, seconds = execute(name, timeout=1800)
        if errors(nb):
            print(f"{name}: {errors(nb)}", file=sys.stderr)
            return 1
        nb.metadata["pagedjax"] = {"code_sha256": code_hash(nb), "seconds": round(seconds, 1)}
        nbformat.write(nb, NOTEBOOKS / name)
        print(f"{name}: {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
