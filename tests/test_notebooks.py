"""The notebooks run top to bottom (small settings, a tiny random-weight model) with nbclient."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from hf_models import make_tiny_model, save_word_tokenizer
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("nb_tiny")
    make_tiny_model("llama_gqa", path, max_position_embeddings=1024)
    save_word_tokenizer(path)
    return str(path)


@pytest.mark.parametrize("name", ["01_tour.ipynb", "02_paper_figures.ipynb"])
def test_notebook_runs(name, tiny, monkeypatch):
    monkeypatch.setenv("PAGEDJAX_NB_MODEL", tiny)
    monkeypatch.setenv("PAGEDJAX_NB_MAX_TOKENS", "12")
    monkeypatch.setenv("PAGEDJAX_NB_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit notebooks with outputs stripped"
    )
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    print(f"{name}: {time.perf_counter() - start:.1f} s")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
