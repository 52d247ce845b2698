"""Every ``python`` code block of the README runs as written, pasted into a fresh interpreter.

A block made of ``>>>`` lines is a doctest: it runs with empty globals (so it must import what it
uses) and its printed output and exceptions must match. Any other block is a script: it runs in a
new ``python`` process in an empty directory and must exit 0. A script that starts with a
``# example.py`` comment is also run as that file, under ``mpiexec -n 2`` when it calls
``init_process_group("mpi")`` and MPI is installed, as the README tells readers to do.
"""

from __future__ import annotations

import doctest
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_parallel._tools.launch import find_mpiexec

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


BLOCKS = _blocks()


def test_the_readme_has_code_to_run() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.slow
@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs_as_written(line: int, code: str, tmp_path: Path) -> None:
    if code.lstrip().startswith(">>>"):
        parser = doctest.DocTestParser()
        test = parser.get_doctest(code, {}, f"README.md:{line}", str(README), line)
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        runner = doctest.DocTestRunner(optionflags=flags)
        runner.run(test, out=lambda text: pytest.fail(text, pytrace=False))
        assert runner.failures == 0
        return
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    command = [sys.executable, str(script)]
    mpiexec = find_mpiexec()  # the mpich wheel's beside this Python first, as the launcher does
    if re.match(r"# \w+\.py\n", code) and 'init_process_group("mpi")' in code and mpiexec:
        command = [mpiexec, "-n", "2", *command]
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"README.md:{line} failed:\n{done.stdout}\n{done.stderr}"
