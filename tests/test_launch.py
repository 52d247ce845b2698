"""cupy-parallel launch: the ranks' environment, failures, signals, mpiexec; detect_launch_env."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cupy_parallel._src.distributed.env import detect_launch_env
from cupy_parallel._tools.launch import find_mpiexec, main

RANK_VARS = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",  # torchrun's: the node's rank and the number of nodes
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUPY_PARALLEL_BACKEND",
]

ENV_SCRIPT = f"""
import json, os, sys
out = sys.argv[1]
with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
    json.dump({{"env": {{k: os.environ.get(k) for k in {RANK_VARS!r}}}, "argv": sys.argv[2:]}}, f)
"""

# Rank 1 fails with exit code 3 once rank 0 is up; rank 0 would sleep for a minute.
FAILING_SCRIPT = """
import os, signal, sys, time
out, rank = sys.argv[1], int(os.environ["RANK"])
if os.environ.get("TEST_IGNORE_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
if rank == 1:
    while not os.path.exists(os.path.join(out, "pid0")):
        time.sleep(0.01)
    sys.exit(3)
time.sleep(60)
"""

# Each rank records the signal it receives, then exits cleanly.
SIGNAL_SCRIPT = """
import os, signal, sys, time
out, rank = sys.argv[1], os.environ["RANK"]
def record(signum, frame):
    with open(os.path.join(out, "signal" + rank), "w") as f:
        f.write(str(signum))
    sys.exit(0)
signal.signal(signal.SIGTERM, record)
signal.signal(signal.SIGINT, record)
open(os.path.join(out, "ready" + rank), "w").close()
time.sleep(60)
"""

# Each rank ignores SIGINT and SIGTERM, records its pid and says it is ready.
STUBBORN_SCRIPT = """
import os, signal, sys, time
out, rank = sys.argv[1], os.environ["RANK"]
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(out, "pid" + rank + ".tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, "pid" + rank + ".tmp"), os.path.join(out, "pid" + rank))
time.sleep(60)
"""

LAUNCHER = "import sys; from cupy_parallel._tools.launch import main; sys.exit(main())"
DIRECT = ["--backend", "nccl"]  # start the ranks directly (without --backend, no GPU picks mpi)


def _script(tmp_path: Path, text: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _outdir(tmp_path: Path) -> str:
    out = tmp_path / "out"
    out.mkdir()
    return str(out)


def _read_ranks(out: str, n: int) -> list[dict]:
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(n)]


def _wait_for(paths: list[Path], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, f"never appeared: {paths}"
        time.sleep(0.02)


def _pid_gone(pid: int, within: float = 5.0) -> bool:
    """Whether process ``pid`` is gone, or goes within ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------
# The environment each rank sees


def test_each_rank_gets_its_variables_and_the_script_arguments(tmp_path: Path) -> None:
    script, out = _script(tmp_path, ENV_SCRIPT), _outdir(tmp_path)
    code = main(
        [
            "--nproc-per-node",
            "3",
            "--master-port",
            "0",
            "--backend",
            "nccl",
            script,
            out,
            "--lr",
            "0.1",
        ]
    )
    assert code == 0
    ranks = _read_ranks(out, 3)
    port = ranks[0]["env"]["MASTER_PORT"]
    assert 0 < int(port) < 65536
    assert ranks == [
        {
            "env": {
                "RANK": str(r),
                "WORLD_SIZE": "3",
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": "3",
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "CUPY_PARALLEL_BACKEND": "nccl",
            },
            "argv": ["--lr", "0.1"],
        }
        for r in range(3)
    ]


@pytest.mark.parametrize("gpus", [False, True], ids=["no GPU", "GPU with NCCL"])
def test_without_backend_the_launcher_picks_one_and_says_which(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    gpus: bool,
) -> None:
    """As torchrun: no --backend needed. No GPU: the ranks run under mpiexec (oracle: the
    variables MPI's launcher sets, which a direct start lacks); a GPU: started directly."""
    if not gpus and find_mpiexec() is None:
        pytest.skip("needs mpiexec")
    import cupy_parallel.distributed

    monkeypatch.setattr(cupy_parallel.distributed, "is_nccl_available", lambda: gpus)
    script = _script(tmp_path, MPI_SCRIPT if not gpus else ENV_SCRIPT)
    out = _outdir(tmp_path)
    assert main(["--nproc-per-node", "2", "--master-port", "0", script, out]) == 0
    picked = "nccl" if gpus else "mpi"
    assert f"no --backend given: using {picked!r}" in capsys.readouterr().err
    ranks = _read_ranks(out, 2)
    assert [r["env"]["CUPY_PARALLEL_BACKEND"] for r in ranks] == [picked] * 2
    if not gpus:
        assert [r["mpi"][:2] for r in ranks] == [[0, 2], [1, 2]]  # one MPI world of two


def test_ranks_of_a_later_node_are_numbered_after_the_earlier_nodes(tmp_path: Path) -> None:
    script, out = _script(tmp_path, ENV_SCRIPT), _outdir(tmp_path)
    argv = ["--nproc_per_node", "2", "--nnodes", "3", "--node-rank", "1"]
    argv += ["--master-addr", "10.0.0.7", "--master-port", "29999", "--backend", "nccl"]
    assert main([*argv, script, out]) == 0
    envs = [json.loads(Path(out, f"{r}.json").read_text())["env"] for r in (2, 3)]
    assert envs == [
        {
            "RANK": str(2 + local),
            "WORLD_SIZE": "6",
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "3",
            "MASTER_ADDR": "10.0.0.7",
            "MASTER_PORT": "29999",
            "CUPY_PARALLEL_BACKEND": "nccl",
        }
        for local in range(2)
    ]


def test_two_nodes_see_the_variables_torchrun_gives(tmp_path: Path) -> None:
    """Live oracle: torchrun's static rendezvous over two nodes (two agents on this machine)
    gives every rank the same torch-contract variables as two launchers do."""
    pytest.importorskip("torch.distributed.run")
    contract = RANK_VARS[: RANK_VARS.index("MASTER_PORT")]  # the port is picked; ours own names

    def two_nodes(command: list[str], port: int, out: str) -> None:
        place = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
        nodes = [
            subprocess.Popen(
                [
                    *command,
                    *place,
                    "--master-port",
                    str(port),
                    "--node-rank",
                    str(node),
                    script,
                    out,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for node in (0, 1)
        ]
        assert [node.wait(timeout=120) for node in nodes] == [0, 0]

    script = _script(tmp_path, ENV_SCRIPT)
    theirs, ours = _outdir(tmp_path), str(tmp_path / "ours")
    os.mkdir(ours)
    two_nodes([sys.executable, "-m", "torch.distributed.run"], _free_port(), theirs)
    two_nodes(
        [sys.executable, "-m", "cupy_parallel", "launch", "--backend", "nccl"], _free_port(), ours
    )
    expected = [{k: r["env"][k] for k in contract} for r in _read_ranks(theirs, 4)]
    assert [{k: r["env"][k] for k in contract} for r in _read_ranks(ours, 4)] == expected
    assert expected[3]["GROUP_RANK"] == "1"  # the oracle did run two nodes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --------------------------------------------------------------------------------------------
# Failures and signals


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script, out = _script(tmp_path, FAILING_SCRIPT), _outdir(tmp_path)
    start = time.monotonic()
    code = main(
        [
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--grace-period",
            "20",
            *DIRECT,
            script,
            out,
        ]
    )
    elapsed = time.monotonic() - start
    assert code == 3
    assert elapsed < 10  # rank 0 obeyed SIGTERM at once; the 20 s grace period never ran out
    assert _pid_gone(int(Path(out, "pid0").read_text()))
    assert "rank 1 exited with code 3; stopped the other ranks." in capsys.readouterr().err


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_IGNORE_SIGTERM", "1")
    script, out = _script(tmp_path, FAILING_SCRIPT), _outdir(tmp_path)
    start = time.monotonic()
    code = main(
        [
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--grace-period",
            "0.5",
            *DIRECT,
            script,
            out,
        ]
    )
    elapsed = time.monotonic() - start
    assert code == 3
    assert 0.5 <= elapsed < 10
    assert _pid_gone(int(Path(out, "pid0").read_text()))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signals_are_forwarded_to_every_rank(tmp_path: Path, signum: signal.Signals) -> None:
    script, out = _script(tmp_path, SIGNAL_SCRIPT), _outdir(tmp_path)
    launcher = _launch(tmp_path, script, out)
    try:
        _wait_for([Path(out, "ready0"), Path(out, "ready1")])
        launcher.send_signal(signum)
        assert launcher.wait(timeout=20) == 128 + signum
    finally:
        launcher.kill()
        launcher.wait()
    assert [Path(out, f"signal{r}").read_text() for r in (0, 1)] == [str(int(signum))] * 2


def _launch(tmp_path: Path, script: str, out: str, *options: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCHER,
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            *(options if "--backend" in options else (*options, *DIRECT)),
            script,
            out,
        ]
    )


def test_ranks_ignoring_signals_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    """Ctrl-C, Ctrl-C, SIGTERM: the ranks ignore them all; SIGKILL follows the grace period."""
    script, out = _script(tmp_path, STUBBORN_SCRIPT), _outdir(tmp_path)
    launcher = _launch(tmp_path, script, out, "--grace-period", "1")
    try:
        _wait_for([Path(out, "pid0"), Path(out, "pid1")])
        start = time.monotonic()
        for signum in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
            launcher.send_signal(signum)
            time.sleep(0.1)
        assert launcher.wait(timeout=20) == 128 + signal.SIGTERM
        assert 1 <= time.monotonic() - start < 10
    finally:
        launcher.kill()
        launcher.wait()
    pids = [int(Path(out, f"pid{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 5
    while not all(_pid_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_pid_gone(pid) for pid in pids)


@pytest.mark.parametrize("backend", [DIRECT, ["--backend", "mpi"]], ids=["direct", "mpi"])
def test_no_rank_outlives_a_killed_launcher(tmp_path: Path, backend: list[str]) -> None:
    if backend and find_mpiexec() is None:
        pytest.skip("needs mpiexec")
    script, out = _script(tmp_path, STUBBORN_SCRIPT), _outdir(tmp_path)
    launcher = _launch(tmp_path, script, out, *backend)
    try:
        _wait_for([Path(out, "pid0"), Path(out, "pid1")])
    finally:
        launcher.kill()
        launcher.wait()
    pids = [int(Path(out, f"pid{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while not all(_pid_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if not _pid_gone(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left


def test_too_many_ranks_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "")
    assert main(["--nproc-per-node", "100000", script]) == 2
    assert re.search(r"--nproc-per-node 100000 is more processes than", capsys.readouterr().err)


def test_a_rank_that_cannot_start_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """fork failing (EAGAIN) stops the ranks already started and says what to do."""
    script, out = _script(tmp_path, STUBBORN_SCRIPT), _outdir(tmp_path)
    real = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        if started:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    code = main(
        [
            "--nproc-per-node",
            "3",
            "--master-port",
            "0",
            "--grace-period",
            "0.2",
            *DIRECT,
            script,
            out,
        ]
    )
    assert code == 1
    assert "cannot start rank 1 (1 of 3 started): Resource temporarily unavailable" in (
        capsys.readouterr().err
    )
    assert started[0].poll() is not None  # the started rank was stopped


# --------------------------------------------------------------------------------------------
# Usage errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "0", "x.py"], r"argument --nproc-per-node.*integer >= 1, got 0"),
        (["--nproc-per-node", "two", "x.py"], r"expected an integer, got 'two'"),
        (["--master-port", "70000", "x.py"], r"a port is at most 65535, got 70000"),
        (["--grace-period", "-1", "x.py"], r"expected a number of seconds >= 0, got '-1'"),
        (["--grace-period", "nan", "x.py"], r"expected a number of seconds >= 0, got 'nan'"),
        (["--master-addr", "", "x.py"], r"--master_addr: expected a host name or IP address"),
        (["--master-addr", "  ", "x.py"], r"--master_addr: expected a host name or IP address"),
        (["--backend", "gloo", "x.py"], r"invalid choice: 'gloo'"),
        ([], r"the following arguments are required: script"),
    ],
)
def test_argument_errors_print_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cupy-parallel launch")
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2"], r"--node-rank must be below --nnodes \(2\), got 2"),
        (["--nnodes", "2", "--master-port", "0"], r"--master-port 0 .* works on one node only"),
        (["--backend", "mpi", "--nnodes", "2"], r"--backend mpi starts the ranks of one node"),
    ],
)
def test_inconsistent_options_are_refused(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "raise SystemExit(1)")
    assert main([*argv, script]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cupy-parallel launch: error: ")
    assert re.search(message, err), err


def test_port_zero_needs_a_local_master_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "")
    assert main(["--master-addr", "192.0.2.1", "--master-port", "0", script]) == 2  # TEST-NET-1
    assert "cannot pick a free port on --master-addr 192.0.2.1" in capsys.readouterr().err


def test_a_missing_script_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope.py"]) == 2
    assert "error: script 'nope.py' not found." in capsys.readouterr().err


def test_mpi_backend_without_mpiexec_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))  # nothing beside it
    assert main(["--backend", "mpi", script]) == 2
    err = capsys.readouterr().err
    assert "--backend mpi needs mpiexec, found neither beside this Python" in err
    assert "`pip install mpich`" in err


@pytest.mark.mpi
def test_mpi_backend_finds_the_mpiexec_beside_python_without_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `venv/bin/cupy-parallel launch` without an activated venv: the mpich wheel's mpiexec sits
    # beside the interpreter, not on PATH.
    if not (Path(sys.executable).parent / "mpiexec").is_file():
        pytest.skip("no mpiexec beside this Python (MPI not installed from the mpich wheel)")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    script, out = _script(tmp_path, MPI_SCRIPT), _outdir(tmp_path)
    code = main(["--backend", "mpi", "--nproc-per-node", "2", "--master-port", "0", script, out])
    assert code == 0
    assert [rank["mpi"] for rank in _read_ranks(out, 2)] == [[0, 2, 1], [1, 2, 1]]


# --------------------------------------------------------------------------------------------
# --backend mpi

MPI_SCRIPT = f"""
import json, os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank)
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({{"env": {{k: os.environ.get(k) for k in {RANK_VARS!r}}},
               "mpi": [comm.rank, comm.size, total]}}, f)
"""


@pytest.mark.mpi
def test_mpi_backend_runs_the_ranks_under_mpiexec(tmp_path: Path) -> None:
    script, out = _script(tmp_path, MPI_SCRIPT), _outdir(tmp_path)
    code = main(["--backend", "mpi", "--nproc-per-node", "2", "--master-port", "0", script, out])
    assert code == 0
    ranks = _read_ranks(out, 2)
    port = ranks[0]["env"]["MASTER_PORT"]
    assert ranks == [
        {
            "env": {
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "CUPY_PARALLEL_BACKEND": "mpi",
            },
            "mpi": [r, 2, 1],  # MPI agrees: rank r of 2, and an allreduce went through
        }
        for r in range(2)
    ]


@pytest.mark.mpi
def test_mpi_backend_stops_the_job_when_a_rank_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script, out = _script(tmp_path, FAILING_SCRIPT), _outdir(tmp_path)
    start = time.monotonic()
    code = main(["--backend", "mpi", "--nproc-per-node", "2", "--master-port", "0", script, out])
    assert code == 3
    assert time.monotonic() - start < 20  # rank 0 would sleep 60 s (MPICH's mpiexec waits)
    assert _pid_gone(int(Path(out, "pid0").read_text()))
    assert "rank 1 exited with code 3; stopped the other ranks." in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# detect_launch_env


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, {}),
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "PMI_RANK": "0",  # Open MPI wins over PMI variables set alongside
                "PMI_SIZE": "1",
            },
            {
                "source": "Open MPI",
                "rank": 3,
                "world_size": 8,
                "local_rank": 1,
                "local_world_size": 2,
            },
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            {
                "source": "MPICH (PMI)",
                "rank": 1,
                "world_size": 2,
                "local_rank": 1,
                "local_world_size": 2,
            },
        ),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "6",
                "SLURM_LOCALID": "2",
                "SLURM_NTASKS_PER_NODE": "2(x3)",
            },
            {"source": "Slurm", "rank": 5, "world_size": 6, "local_rank": 2},
        ),
        ({"PMI_RANK": "1"}, {}),  # half a launcher's variables: not detected
    ],
    ids=["none", "openmpi", "mpich", "slurm", "partial"],
)
def test_detect_launch_env(env: dict[str, str], expected: dict) -> None:
    assert detect_launch_env(env) == expected


def test_detect_launch_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "3")
    assert detect_launch_env()["world_size"] == 3


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PMI_RANK": "x", "PMI_SIZE": "2"}, r"PMI_RANK must be an integer >= 0, got 'x'"),
        ({"PMI_RANK": "-1", "PMI_SIZE": "2"}, r"PMI_RANK must be >= 0, got -1"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, r"SLURM_NTASKS must be >= 1, got 0"),
        ({"PMI_RANK": "2", "PMI_SIZE": "2"}, r"PMI_RANK=2 is not below PMI_SIZE=2"),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "?"},
            r"MPI_LOCALRANKID must be an integer",
        ),
    ],
)
def test_detect_launch_env_names_bad_variables(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect_launch_env(env)


# --------------------------------------------------------------------------------------------
# --max-restarts

# Every rank records each start; rank 1 fails (exit 3) until the start numbered SUCCEED_AT.
RESTART_SCRIPT = """
import os, sys, time
out, succeed_at = sys.argv[1], int(sys.argv[2])
rank, restart = os.environ["RANK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(os.path.join(out, f"start-{restart}-rank-{rank}"), "w") as f:
    f.write(os.environ["TORCHELASTIC_MAX_RESTARTS"])
if rank == "1" and restart < succeed_at:
    sys.exit(3)
if rank == "0" and restart < succeed_at:
    time.sleep(60)  # stopped by the launcher when rank 1 fails
"""


@pytest.mark.parametrize(
    ("max_restarts", "succeed_at", "code", "starts"),
    [(2, 2, 0, 3), (1, 5, 3, 2), (0, 1, 3, 1)],
    ids=["succeeds-on-the-last-restart", "gives-up-after-K", "no-restarts"],
)
def test_max_restarts_restarts_the_whole_job_when_a_rank_fails(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    max_restarts: int,
    succeed_at: int,
    code: int,
    starts: int,
) -> None:
    script, out = _script(tmp_path, RESTART_SCRIPT), _outdir(tmp_path)
    argv = ["--nproc-per-node", "2", "--master-port", "0", "--max-restarts", str(max_restarts)]
    assert main([*argv, *DIRECT, script, out, str(succeed_at)]) == code
    expected = {f"start-{s}-rank-{r}" for s in range(starts) for r in range(2)}
    assert set(os.listdir(out)) == expected  # every rank, every start: the whole job again
    assert {Path(out, name).read_text() for name in expected} == {str(max_restarts)}
    err = capsys.readouterr().err
    assert err.count("rank 1 exited with code 3; stopped the other ranks.") == min(
        succeed_at, starts
    )
    said = [f"restarting the job ({k} of {max_restarts} restarts)." for k in range(1, starts)]
    assert [line.split(": ", 1)[1] for line in err.splitlines() if "restarting" in line] == said


@pytest.mark.mpi
def test_max_restarts_under_the_mpi_backend(tmp_path: Path) -> None:
    script, out = _script(tmp_path, RESTART_SCRIPT), _outdir(tmp_path)
    argv = ["--backend", "mpi", "--nproc-per-node", "2", "--max-restarts", "1"]
    assert main([*argv, "--master-port", "0", script, out, "1"]) == 0
    assert set(os.listdir(out)) == {f"start-{s}-rank-{r}" for s in range(2) for r in range(2)}


def test_max_restarts_must_be_a_count() -> None:
    with pytest.raises(SystemExit):
        main(["--max-restarts", "-1", "x.py"])
