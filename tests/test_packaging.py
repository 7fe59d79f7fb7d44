"""What gets installed: one import name, every module, no tests; `python -m pagedjax`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The folders that install as pagedjax (models/ and pallas_kernels/ as its subpackages).
SOURCES = {
    "pagedjax": "pagedjax",
    "models": "pagedjax/models",
    "pallas_kernels": "pagedjax/pallas_kernels",
}


def _run(args, cwd, env=None):
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_import_from_a_folder_with_its_own_models_and_kernels(tmp_path):
    for name in ("models.py", "pallas_kernels.py", "utils.py"):
        (tmp_path / name).write_text("raise ImportError('the user project module was imported')\n")
    r = _run(
        ["-c", "from pagedjax import LLM; import pagedjax.models.llama, pagedjax.pallas_kernels"],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr


def test_a_checkout_shadowing_the_installed_package_says_what_to_do(tmp_path):
    """After a non-editable ``pip install .``, Python started in the clone's root imports the
    clone's pagedjax/ folder, which has no models/ or pallas_kernels/ (they install into the
    package). Here ``-S`` leaves the installed package out, as the folder shadows it there."""
    shutil.copytree(ROOT / "pagedjax", tmp_path / "pagedjax")
    r = _run(["-S", "-c", "import pagedjax"], cwd=tmp_path)
    assert r.returncode != 0
    assert "shadows the installed package" in r.stderr, r.stderr[-2000:]
    assert "pip install -e" in r.stderr and "run Python from another folder" in r.stderr
    assert "No module named" not in r.stderr


def test_python_m_pagedjax_is_the_command(tmp_path):
    r = _run(["-m", "pagedjax", "--help"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for command in ("generate", "serve", "bench"):
        assert command in r.stdout
    r = _run(["-m", "pagedjax", "serve", "--help"], cwd=tmp_path)
    assert r.returncode == 0 and "--served-model-name" in r.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("pagedjax-*.whl")
    return whl


def test_wheel_holds_one_package_and_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"pagedjax"}
    want = {
        f"{dest}/{p.relative_to(ROOT / src).as_posix()}"
        for src, dest in SOURCES.items()
        for pattern in ("*.py", "*.cc", "*.h")  # the native CPU kernels' sources build on first use
        for p in (ROOT / src).rglob(pattern)
        if "__pycache__" not in p.parts
    }
    assert want <= set(names), sorted(want - set(names))
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "pagedjax/tests"))]
    dist_info = next(t for t in tops if t.endswith(".dist-info"))
    assert f"{dist_info}/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "Classifier: Programming Language :: Python :: 3.11" in metadata
    assert "## Two commands" in metadata  # the README is the long description


def test_installed_wheel_imports_and_runs_from_elsewhere(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = "import pagedjax, pagedjax.models.loader as m; print(pagedjax.__file__, m.__file__)"
    r = _run(["-c", code], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert all(path.startswith(str(target)) for path in r.stdout.split())
    r = _run(["-m", "pagedjax", "generate", "--help"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
