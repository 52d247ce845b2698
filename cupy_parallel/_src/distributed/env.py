"""The launch environment: where a started rank finds its place, and how it reports failing.

Processes started by ``mpiexec``, Slurm's ``srun`` or ``cupy-parallel launch`` learn their rank
and world size from environment variables: :func:`detect_launch_env` reads those of the MPI
launchers and Slurm (the ``env://`` rendezvous consults it when ``RANK`` and ``WORLD_SIZE`` are
unset, ``init_process_group()`` to pick a backend). A rank failing under ``cupy-parallel launch
--backend mpi`` tells the launcher which rank failed with :func:`report_failure`.

This module sits below the process groups, the rendezvous and the backends, and imports none of
them.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, NamedTuple, TypedDict

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["FAILURES_VAR", "LaunchEnv", "detect_launch_env", "report_failure"]

FAILURES_VAR = "CUPY_PARALLEL_LAUNCH_FAILURES"  # where MPI ranks report a failed exit


class LaunchEnv(TypedDict, total=False):
    """What :func:`detect_launch_env` found: the launcher's name and the rank's place."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


class _LauncherVars(NamedTuple):
    source: str
    rank: str
    world_size: str
    local_rank: str
    local_world_size: str


# First match wins: Open MPI, then MPICH/Intel MPI (PMI), then Slurm's srun.
_LAUNCHERS = (
    _LauncherVars(
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    _LauncherVars("MPICH (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    _LauncherVars(
        "Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"
    ),
)


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int:
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"environment variable {name} must be an integer >= {minimum}, got {text!r}."
        ) from None
    if value < minimum:
        raise ValueError(f"environment variable {name} must be >= {minimum}, got {value}.")
    return value


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The rank and world size an MPI launcher or Slurm gave this process, if any.

    Reads ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (Open MPI), ``PMI_RANK``/``PMI_SIZE``
    (MPICH, Intel MPI), ``SLURM_PROCID``/``SLURM_NTASKS`` (``srun``), and their local-rank
    counterparts when present. Returns an empty dict when none is set.

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        ValueError: a variable is set but is not a non-negative integer (the message names it).

    Example:
        >>> detect_launch_env({"PMI_RANK": "1", "PMI_SIZE": "4"})
        {'source': 'MPICH (PMI)', 'rank': 1, 'world_size': 4}
        >>> detect_launch_env({})
        {}
    """
    env = os.environ if environ is None else environ
    for names in _LAUNCHERS:
        if names.rank not in env or names.world_size not in env:
            continue
        found = LaunchEnv(
            source=names.source,
            rank=_env_int(env, names.rank, 0),
            world_size=_env_int(env, names.world_size, 1),
        )
        if found["rank"] >= found["world_size"]:
            raise ValueError(
                f"{names.rank}={found['rank']} is not below {names.world_size}="
                f"{found['world_size']}; the launcher's environment is inconsistent."
            )
        if names.local_rank in env:
            found["local_rank"] = _env_int(env, names.local_rank, 0)
        if names.local_world_size in env:
            with contextlib.suppress(ValueError):  # Slurm may write "2(x3)": not one number
                found["local_world_size"] = _env_int(env, names.local_world_size, 1)
        return found
    return LaunchEnv()


def report_failure(rank: int, code: int) -> None:
    """Tell ``cupy-parallel launch --backend mpi`` that ``rank`` fails with exit ``code``.

    Writes the report into the launcher's failure directory (``CUPY_PARALLEL_LAUNCH_FAILURES``);
    the first report of a rank stays. Does nothing outside the launcher.

    Example:
        >>> report_failure(0, 3)  # not under the launcher: nothing to do
    """
    failures = os.environ.get(FAILURES_VAR)
    if not failures or os.path.exists(os.path.join(failures, str(rank))):
        return
    partial = os.path.join(failures, f"{rank}.{os.getpid()}.partial")
    with contextlib.suppress(OSError):
        with open(partial, "w") as report:
            report.write(str(code))
        os.replace(partial, os.path.join(failures, str(rank)))  # complete or not at all
