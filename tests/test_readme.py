"""Every ``python`` code block of the README and the docs pages runs as written.

The pages are ``README.md`` and the MyST pages under ``docs/`` (the site's getting-started page,
guides and porting guide); each block runs as if pasted into a fresh interpreter.

A block made of ``>>>`` lines is a doctest: it runs with empty globals (so it must import what it
uses) and its printed output and exceptions must match. Any other block is a script: it runs in a
new ``python`` process in an empty directory and must exit 0. A script that starts with a
``# example.py`` comment is also run as that file, under ``mpiexec -n 2`` when it calls
``init_process_group("mpi")`` and MPI is installed, as the pages tell readers to do. A page
marked ``<!-- examples: one session -->`` has script blocks that build on each other: they run
as one script, in order. A block that imports a public module this checkout does not have (a
page written for a module that lands with another change) is skipped, naming the module.
"""

from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cupy_parallel._tools.launch import find_mpiexec

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_IMPORTS = re.compile(r"^\s*(?:>>> )?(?:from|import) (cupy_parallel[\w.]*)", re.MULTILINE)


def _pages() -> list[Path]:
    generated = DOCS / "api" / "generated"
    pages = [p for p in sorted(DOCS.rglob("*.md")) if generated not in p.parents]
    own = _pages_with_their_own_test()
    return [README, *(p for p in pages if "_build" not in p.parts and p.name not in own)]


def _pages_with_their_own_test() -> set[str]:
    """Guide pages a test module of their own runs (as one session: its blocks build on each
    other, as a notebook's cells do), named in that module (``tests/test_guide_*.py``)."""
    named = set()
    for test in Path(__file__).parent.glob("test_guide_*.py"):
        named |= set(re.findall(r"[\w-]+\.md", test.read_text(encoding="utf-8")))
    return named


SESSION = "<!-- examples: one session -->"
"""A page holding this comment has script blocks that build on each other (as a notebook's
cells): they run in order, as one script (its doctest blocks still run each on its own)."""


def _blocks() -> list[tuple[Path, int, str]]:
    found = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        blocks = [
            (page, text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)
        ]
        if SESSION in text:
            scripts = [b for b in blocks if not b[2].lstrip().startswith(">>>")]
            blocks = [b for b in blocks if b not in scripts]
            if scripts:
                blocks.append((page, scripts[0][1], "".join(code for _, _, code in scripts)))
        found += blocks
    return found


BLOCKS = _blocks()


def _where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


# Top-level names of this release's training state (API.md 5c), which land with their own change
_LANDING = re.compile(
    r"\b(?:cp|cupy_parallel)\.(save|load|clip_grad_norm|FullyShardedDataParallel)\("
)


def _missing_module(code: str) -> str | None:
    import cupy_parallel

    absent = [name for name in _LANDING.findall(code) if not hasattr(cupy_parallel, name)]
    if absent:
        return f"cupy_parallel.{absent[0]}"
    missing = [_absent(name) for name in _IMPORTS.findall(code)]
    return next((name for name in missing if name is not None), None)


def _absent(module: str) -> str | None:
    """The part of ``module`` (a cupy_parallel module) that does not import, or None."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith("cupy_parallel"):
            return error.name
        raise
    return None


def test_the_readme_has_code_to_run() -> None:
    assert sum(page == README for page, _, _ in BLOCKS) >= 2


def test_the_readme_stays_a_first_screen() -> None:
    assert README.stat().st_size <= 12 * 1024


def test_every_guide_page_has_code_to_run() -> None:
    with_code = {page for page, _, _ in BLOCKS}
    for page in sorted((DOCS / "guides").glob("*.md")):
        if page.stem in ("index", "contributing"):  # the generated contents; how to contribute
            continue
        if page.name in _pages_with_their_own_test():
            continue
        assert page in with_code, f"{page.relative_to(ROOT)} has no python example"


def _params() -> list[Any]:
    """One case per block; the scripts (a process each, some under mpiexec) are marked slow."""
    return [
        pytest.param(
            page,
            line,
            code,
            id=_where(page, line),
            marks=() if code.lstrip().startswith(">>>") else (pytest.mark.slow,),
        )
        for page, line, code in BLOCKS
    ]


@pytest.mark.parametrize(("page", "line", "code"), _params())
def test_block_runs_as_written(page: Path, line: int, code: str, tmp_path: Path) -> None:
    missing = _missing_module(code)
    if missing is not None:
        pytest.skip(f"{missing} is not in this checkout")
    where = _where(page, line)
    if code.lstrip().startswith(">>>"):
        parser = doctest.DocTestParser()
        test = parser.get_doctest(code, {}, where, str(page), line)
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
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)  # this checkout's package, as the pages describe it
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{done.stderr}"
