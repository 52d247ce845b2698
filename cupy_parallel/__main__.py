"""``python -m cupy_parallel``: the ``cupy-parallel`` command."""

from __future__ import annotations

import sys

from cupy_parallel._tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
