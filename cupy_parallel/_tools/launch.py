"""``cupy-parallel launch``: start one process per rank and watch over them.

``cupy-parallel launch --nproc-per-node N script.py args...`` starts ``N`` copies of
``python script.py args...`` on this node, each with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, so that
``init_process_group(backend)`` (``env://``) finds the others, and torchrun's ``GROUP_RANK``
(``--node-rank``) and ``GROUP_WORLD_SIZE`` (``--nnodes``); of torchelastic's variables only
``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS`` are set (there is no elastic
agent; see ``--max-restarts``). Several nodes: run it on each node
with the same ``--nnodes``, ``--master-addr`` and ``--master-port`` and that node's
``--node-rank``. With ``--backend mpi`` the ranks run under ``mpiexec -n N`` instead (one node);
every rank still sees the same variables (a small wrapper per rank sets them from the MPI
launcher's own and reports a failed exit back, because MPICH's ``mpiexec`` lets the other ranks
run on when one exits with an error). ``--backend nccl`` starts the ranks directly. Without
``--backend`` the launcher picks, and says on stderr what it picked: ``nccl`` where this machine
has a GPU with NCCL, ``mpi`` otherwise (so that ``cupy-parallel launch --nproc-per-node 2
train.py``, as with torchrun, runs on a CPU-only machine too). The backend is exported as
``CUPY_PARALLEL_BACKEND``, which ``init_process_group()`` reads.

``--max-restarts K`` (torchrun's flag): when a rank fails, the launcher stops the others as
below and starts the whole job again, up to ``K`` times; the ranks read which start they are in
``TORCHELASTIC_RESTART_COUNT`` (0 for the first) and resume from their last checkpoint. A job
interrupted by a signal is not restarted; the exit code is the last start's.

The launcher forwards ``SIGINT`` and ``SIGTERM`` to the ranks; ranks still running
``--grace-period`` seconds after the first signal are killed (``SIGKILL``). When a rank fails, it
stops the others (``SIGTERM``, then ``SIGKILL`` after ``--grace-period`` seconds), names the
rank and exits with its exit code (``128 + N`` for a rank killed by signal ``N``, the shell's
convention); when it was itself interrupted it exits with ``128 +`` the signal number. Each rank
runs in its own process group, so a terminal's Ctrl-C reaches the ranks once, through the
launcher; on Linux every rank (and, under ``--backend mpi``, every rank's process) is killed
when its parent dies (``PR_SET_PDEATHSIG``), so no rank outlives a killed launcher.

Processes started by ``mpiexec`` or Slurm's ``srun`` already know their rank: see
:func:`~cupy_parallel._src.distributed.env.detect_launch_env`, which the ``env://`` rendezvous
consults when ``RANK`` and ``WORLD_SIZE`` are unset.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import enum
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from cupy_parallel._src.arguments import read_timeout
from cupy_parallel._src.distributed.env import FAILURES_VAR, detect_launch_env, report_failure

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import FrameType

__all__ = [
    "LaunchBackend",
    "add_arguments",
    "find_mpiexec",
    "main",
    "pick_backend",
    "run",
    "run_mpi_rank",
]

_PROG = "cupy-parallel launch"
_DEFAULT_PORT = 29500  # torch.distributed.launch's default
_POLL_S = 0.05


class LaunchBackend(enum.Enum):
    """How ``cupy-parallel launch`` starts the ranks.

    ``NCCL`` starts one Python process per rank itself (any backend can be used inside);
    ``MPI`` runs them through ``mpiexec``.

    Example:
        >>> LaunchBackend("mpi")
        <LaunchBackend.MPI: 'mpi'>
    """

    NCCL = "nccl"
    MPI = "mpi"


# --------------------------------------------------------------------------------------------
# Each rank: its variables, death with its parent, and its wrapper under mpiexec


def _rank_env(rank: int, world_size: int, local_rank: int, local_world_size: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
    }


_MPI_RANK_CODE = "from cupy_parallel._tools.launch import run_mpi_rank; run_mpi_rank()"
_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """The C library's ``prctl`` (Linux), loaded in the parent (a forked child must not load)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


def _die_with_parent() -> None:
    """Be killed when the parent dies (Linux; elsewhere nothing); also a ``preexec_fn``."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def run_mpi_rank() -> None:
    """Under ``mpiexec``: run ``python script args`` as this rank and report how it ended.

    The script runs as a child with this rank's variables and every inherited descriptor
    (``mpiexec`` passes its PMI connection as one); signals are forwarded to it, and it dies
    with this process. A failed exit is written to the launcher's failure directory, so that
    the launcher can stop the job (MPICH's ``mpiexec`` lets the other ranks run on when a rank
    that never started MPI fails) and name the rank.
    """
    _die_with_parent()  # mpiexec's proxy gone: go too
    found = detect_launch_env()
    if "rank" not in found:
        sys.exit(f"{_PROG}: mpiexec started this process without PMI_RANK/OMPI_COMM_WORLD_RANK.")
    rank, world_size = found["rank"], found["world_size"]
    env = dict(
        os.environ,
        **_rank_env(
            rank,
            world_size,
            found.get("local_rank", rank),
            found.get("local_world_size", world_size),
        ),
    )
    child = subprocess.Popen(
        [sys.executable, *sys.argv[1:]],
        env=env,
        close_fds=False,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - one thread here; prctl loaded already
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: child.send_signal(signum))
    code = _exit_code(child.wait())
    if code != 0:
        report_failure(rank, code)
    sys.exit(code)


# --------------------------------------------------------------------------------------------
# Command line


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        return read_timeout(float(text), "--grace-period", positive=False)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}") from (
            error
        )


def _address(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "expected a host name or IP address of node 0, got an empty string"
        )
    return text.strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the launcher's options to ``parser`` (for mounting ``launch`` as a subcommand).

    Example:
        >>> import argparse
        >>> parser = argparse.ArgumentParser(prog="launch")
        >>> add_arguments(parser)
        >>> args = parser.parse_args(["--nproc-per-node", "2", "train.py", "--lr", "0.1"])
        >>> args.nproc_per_node, args.script, args.script_args
        (2, 'train.py', ['--lr', '0.1'])
    """
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=_int_at_least(1),
        default=1,
        metavar="N",
        help="processes (ranks) to start on this node (default 1)",
    )
    parser.add_argument(
        "--nnodes",
        type=_int_at_least(1),
        default=1,
        metavar="M",
        help="number of nodes taking part (default 1)",
    )
    parser.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=_int_at_least(0),
        default=0,
        metavar="K",
        help="this node's index in [0, M) (default 0)",
    )
    parser.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        type=_address,
        default="127.0.0.1",
        metavar="A",
        help="address of node 0, where rank 0 hosts the TCPStore (default 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=_port,
        default=_DEFAULT_PORT,
        metavar="P",
        help=f"port of rank 0's TCPStore (default {_DEFAULT_PORT}; 0 picks a free one, "
        "single node only)",
    )
    parser.add_argument(
        "--backend",
        choices=[backend.value for backend in LaunchBackend],
        default=None,
        help="'mpi' runs the ranks through mpiexec; 'nccl' starts them directly. Default: "
        "'nccl' where this machine has a GPU with NCCL, else 'mpi'. Exported to the ranks as "
        "CUPY_PARALLEL_BACKEND.",
    )
    parser.add_argument(
        "--grace-period",
        dest="grace_period",
        type=_seconds,
        default=5.0,
        metavar="SECONDS",
        help="after a failure, how long ranks get to exit after SIGTERM before SIGKILL (default 5)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=_int_at_least(0),
        default=0,
        metavar="K",
        help="when a rank fails, stop the job and start it again, up to K times (default 0); "
        "the ranks see TORCHELASTIC_RESTART_COUNT",
    )
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments passed to the script"
    )


def find_mpiexec() -> str | None:
    """The ``mpiexec`` to start ranks with: the one beside this Python first, then ``PATH``'s.

    The ``mpich`` wheel installs ``mpiexec`` into the environment's ``bin`` directory, which is
    not on ``PATH`` when the environment is not activated (``venv/bin/cupy-parallel launch``);
    that one belongs to the MPI library mpi4py loads, so it is preferred.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel._tools.launch import find_mpiexec
        >>> found = find_mpiexec()
        >>> found is None or Path(found).name.startswith("mpiexec")
        True
    """
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def pick_backend() -> tuple[str, str]:
    """The backend when ``--backend`` is not given, and why: ``nccl`` with GPUs, else ``mpi``.

    Example:
        >>> backend, why = pick_backend()
        >>> backend in ("nccl", "mpi"), why.startswith(("this machine", "no GPU"))
        (True, True)
    """
    from cupy_parallel.distributed import is_nccl_available

    if is_nccl_available():
        return LaunchBackend.NCCL.value, "this machine has a GPU with NCCL"
    return LaunchBackend.MPI.value, "no GPU with NCCL here; the ranks run under mpiexec"


def _usage_problem(args: argparse.Namespace, backend: str) -> str | None:
    """A message for option combinations argparse cannot check one by one, or None."""
    if args.node_rank >= args.nnodes:
        return f"--node-rank must be below --nnodes ({args.nnodes}), got {args.node_rank}."
    if args.master_port == 0 and args.nnodes > 1:
        return "--master-port 0 (pick a free port) works on one node only; give a fixed port."
    if backend == LaunchBackend.MPI.value:
        said = "--backend mpi" if args.backend is not None else "the mpi backend (picked)"
        if args.nnodes > 1:
            return (
                f"{said} starts the ranks of one node; for several nodes run mpiexec "
                "yourself (the ranks read their place from its environment)."
            )
        if find_mpiexec() is None:
            return (
                f"{said} needs mpiexec, found neither beside this Python "
                f"({Path(sys.executable).parent}) nor on PATH; install an MPI (e.g. "
                "`pip install mpich`)"
                + (" or leave out --backend mpi." if args.backend is not None else ".")
            )
    if not os.path.isfile(args.script):
        return f"script {args.script!r} not found."
    limit = _process_limit()
    if limit is not None and args.nproc_per_node > limit:
        return (
            f"--nproc-per-node {args.nproc_per_node} is more processes than this user may run "
            f"(RLIMIT_NPROC {limit}); start fewer ranks per node."
        )
    return None


def _process_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NPROC)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    """Start the ranks described by parsed ``args`` and supervise them; return the exit code.

    Problems argparse cannot see alone (``--node-rank`` out of range, no ``mpiexec``, a missing
    script) print ``cupy-parallel launch: error: ...`` and return 2, as argparse does.

    Example:
        >>> import argparse, os, sys, tempfile
        >>> script = os.path.join(tempfile.mkdtemp(), "hello.py")
        >>> with open(script, "w") as f:
        ...     _ = f.write("import os, sys; sys.exit(int(os.environ['WORLD_SIZE']) - 2)")
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> argv = ["--nproc-per-node", "2", "--master-port", "0", "--backend", "nccl", script]
        >>> run(parser.parse_args(argv))
        0
    """
    backend, why = (args.backend, "") if args.backend is not None else pick_backend()
    problem = _usage_problem(args, backend)
    if problem is not None:
        print(f"{_PROG}: error: {problem}", file=sys.stderr)
        return 2
    if args.backend is None:
        print(f"{_PROG}: no --backend given: using {backend!r} ({why}).", file=sys.stderr)
    nproc, nnodes, node_rank = args.nproc_per_node, args.nnodes, args.node_rank
    try:
        port = args.master_port or _free_port(args.master_addr)
    except OSError as exc:
        print(
            f"{_PROG}: error: cannot pick a free port on --master-addr {args.master_addr} "
            f"({exc.strerror or exc}); give --master-port.",
            file=sys.stderr,
        )
        return 2
    shared = dict(os.environ, MASTER_ADDR=args.master_addr, MASTER_PORT=str(port))
    shared.update(GROUP_RANK=str(node_rank), GROUP_WORLD_SIZE=str(nnodes))  # torchrun's node vars
    shared["CUPY_PARALLEL_BACKEND"] = backend
    script = [args.script, *args.script_args]
    if backend != LaunchBackend.MPI.value:
        ranks = [
            _Rank(
                f"rank {node_rank * nproc + local}",
                [sys.executable, *script],
                dict(shared, **_rank_env(node_rank * nproc + local, nnodes * nproc, local, nproc)),
            )
            for local in range(nproc)
        ]

        def start(restart: dict[str, str]) -> _Supervisor:
            started = [_Rank(rank.name, rank.command, dict(rank.env, **restart)) for rank in ranks]
            return _Supervisor(started, args.grace_period)

        return _with_restarts(args.max_restarts, start)
    mpiexec = str(find_mpiexec())
    command = [mpiexec, "-n", str(nproc), sys.executable, "-c", _MPI_RANK_CODE, *script]
    with tempfile.TemporaryDirectory(prefix="cupy_parallel_launch_") as failures_root:

        def start_mpi(restart: dict[str, str]) -> _Supervisor:
            failures = os.path.join(failures_root, restart[_RESTART_VAR])  # fresh each start
            os.mkdir(failures)
            env = dict(shared, **restart, **{FAILURES_VAR: failures})
            return _Supervisor([_Rank("mpiexec", command, env)], args.grace_period, failures)

        return _with_restarts(args.max_restarts, start_mpi)


_RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"


def _with_restarts(max_restarts: int, start: Callable[[dict[str, str]], _Supervisor]) -> int:
    """Run the job (``start(variables).run()``) until it succeeds, up to ``max_restarts`` again."""
    restart = 0
    while True:
        variables = {_RESTART_VAR: str(restart), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
        supervisor = start(variables)
        code = supervisor.run()
        if code == 0 or supervisor.interrupted or restart == max_restarts:
            return code
        restart += 1
        print(
            f"{_PROG}: restarting the job ({restart} of {max_restarts} restarts).",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``cupy-parallel launch`` as a function: parse ``argv`` and :func:`run`.

    Argument errors print the usage and exit with status 2 (``SystemExit``), as argparse does.

    Example:
        >>> main(["--nproc-per-node", "0", "x.py"])
        Traceback (most recent call last):
        SystemExit: 2
    """
    parser = argparse.ArgumentParser(
        prog=_PROG, description="Start one process per rank with torch-style environment."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


# --------------------------------------------------------------------------------------------
# Supervision


class _Rank(NamedTuple):
    name: str
    command: list[str]
    env: dict[str, str]


def _exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it (``128 + N`` for death by signal ``N``)."""
    return returncode if returncode >= 0 else 128 - returncode


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


class _Supervisor:
    """Start the ranks, forward signals, stop everyone when one fails."""

    def __init__(
        self, ranks: list[_Rank], grace_period: float, failures: str | None = None
    ) -> None:
        self._ranks = ranks
        self._grace = grace_period
        self._failures = failures  # a directory where MPI ranks report failed exits
        self._procs: list[subprocess.Popen[bytes]] = []
        self._received: int | None = None
        self._kill_at: float | None = None  # set by the first signal: SIGKILL what still runs

    def run(self) -> int:
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {signum: signal.signal(signum, self._forward) for signum in handled}
        try:
            for rank in self._ranks:
                _prctl()  # loaded before any fork
                try:
                    proc = subprocess.Popen(
                        rank.command,
                        env=rank.env,
                        start_new_session=True,
                        preexec_fn=_die_with_parent,  # noqa: PLW1509 - it only calls prctl
                    )
                except OSError as error:
                    print(
                        f"{_PROG}: error: cannot start {rank.name} ({len(self._procs)} of "
                        f"{len(self._ranks)} started): {error.strerror or error}. Start fewer "
                        "ranks per node (--nproc-per-node) or raise the process limit.",
                        file=sys.stderr,
                    )
                    return 1
                self._procs.append(proc)
            return self._watch()
        finally:
            self._stop_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @property
    def interrupted(self) -> bool:
        """Whether the launcher received ``SIGINT`` or ``SIGTERM`` (then no restart)."""
        return self._received is not None

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self._received = signum
        if self._kill_at is None:
            self._kill_at = time.monotonic() + self._grace
        for proc in self._procs:
            if proc.returncode is None:
                _signal_group(proc, signum)

    def _watch(self) -> int:
        failure: tuple[str, int] | None = None
        while True:
            if failure is None:
                failure = self._reported_failure()
                if failure is not None:
                    self._stop_all()
            running = False
            for rank, proc in zip(self._ranks, self._procs, strict=True):
                code = proc.poll()
                if code is None:
                    running = True
                elif code != 0 and failure is None:
                    failure = self._reported_failure() or (rank.name, _exit_code(code))
                    self._stop_all()
            if not running:
                break
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_at = float("inf")  # once
                for proc in self._procs:
                    if proc.poll() is None:
                        _signal_group(proc, signal.SIGKILL)
            time.sleep(_POLL_S)
        if self._received is not None:
            return 128 + self._received
        if failure is None:
            return 0
        name, code = failure
        print(f"{_PROG}: {name} exited with code {code}; stopped the other ranks.", file=sys.stderr)
        return code

    def _reported_failure(self) -> tuple[str, int] | None:
        """The first failure an MPI rank reported in the failure directory, if any."""
        if self._failures is None:
            return None
        reports = []
        for name in os.listdir(self._failures):
            if name.isdigit():
                with contextlib.suppress(OSError):
                    when = os.stat(os.path.join(self._failures, name)).st_mtime_ns
                    reports.append((when, int(name)))
        if not reports:
            return None
        _when, rank = min(reports)
        with open(os.path.join(self._failures, str(rank))) as report:
            return f"rank {rank}", int(report.read())

    def _stop_all(self) -> None:
        alive = [proc for proc in self._procs if proc.poll() is None]
        for proc in alive:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in alive:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
