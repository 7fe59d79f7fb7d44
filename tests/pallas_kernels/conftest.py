"""Collect each kernel test's relative error against the float32 reference; print a summary."""

from __future__ import annotations

import collections

import pytest

_ERRORS: list[tuple[str, str, float]] = []  # (kernel, dtype, rel_err)


@pytest.fixture
def record_error(record_property):
    """record_error(kernel, dtype, err): keep it for the summary and the junit report."""

    def record(kernel: str, dtype: str, err: float) -> None:
        _ERRORS.append((kernel, dtype, err))
        record_property(f"rel_err[{kernel},{dtype}]", err)

    return record


def pytest_terminal_summary(terminalreporter):
    if not _ERRORS:
        return
    groups = collections.defaultdict(list)
    for kernel, dtype, err in _ERRORS:
        groups[kernel, dtype].append(err)
    terminalreporter.write_sep("-", "kernels vs float32 reference: max|out - ref| / max|ref|")
    for (kernel, dtype), errs in sorted(groups.items()):
        terminalreporter.write_line(
            f"{kernel:<14} {dtype:<9} cases={len(errs):<3} max={max(errs):.2e} "
            f"median={sorted(errs)[len(errs) // 2]:.2e}"
        )
