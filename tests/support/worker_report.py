"""Run a test's worker in a fresh Python process on N host devices and read back its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_reporting_worker(argv: list[str], num_devices: int, timeout: float) -> dict:
    """Run ``python *argv`` with ``num_devices`` CPU devices; the JSON of its ``REPORT `` line."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}",
        "JAX_PLATFORMS": "cpu",
    }
    result = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])
