"""docs/BENCHMARKS.md holds one current figure per benchmark; the dated record lives under
docs/benchmarks/, and every reference to either still leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "BENCHMARKS.md"
MAX_LINES = 700  # the page's stated bound; history goes to docs/benchmarks/
# A dated diary heading: "## Something measured (2026-12-05, fourth)".
DATED_HEADING = re.compile(r"^#{2,4} .*\(\d{4}-\d{2}-\d{2}[^)]*\)\s*$")
# A Markdown link to a file of this repository (no scheme, no bare anchor).
LOCAL_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)(?:#[^)]*)?\)")
# Code and docs point at a section as: docs/BENCHMARKS.md, "Quantization".
SECTION_REF = re.compile(r'docs/BENCHMARKS\.md,\s+"([^"]+)"')
REFERRING = ("pagedjax", "models", "pallas_kernels", "benchmarks", "notebooks")


def headings(text: str) -> list[str]:
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]


def test_the_page_stays_within_its_bound():
    lines = PAGE.read_text().count("\n")
    assert lines <= MAX_LINES, f"docs/BENCHMARKS.md has {lines} lines (at most {MAX_LINES})"


def test_the_page_holds_no_dated_diary_sections():
    dated = [h for h in PAGE.read_text().splitlines() if DATED_HEADING.match(h)]
    assert not dated, f"dated sections belong in docs/benchmarks/: {dated}"


def test_the_page_links_its_history():
    linked = set(LOCAL_LINK.findall(PAGE.read_text()))
    history = {f"benchmarks/{p.name}" for p in (ROOT / "docs" / "benchmarks").glob("*.md")}
    assert history, "docs/benchmarks/ holds the record"
    assert history <= linked, f"history not linked from the page: {sorted(history - linked)}"


def test_every_local_link_in_the_docs_resolves():
    broken = []
    for doc in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]:
        for target in LOCAL_LINK.findall(doc.read_text()):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to nothing: {broken}"


def test_every_named_section_of_the_page_exists():
    sections = headings(PAGE.read_text())
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for top in REFERRING:
        sources += sorted(p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".ipynb"))
    missing = []
    for source in sources:
        text = " ".join(source.read_text().split())  # a reference may wrap across lines
        for title in SECTION_REF.findall(text):
            if not any(title in heading for heading in sections):
                missing.append(f'{source.relative_to(ROOT)}: "{title}"')
    assert not missing, f"references to sections docs/BENCHMARKS.md does not have: {missing}"
