"""Benchmarks: throughput, KV memory utilisation, sharing."""

import json
from collections.abc import Callable


def emit(result: dict, as_json: bool, print_report: Callable[[dict], None]) -> int:
    """Print a benchmark's result as JSON or as its human-readable report; the exit code."""
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0
