"""The ``cupy-parallel`` command: info, demo, bench and launch, run in-process and as scripts."""

from __future__ import annotations

import json
import os
import platform as system
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import optree
import pytest

import cupy_parallel
from cupy_parallel._tools import benchmarking, cli, demo

SCRIPT = Path(sys.executable).parent / "cupy-parallel"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed console script (or ``python -m cupy_parallel`` when it is not installed)."""
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "cupy_parallel"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def demo_device_count(wanted: int = 3) -> int:
    """``wanted`` host devices, or as many GPUs as there are up to ``wanted``."""
    if cupy_parallel.platform() == "host":
        return wanted
    return min(wanted, len(cupy_parallel.devices()))


# --------------------------------------------------------------------------------------------
# info


def info_lines(text: str) -> dict[str, str]:
    """``label -> value`` for the aligned ``label   value`` lines of ``info``."""
    return {line[:15].strip(): line[15:] for line in text.splitlines() if not line.startswith(" ")}


def test_info_reports_platform_devices_and_every_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    lines = info_lines(out)
    count = len(cupy_parallel.devices())
    assert lines["platform"] == f"{cupy_parallel.platform()} ({count} device{'s' * (count != 1)})"
    assert lines["Python"] == system.python_version()
    assert lines["NumPy"] == np.__version__
    assert lines["optree"] == optree.__version__
    assert lines["cupy_parallel"] == cupy_parallel.__version__
    cupy = pytest.importorskip("cupy")
    assert lines["CuPy"] == cupy.__version__
    assert lines["CUDA runtime"] == (
        f"{cupy.cuda.runtime.runtimeGetVersion() // 1000}."
        f"{cupy.cuda.runtime.runtimeGetVersion() % 1000 // 10}"
    )
    for label in ("CUDA driver", "NCCL"):  # a version, or why there is none
        assert re.fullmatch(r"\d+\.\d+(\.\d+)?|not available \(.+\)", lines[label]), lines[label]
    mpi4py = pytest.importorskip("mpi4py")
    from mpi4py import MPI

    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert lines["MPI"] == f"{library} (mpi4py {mpi4py.__version__})"
    device_lines = out.split("devices:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in device_lines] == [str(d) for d in cupy_parallel.devices()]


def test_info_json_matches_the_platform(capsys: pytest.CaptureFixture[str]) -> None:
    cupy_parallel.set_host_device_count(3)
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["platform"] == cupy_parallel.platform()
    assert [row["device"] for row in info["devices"]] == [str(d) for d in cupy_parallel.devices()]
    if cupy_parallel.platform() == "host":
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert {row["total_bytes"] for row in info["devices"]} == {total}


def test_info_without_cupy_or_mpi_says_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "host")
    monkeypatch.setattr(cli, "cupy_module", lambda: None)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    assert cli.main(["info"]) == 0
    captured = capsys.readouterr()
    lines = info_lines(captured.out)
    for label in ("CuPy", "CUDA runtime", "CUDA driver", "NCCL", "MPI"):
        assert lines[label].startswith("not installed"), (label, lines[label])
    assert "Traceback" not in captured.out + captured.err


def test_python_dash_m_runs_info() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cupy_parallel", "info"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert info_lines(result.stdout)["NumPy"] == np.__version__


# --------------------------------------------------------------------------------------------
# demo


def parse_demo(out: str) -> dict[str, float]:
    check = re.search(r"gradient check: (\w+), max \|DataParallel - one device\| = (\S+)", out)
    loss = re.search(r"loss: first (\S+), last (\S+)", out)
    speed = re.search(r"throughput: ([\d,]+) samples/s", out)
    assert check, out
    assert loss, out
    assert speed, out
    return {
        "passed": float(check.group(1) == "passed"),
        "difference": float(check.group(2)),
        "first": float(loss.group(1)),
        "last": float(loss.group(2)),
        "samples_per_second": float(speed.group(1).replace(",", "")),
    }


@pytest.mark.slow
def test_demo_trains_checks_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    n = demo_device_count(3)
    code = cli.main(["demo", "--steps", "5", "--devices", str(n), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    numbers = parse_demo(out)
    assert numbers["passed"] == 1.0
    assert numbers["difference"] < 1e-10
    assert numbers["samples_per_second"] > 0
    names = [str(d) for d in cupy_parallel.devices()[:n]]
    assert f"on {n} devices: {', '.join(names)}" in out
    # The loss the CLI prints is the loss of the oracle: the first step on one device.
    config = demo.DemoConfig(devices=(names[0],), steps=1)
    rows = config.batch_size * config.batches  # the demo's dataset; its first batch
    x, y = (
        cupy_parallel.to_device(a[: config.batch_size], names[0])
        for a in demo.make_dataset(rows, config.features, seed=0)
    )
    params = demo.init_params(config.features, config.hidden, seed=0, device=names[0])
    single_loss, _ = demo.single_device_step(params, x, y)
    assert numbers["first"] == pytest.approx(single_loss, rel=1e-5)
    png = tmp_path / cli.DEMO_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape == (400, 640, 4)


def test_demo_out_may_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "new" / "curve.png"
    argv = ["demo", "--steps", "2", "--devices", str(demo_device_count(2)), "--out", str(target)]
    assert cli.main([*argv, "--dtype", "float32", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "(float32, batch 64)" in out
    assert parse_demo(out)["difference"] < demo.TOLERANCES["float32"]
    assert f"loss curve: {target}" in out
    assert target.stat().st_size > 0


def test_demo_out_without_extension_gets_png_appended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "not-yet" / "results"  # neither a directory nor a file yet
    argv = ["demo", "--steps", "1", "--devices", str(demo_device_count(2)), "--out", str(target)]
    assert cli.main(argv) == 0
    written = target.with_name("results.png")
    assert f"loss curve: {written}" in capsys.readouterr().out
    assert written.read_bytes().startswith(b"\x89PNG")
    assert not target.exists()


def test_demo_out_with_another_format_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--steps", "1", "--out", str(tmp_path / "curve.pdf")])
    assert exit_info.value.code == 2
    assert "argument --out: the loss curve is a PNG file, got" in capsys.readouterr().err


def test_demo_fails_when_a_gradient_is_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    honest = demo.data_parallel_step
    error = 3e-7

    def corrupted(model: object, params: object, x: object, y: object) -> tuple[float, dict]:
        loss, grads = honest(model, params, x, y)
        grads["w1"][0, 0] += error
        return loss, grads

    monkeypatch.setattr(demo, "data_parallel_step", corrupted)
    argv = ["demo", "--steps", "2", "--devices", str(demo_device_count(2)), "--out", str(tmp_path)]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == 1
    numbers = parse_demo(out)
    assert numbers["passed"] == 0.0
    assert numbers["difference"] == pytest.approx(error, rel=1e-6)
    assert "FAILED" in out


def test_demo_fails_under_an_impossible_tolerance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(demo.TOLERANCES, "float64", -1.0)
    argv = ["demo", "--steps", "1", "--devices", str(demo_device_count(2)), "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    assert "gradient check: FAILED" in capsys.readouterr().out


def test_train_learns_and_is_reproducible() -> None:
    devices = tuple(cupy_parallel.devices()[:2])
    config = demo.DemoConfig(devices=devices, steps=40, batch_size=64, seed=3)
    first, again = demo.train(config), demo.train(config)
    assert first.passed
    assert first.losses[-1] < 0.5 * first.losses[0]
    np.testing.assert_allclose(first.losses, again.losses, rtol=1e-12)
    other = demo.train(demo.DemoConfig(devices=devices, steps=1, batch_size=64, seed=4))
    assert other.losses[0] != first.losses[0]


def test_max_abs_difference_finds_the_largest_entry() -> None:
    a = {"w": np.zeros((2, 3)), "b": [np.ones(2)]}
    b = {"w": np.zeros((2, 3)), "b": [np.ones(2)]}
    b["w"][1, 2] = -2.5e-3
    b["b"][0][0] += 1e-3
    assert demo.max_abs_difference(a, b) == pytest.approx(2.5e-3, rel=0, abs=1e-18)
    b["b"][0][1] = np.nan
    assert np.isnan(demo.max_abs_difference(a, b))
    with pytest.raises(ValueError, match="differ in structure"):
        demo.max_abs_difference(a, {"w": a["w"]})


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("devices", (), "devices must name at least one device"),
        ("dtype", "int8", r"dtype must be one of \['float32', 'float64'\], got 'int8'"),
        ("steps", 0, "steps must be a positive int, got 0"),
        ("batch_size", 2.5, "batch_size must be a positive int, got 2.5"),
    ],
)
def test_demo_config_rejects_bad_values(field: str, value: object, match: str) -> None:
    kwargs: dict[str, object] = {"devices": ("host:0",), field: value}
    with pytest.raises(ValueError, match=match):
        demo.DemoConfig(**kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# argument errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--steps", "0"], "argument --steps: expected a positive integer, got 0"),
        (
            ["demo", "--devices", "two"],
            "argument --devices: expected a positive integer, got 'two'",
        ),
        (["demo", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
    ids=["steps", "devices", "dtype", "command", "missing"],
)
def test_bad_arguments_exit_2_with_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cupy-parallel")
    assert message in err


def test_bad_arguments_from_the_console_script_print_no_traceback() -> None:
    result = run_cli("demo", "--steps", "-3")
    assert result.returncode == 2
    assert "usage: cupy-parallel demo" in result.stderr
    assert "expected a positive integer, got -3" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_help_imports_no_heavy_module() -> None:
    probe = (
        "import sys\n"
        "from cupy_parallel._tools.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('matplotlib', 'mpi4py', 'tqdm') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "info" in result.stdout
    assert "demo" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


# --------------------------------------------------------------------------------------------
# bench


TINY_BENCH = """
import numpy as np

from bench_helpers import best_of


def run(quick):
    sizes = (2**8, 2**12) if quick else (2**8, 2**12, 2**16)
    rows = []
    for n in sizes:
        data = np.random.default_rng(0).random(n)
        seconds = best_of(lambda: np.sort(data), 3)
        baseline = best_of(lambda: sorted(data.tolist()), 3)
        rows.append({
            "name": f"sort {n * 8} B", "bytes": n * 8, "seconds": seconds,
            "baseline_seconds": baseline, "ratio": seconds / baseline, "target": 1.0,
        })
    rows.append({"name": "sum", "seconds": np.float64(1e-6), "baseline_seconds": 2e-6,
                 "ratio": 0.5, "target": None})
    return rows
"""

HELPERS = """
import time


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
"""


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    directory = tmp_path / "suite"
    directory.mkdir()
    (directory / "bench_tiny.py").write_text(textwrap.dedent(TINY_BENCH))
    (directory / "bench_helpers.py").write_text(textwrap.dedent(HELPERS))
    return directory


@pytest.mark.slow
def test_bench_writes_json_plots_and_table(
    suite: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import matplotlib.image

    out = tmp_path / "results"
    assert cli.main(["bench", "--quick", "--suite", str(suite), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "bench.json").read_text())
    assert report["quick"] is True
    assert report["machine"]["platform"] == cupy_parallel.platform()
    assert report["machine"]["versions"]["NumPy"] == np.__version__
    [tiny] = report["suites"]  # bench_helpers defines no run(): a helper, not a suite
    assert tiny["name"] == "bench_tiny"
    assert tiny["ok"] is True
    assert [r["name"] for r in tiny["results"]] == ["sort 2048 B", "sort 32768 B", "sum"]
    for row in tiny["results"][:2]:
        assert row["ratio"] == pytest.approx(row["seconds"] / row["baseline_seconds"])
    for name, size in (("bench_ratios.png", None), ("bench_bandwidth.png", (500, 800, 4))):
        image = matplotlib.image.imread(out / name)
        assert image.shape[1:] == (1100, 4) if size is None else image.shape == size
        assert image[..., :3].std() > 0  # something is drawn
    unit = re.search(r"suite\s+benchmark\s+(\w?s)\s+baseline (\w?s)\s+ratio\s+spread", printed)
    assert unit is not None
    assert unit[1] == unit[2]
    number = r"[\d.e+-]+"
    assert re.search(
        rf"bench_tiny\s+sort 2048 B\s+{number}\s+{number}\s+{number}\s+-\s+1\s", printed
    )
    assert re.search(rf"bench_tiny\s+sum\s+{number}\s+{number}\s+0\.5\s+-\s+-\s+no target", printed)
    assert f"wrote {out / 'bench.json'}" in printed


def test_bench_reports_failing_suites_and_keeps_going(
    suite: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (suite / "bench_broken.py").write_text(
        "import no_such_module_xyz\n\ndef run(quick):\n    return []\n"
    )
    (suite / "bench_malformed.py").write_text("def run(quick):\n    return [{'name': 'x'}]\n")
    (suite / "bench_raises.py").write_text(
        "def run(quick):\n    raise RuntimeError('needs mpiexec')\n"
    )
    out = tmp_path / "results"
    assert cli.main(["bench", "--quick", "--suite", str(suite), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    report = json.loads((out / "bench.json").read_text())
    outcome = {s["name"]: (s["ok"], s["error"]) for s in report["suites"]}
    assert outcome == {
        "bench_broken": (False, "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
        "bench_malformed": (
            False,
            (
                "ValueError: result 0 ('x') lacks keys "
                "['seconds', 'baseline_seconds', 'ratio', 'target']"
            ),
        ),
        "bench_raises": (False, "RuntimeError: needs mpiexec"),
        "bench_tiny": (True, None),
    }
    assert "FAILED: RuntimeError: needs mpiexec" in captured.out
    assert "failed: bench_broken, bench_malformed, bench_raises" in captured.err
    assert (out / "bench_ratios.png").stat().st_size > 0


def test_bench_without_a_suite_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--suite", str(tmp_path), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cupy-parallel bench")
    assert f"{tmp_path} holds no bench_*.py module defining run(quick)" in err


def test_bench_series_groups_sizes_of_one_transfer() -> None:
    assert benchmarking._series("broadcast 4 MiB to 2 devices") == "broadcast to 2 devices"
    assert benchmarking._series("sort 2048 B") == benchmarking._series("sort 32768 B") == "sort"
    assert benchmarking._series("tape step") == "tape step"
    assert benchmarking._series("all_reduce 16 MiB, 2 ranks") == "all_reduce, 2 ranks"


def test_script_main_runs_one_module_prints_its_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[bool] = []

    def run(quick: bool) -> list[dict[str, object]]:
        calls.append(quick)
        return [
            {"name": "copy", "seconds": 0.003, "baseline_seconds": 0.002, "ratio": 1.5,
             "target": 1.2, "bytes": np.int64(8)},
        ]  # fmt: skip

    path = tmp_path / "rows.json"
    rows = benchmarking.script_main(run, "bench_copy", "Copies.", argv=["--json", str(path)])
    assert calls == [False]
    assert json.loads(path.read_text()) == rows
    assert rows[0]["bytes"] == 8  # NumPy scalars are written as plain numbers
    printed = capsys.readouterr().out
    assert re.search(r"bench_copy\s+copy\s+3\s+2\s+1\.5\s+-\s+1\.2\s+misses target", printed)
    assert re.search(r"suite\s+benchmark\s+ms\s+baseline ms\s", printed)
    assert f"wrote {path}" in printed
    with pytest.raises(SystemExit):
        benchmarking.script_main(run, "bench_copy", "Copies.", argv=["--bogus"])
    assert calls == [False]


def test_default_suite_is_the_repository_benchmarks() -> None:
    assert benchmarking.default_suite_dir() == Path(__file__).resolve().parent.parent / "benchmarks"


# --------------------------------------------------------------------------------------------
# launch


def test_launch_is_mounted(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["launch", "--help"])
    assert exit_info.value.code == 0
    assert "--nproc-per-node" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_shows_a_progress_bar_in_a_terminal(tmp_path: Path) -> None:
    import struct
    import threading

    fcntl = pytest.importorskip("fcntl")  # POSIX terminals
    pty = pytest.importorskip("pty")
    termios = pytest.importorskip("termios")

    leader, follower = pty.openpty()
    rows_cols = struct.pack("HHHH", 24, 100, 0, 0)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, rows_cols)  # a new pty is 0 columns wide
    shown = bytearray()

    def read_terminal() -> None:  # drain while the demo runs: a pty keeps little once closed
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the demo closed the terminal
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=read_terminal)
    reader.start()
    n = str(demo_device_count(2))
    command = [sys.executable, "-m", "cupy_parallel", "demo", "--steps", "3", "--devices", n]
    try:
        process = subprocess.Popen(
            [*command, "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=follower
        )
        os.close(follower)
        out, _ = process.communicate(timeout=120)
        reader.join(timeout=30)
    finally:
        os.close(leader)
    assert process.returncode == 0
    assert b"gradient check: passed" in out
    assert re.search(rb"training: 100%\S* *\| *3/3", bytes(shown)), bytes(shown)


def test_demo_unwritable_out_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    blocker = Path(os.devnull)  # a file, so no directory can be created under it
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--steps", "1", "--out", str(blocker / "sub" / "x.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cupy-parallel demo")
    assert "argument --out: cannot create the directory /dev/null/sub" in err


def test_demo_without_tqdm_or_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    argv = ["demo", "--steps", "2", "--devices", str(demo_device_count(2)), "--out", str(tmp_path)]
    assert cli.main(argv) == 1  # the promised PNG could not be written
    captured = capsys.readouterr()
    assert parse_demo(captured.out)["passed"] == 1.0  # training and the check still ran
    assert "(no progress bar: tqdm is not installed)" in captured.err
    assert "loss curve: not written, matplotlib is not installed" in captured.err
    assert not (tmp_path / cli.DEMO_PNG).exists()


@pytest.mark.gpu
def test_demo_refuses_more_gpus_than_exist(capsys: pytest.CaptureFixture[str]) -> None:
    count = len(cupy_parallel.devices())
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--devices", str(count + 1)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cupy-parallel demo")
    assert f"asked for {count + 1} GPUs, but CuPy sees {count}" in err
