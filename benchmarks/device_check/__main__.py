"""``python3 benchmarks/device_check ...`` (the folder run as a script) or, with benchmarks/ on
the path, ``python3 -m device_check ...``."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: its own directory is sys.path[0], not benchmarks/
    HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    sys.path.insert(0, str(HERE.parent))

from device_check.cli import run  # noqa: E402

sys.exit(run())
