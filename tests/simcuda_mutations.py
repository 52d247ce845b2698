"""Mutation check of the CUDA ordering code against the simulated CUDA's race checker.

Run ``python tests/simcuda_mutations.py`` from the repository root (about a minute; arguments
select the mutations whose line holds one of them, e.g. ``python tests/simcuda_mutations.py
wait_event``). For every
single stream-ordering call of the library (``wait_event``, ``record``, ``synchronize``,
``wait_stream``, the pinned release and the per-thread hand-off), it copies the tree, removes that
one call, runs the CUDA tests on the simulator and prints which tests fail. A call whose removal
fails no test would be an ordering the tests do not check. Not collected by pytest (no ``test_``
prefix): it runs the suite dozens of times.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_simcuda_paths.py",
    "tests/test_comm_gpu.py",
    "tests/test_simcuda.py",
    "tests/test_parallel.py",
    "tests/test_functions.py",
    "tests/test_mpi_cuda_aware.py",
]
MPI = "cupy_parallel/_src/distributed/"
CUDA = "cupy_parallel/_src/cuda/"

# (file, the exact line, what replaces it)
MUTATIONS = [
    (CUDA + "streams.py", "        event.record(stream)", "        pass"),
    (CUDA + "streams.py", "        waiter.wait_event(event)", "        pass"),
    (
        CUDA + "streams.py",
        "            current_stream(self._device).wait_event(self._ready)",
        "            pass",
    ),
    (
        CUDA + "streams.py",
        "            self._done = record_event(current_stream(self._device), self._device)",
        "            self._done = None",
    ),
    (
        CUDA + "streams.py",
        "                current_stream(self._device).wait_event(self._done)",
        "                pass",
    ),
    ("cupy_parallel/_src/parallel.py", "            handoff.finish()", "            pass"),
    (CUDA + "pinned.py", "    stream.launch_host_func(_finish, token)", "    pass"),
    # The MPI backend with CuPy arrays: the synchronisation before posting to a CUDA-aware MPI,
    # staging on the array's GPU, the backend's own work on each array's GPU, peer copies.
    (
        MPI + "mpi_staging.py",
        "                current_stream(device).synchronize()",
        "                pass",
    ),
    (
        MPI + "mpi_staging.py",
        "    with arg.device:  # on the current stream of the array's GPU (get's default stream)",
        "    if True:",
    ),
    # Which calls a CUDA-aware MPI takes device memory in, per library (issue 37).
    (MPI + "mpi_staging.py", "    if primitive not in ON_DEVICE[mpi_library()]:", "    if False:"),
    (
        MPI + "mpi_staging.py",
        '            return not (dtype.kind == "f" or is_bfloat16(dtype))',
        "            return True",
    ),
    (MPI + "mpi.py", "        with _on(acc):", "        if True:"),
    (MPI + "mpi.py", "        with _on(src):", "        if True:"),
    (MPI + "mpi.py", "    with _on(total):", "    if True:"),
    (
        MPI + "mpi.py",
        "        copies.peer(target, dst.device.id, source, src.device.id, None)",
        "        dst.data.copy_from_device(src.data, src.nbytes)",
    ),
] + [
    (CUDA + "copies.py", line, re.sub(r"\S.*", "pass", line))
    for line in (ROOT / CUDA / "copies.py").read_text().splitlines()
    if re.match(r"\s+(wait_stream|release_after)\(", line)
]


def run(tree: Path) -> list[str]:
    """The failing tests (parameters dropped) of the CUDA test modules in ``tree``."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *TESTS],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    names = re.findall(r"^FAILED (\S+?)(?:\[| - |$)", result.stdout, re.MULTILINE)
    return sorted(set(names))


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        baseline = run(tree)
        print(f"baseline: {len(baseline)} failing test(s) {baseline}")
        unchecked = 0
        chosen = sys.argv[1:]  # substrings: only the mutations whose line holds one of them
        for path, line, replacement in MUTATIONS:
            if chosen and not any(word in line for word in chosen):
                continue
            target = tree / path
            original = target.read_text()
            lines = original.splitlines(keepends=True)
            hits = [i for i, text in enumerate(lines) if text.rstrip("\n") == line]
            if len(hits) != 1:
                print(f"!! {path}: {line.strip()!r} found {len(hits)} times")
                return 2
            lines[hits[0]] = replacement + "\n"
            target.write_text("".join(lines))
            failed = run(tree)
            target.write_text(original)
            unchecked += not failed
            where = f"{Path(path).name}:{hits[0] + 1}"
            names = ", ".join(n.split("::")[-1] for n in failed) or "NONE"
            print(f"{where:16} {line.strip()[:60]:60} -> {len(failed)} failing: {names}")
        return 1 if unchecked else 0


if __name__ == "__main__":
    raise SystemExit(main())
