"""Type checkers: ``mypy --strict`` on a user's script and on ``assert_type`` pins of the API.

``tests/typing/user_script.py`` is a training script written against the public API (comm and
nested scatter/gather, DataParallel, Tape, grad, ops, to_device, a custom Function, distributed
and a store) with no ``cast`` or ``type: ignore``; ``tests/typing/check_types.py`` pins what the
API returns (``Tape.gradient(loss, params)`` has ``params``' type, ``all_reduce(x)`` is ``None``
and ``all_reduce(x, async_op=True)`` a ``Work``, ...) and marks calls a checker must refuse. The
oracle is mypy itself: with the library's arrays typed ``Any`` the script fails ``--strict``
(``no-any-return``) and the pins fail (``assert-type``). ``cupy_parallel`` is found through
``MYPYPATH`` and its own errors are silenced (``tests/typing/mypy.ini``), as mypy silences an
installed package's; the repository's ``mypy`` run checks the library itself.

The script also runs (on two host devices, with a one-process MPI world), so the types it
states are the types it gets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")
pytestmark = pytest.mark.slow  # a cold mypy run, and the script run in a process

ROOT = Path(__file__).resolve().parent.parent
TYPING = ROOT / "tests" / "typing"
FILES = ("user_script.py", "check_types.py")


def _mypy() -> subprocess.Popen[str]:
    """One ``mypy --strict`` run on both files, started (it takes about 20 s of CPU, cold)."""
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--config-file",
        str(TYPING / "mypy.ini"),
        "--cache-dir",
        str(ROOT / ".mypy_cache" / "typing-tests"),
        "--no-color-output",
        "--no-error-summary",
        *(str(TYPING / name) for name in FILES),
    ]
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


_started: list[subprocess.Popen[str]] = []


def start_mypy() -> None:
    """Start the mypy run now, in the background (once).

    conftest.py calls this once the tests are collected, when these are among them: the run
    then overlaps the tests before these (on 2 cores, the suite's wall time loses it), and
    :func:`mypy_output` only waits for what is left.
    """
    if not _started:
        _started.append(_mypy())


def stop_mypy() -> None:
    """End a run nobody waited for (the session stopped before these tests): no stray mypy."""
    for run in _started:
        if run.poll() is None:
            run.kill()
        run.communicate()


@pytest.fixture(scope="module")
def mypy_output() -> dict[str, list[str]]:
    """mypy's messages per checked file, from one ``mypy --strict`` run on both files."""
    start_mypy()
    run = _started[0]
    try:
        stdout, stderr = run.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        run.kill()
        raise
    done = subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)
    assert done.returncode in {0, 1}, f"mypy crashed:\n{done.stdout}\n{done.stderr}"
    messages: dict[str, list[str]] = {name: [] for name in FILES}
    for line in done.stdout.splitlines():
        name = Path(line.split(":", 1)[0]).name
        messages.setdefault(name, []).append(line)
    assert set(messages) == set(FILES), f"mypy reported on other files:\n{done.stdout}"
    return messages


def test_user_script_passes_mypy_strict(mypy_output: dict[str, list[str]]) -> None:
    assert mypy_output["user_script.py"] == [], "\n".join(mypy_output["user_script.py"])


def test_public_api_types_are_the_pinned_ones(mypy_output: dict[str, list[str]]) -> None:
    assert mypy_output["check_types.py"] == [], "\n".join(mypy_output["check_types.py"])


def test_the_pins_include_refused_calls() -> None:
    """check_types.py marks misuse a checker must refuse; --strict errs on a needless ignore."""
    text = (TYPING / "check_types.py").read_text(encoding="utf-8")
    for code in ("arg-type", "call-overload", "call-arg", "attr-defined"):
        assert f"# type: ignore[{code}]" in text, code


def test_user_script_runs_on_host_devices() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CUPY_PARALLEL_PLATFORM": "host",
        "OPENBLAS_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(TYPING / "user_script.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    word, first, last = done.stdout.split()
    assert word == "ok"
    assert float(last) < float(first)


def test_array_at_run_time_is_is_array() -> None:
    import numpy as np

    import cupy_parallel as cp

    h = cp.to_device(np.ones(2), "host:1")
    assert (
        [isinstance(v, cp.Array) for v in (np.ones(2), h, [1.0], 1.0, np.float64(1))]
        == [cp.is_array(v) for v in (np.ones(2), h, [1.0], 1.0, np.float64(1))]
        == [True, True, False, False, False]
    )
    with pytest.raises(TypeError, match=r"cupy_parallel.Array is a type for annotations"):
        cp.Array()
