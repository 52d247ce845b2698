"""The MPI workers (``tests/mpi_workers``) on thread ranks (``spawn`` in this process) or processes.

``run_threads(worker, ranks, *argv, timeout=...)`` runs ``worker.rank_main(rank, argv)`` on
``ranks`` thread ranks and returns what ``subprocess.run`` of ``mpiexec -n ranks python
worker.py *argv`` returns (``returncode``, ``stdout``, ``stderr``), so that one test reads both:
the ranks' prints are captured (all ranks into one stream, as ``mpiexec`` merges them); the
return code is 0 when every rank returned 0 (or ``None``), the rank's code when spawn failed
because a rank exited with one (``sys.exit(n)``), else 1; spawn's error, its cause and the
cause's traceback are appended to ``stderr``. ``timeout`` is the group timeout the worker would
have passed to ``init_process_group`` (spawn makes the world).

``run_mpiexec(worker, ranks, *argv, timeout=...)`` is the same run under ``mpiexec`` (warnings
are errors, and the workers import this checkout's package), with the same :class:`Outcome`;
:func:`printed` puts either's output in a form to compare.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from cupy_parallel._tools.launch import find_mpiexec
from cupy_parallel.distributed import spawn

if TYPE_CHECKING:
    from types import ModuleType

WORKERS = Path(__file__).parent / "mpi_workers"
ROOT = Path(__file__).resolve().parent.parent  # this checkout
MPIEXEC = find_mpiexec()
_loaded: dict[str, ModuleType] = {}


class Outcome(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    error: BaseException | None


def worker(name: str) -> ModuleType:
    """``tests/mpi_workers/<name>.py`` as a module (loaded once)."""
    module = _loaded.get(name)
    if module is None:
        if str(WORKERS) not in sys.path:  # the workers' own imports (tally), as for a script
            sys.path.insert(0, str(WORKERS))
        spec = importlib.util.spec_from_file_location(f"thread_{name}", WORKERS / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _loaded[name] = module
    return module


def run_threads(
    name: str,
    ranks: int,
    *argv: str,
    timeout: float,
    env: dict[str, str] | None = None,
    backend: str = "threads",
) -> Outcome:
    """Run worker ``name`` with ``argv`` on ``ranks`` thread ranks (see the module).

    ``backend="nccl"``: NCCL ranks, inside the caller's ``simulated_cuda``.
    """
    module = worker(name)
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    out, err = io.StringIO(), io.StringIO()
    error: BaseException | None = None
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            codes = spawn(module.rank_main, ranks, (list(argv),), timeout=timeout, backend=backend)
        returncode = max(int(code or 0) for code in codes)
    except RuntimeError as failed:
        error = failed
        cause = failed.__cause__
        returncode = 1
        if isinstance(cause, SystemExit) and isinstance(cause.code, int):
            returncode = cause.code
        err.write(f"spawn raised RuntimeError: {failed}\n")
        if cause is not None:
            err.write("".join(traceback.format_exception(cause)))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return Outcome(returncode, out.getvalue(), err.getvalue(), time.monotonic() - start, error)


def run_mpiexec(
    name: str, ranks: int, *argv: str, timeout: float, env: dict[str, str] | None = None
) -> Outcome:
    """``mpiexec -n ranks python tests/mpi_workers/<name>.py *argv``, ``timeout`` its deadline.

    Warnings are errors; the workers import this checkout's package, whatever is installed.
    """
    assert MPIEXEC is not None, "the caller skips without mpiexec"
    environment = {**os.environ, "PYTHONWARNINGS": "error", **(env or {})}
    paths = (str(ROOT), environment.get("PYTHONPATH", ""))
    environment["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    command = [str(MPIEXEC), "-n", str(ranks), sys.executable, str(WORKERS / f"{name}.py"), *argv]
    start = time.monotonic()
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=environment, check=False
    )
    return Outcome(done.returncode, done.stdout, done.stderr, time.monotonic() - start, None)


def printed(out: str) -> list[str]:
    """What the ranks printed, as a sorted list of pieces.

    Ranks print at once (processes through mpiexec, threads into one stream), so one rank's
    line can land inside another's: the text is cut before every start of a line the workers
    print, wherever it is.
    """
    text = out.replace("\n", "")
    pieces = re.split(r"(?=rank \d+: |CAUGHT |OK |BAD |NO ERROR )", text)
    return sorted(p for p in pieces if p)
