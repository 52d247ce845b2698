"""The package's layers hold: import-linter's contracts in pyproject.toml, run as a test.

The contracts forbid import cycles at any depth, any import from a lower layer of
``cupy_parallel._src`` into a higher one (every import counts, those under ``TYPE_CHECKING`` and
inside functions too), and any import of the public shells or the CLI from the code.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_import_contract_is_kept() -> None:
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(lint).exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    result = subprocess.run(
        [lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout
    assert "3 kept, 0 broken" in result.stdout
