"""``python -m pagedjax ...`` is the ``pagedjax`` command."""

import sys

from pagedjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
