"""The ``cupy-parallel`` command (also ``python -m cupy_parallel``).

Subcommands:

- ``info``: the platform, its devices (with memory) and the versions of everything the library
  can use; a missing piece reads "not installed" or "not available (reason)", never a traceback.
- ``demo``: trains a small MLP with :class:`~cupy_parallel.DataParallel` on every device, checks
  the first step's gradients against one device, and writes the loss curve as a PNG.
- ``bench``: runs the ``benchmarks/`` suite, writes ``bench.json`` and PNG plots, prints a table.
- ``launch``: starts one process per device for :mod:`cupy_parallel.distributed` programs.

Heavy modules (CuPy, matplotlib, mpi4py, tqdm) are imported only by the subcommand that needs
them, so ``cupy-parallel --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _system
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cupy_parallel
from cupy_parallel._src.cuda import nccl_runtime as cuda_nccl
from cupy_parallel._src.cuda.nccl_tables import version_string
from cupy_parallel._src.devices import Device, cupy_module

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["build_parser", "collect_info", "format_info", "main"]

#: The demo's default output file, written to the working directory (or into ``--out`` when that
#: is a directory).
DEMO_PNG = "cupy_parallel_demo.png"
#: Host devices the demo uses when the platform is host and ``--devices`` is not given.
DEMO_HOST_DEVICES = 4


# --------------------------------------------------------------------------------------------
# info


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def _probe(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - info reports any failure as text, never a traceback
        return f"not available ({_reason(error)})"


def _cupy_versions() -> dict[str, str]:
    cupy = cupy_module()
    if cupy is None:
        missing = "not installed (pip install 'cupy-cuda12x[ctk]': the cuda12 extra)"
        return {"CuPy": missing, "CUDA runtime": missing, "CUDA driver": missing, "NCCL": missing}
    runtime = cupy.cuda.runtime

    def driver() -> str:
        number = int(runtime.driverGetVersion())
        if number == 0:
            return "not available (no NVIDIA driver)"
        return _cuda_version(number)

    def nccl() -> str:
        module = cuda_nccl.nccl_module()
        if module is None:
            return f"not available ({cuda_nccl.unavailable_reason()})"
        return version_string(int(module.get_version()))

    return {
        "CuPy": str(cupy.__version__),
        "CUDA runtime": _probe(lambda: _cuda_version(int(runtime.runtimeGetVersion()))),
        "CUDA driver": _probe(driver),
        "NCCL": _probe(nccl),
    }


def _mpi_version() -> str:
    try:
        import mpi4py
    except ImportError:
        return "not installed (pip install mpi4py mpich, or the mpi extra of cupy-parallel)"

    def library() -> str:
        from mpi4py import MPI

        first = str(MPI.Get_library_version()).strip().splitlines()[0]
        return f"{' '.join(first.split())} (mpi4py {mpi4py.__version__})"

    return _probe(library)


def _host_memory() -> tuple[int, int] | None:
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):  # not a POSIX system with these names
        return None


def _device_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    listed = cupy_parallel.devices()
    if listed and listed[0].kind == "cuda":
        cupy = listed[0].xp
        for device in listed:
            row: dict[str, Any] = {"device": str(device)}
            try:
                props = cupy.cuda.runtime.getDeviceProperties(device.index)
                name = props["name"]
                row["name"] = name.decode() if isinstance(name, bytes) else str(name)
                with cupy.cuda.Device(device.index):
                    free, total = cupy.cuda.runtime.memGetInfo()
                row["total_bytes"], row["free_bytes"] = int(total), int(free)
            except Exception as error:  # noqa: BLE001 - a sick GPU is reported, not fatal
                row["error"] = _reason(error)
            rows.append(row)
        return rows
    memory = _host_memory()
    for device in listed:
        row = {"device": str(device), "name": "simulated accelerator in host memory"}
        if memory is not None:
            row["total_bytes"], row["free_bytes"] = memory
        rows.append(row)
    return rows


def collect_info() -> dict[str, Any]:
    """What ``cupy-parallel info`` reports, as a JSON-ready dict.

    Keys: ``platform``, ``system``, ``versions`` (label → version text; a missing piece reads
    ``"not installed ..."`` or ``"not available (reason)"``) and ``devices`` (one dict per device
    of the platform with ``device``, ``name`` and, where known, ``total_bytes``/``free_bytes``;
    host devices share the machine's memory, so they report it).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> info = collect_info()
        >>> info["platform"] == cupy_parallel.platform()
        True
        >>> info["versions"]["NumPy"] == np.__version__
        True
    """
    import numpy as np
    import optree

    versions = {
        "cupy_parallel": cupy_parallel.__version__,
        "Python": _system.python_version(),
        "NumPy": np.__version__,
        "optree": str(optree.__version__),
        **_cupy_versions(),
        "MPI": _mpi_version(),
    }
    return {
        "platform": cupy_parallel.platform(),
        "system": f"{_system.platform()} ({os.cpu_count()} CPUs)",
        "versions": versions,
        "devices": _device_rows(),
    }


def _gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def format_info(info: dict[str, Any], /) -> str:
    """The text ``cupy-parallel info`` prints for a :func:`collect_info` dict.

    Example:
        >>> print(format_info({"platform": "host", "system": "Linux", "versions": {"NumPy": "2.4"},
        ...                    "devices": [{"device": "host:0", "name": "simulated"}]}))
        platform       host (1 device)
        system         Linux
        NumPy          2.4
        devices:
          host:0  simulated
    """
    count = len(info["devices"])
    lines = [
        f"{'platform':<15}{info['platform']} ({count} device{'s' if count != 1 else ''})",
        f"{'system':<15}{info['system']}",
    ]
    lines += [f"{label:<15}{text}" for label, text in info["versions"].items()]
    lines.append("devices:")
    for row in info["devices"]:
        text = f"  {row['device']:<7} {row.get('name', '')}"
        if "total_bytes" in row:
            text += f" (memory {_gib(row['total_bytes'])}, free {_gib(row['free_bytes'])})"
        if "error" in row:
            text += f" (not available: {row['error']})"
        lines.append(text)
    return "\n".join(lines)


def _info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


# --------------------------------------------------------------------------------------------
# demo


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _demo_devices(requested: int | None, parser: argparse.ArgumentParser) -> list[Device]:
    if cupy_parallel.platform() == "cuda":
        available = cupy_parallel.devices()
        if requested is not None and requested > len(available):
            parser.error(
                f"argument --devices: asked for {requested} GPUs, but CuPy sees {len(available)}"
            )
        return available[: requested or len(available)]
    cupy_parallel.set_host_device_count(requested or DEMO_HOST_DEVICES)
    return cupy_parallel.devices()


def _demo_out(text: str, parser: argparse.ArgumentParser) -> Path:
    """Where the loss curve goes, read from ``--out``.

    ``--out`` names a PNG file; ``.png`` is appended when it has no extension (matplotlib's
    habit), and an existing directory (or a path ending in ``/``) gets :data:`DEMO_PNG` inside
    it. Missing parent directories are created.
    """
    path = Path(text)
    if path.is_dir() or text.endswith(("/", os.sep)):
        path = path / DEMO_PNG
    elif not path.suffix:
        path = path.with_name(f"{path.name}.png")
    elif path.suffix.lower() != ".png":
        parser.error(f"argument --out: the loss curve is a PNG file, got {text!r}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"argument --out: cannot create the directory {path.parent}: {error}")
    return path


def _progress_bar(total: int) -> tuple[Callable[[Sequence[float]], None] | None, Any]:
    """A tqdm bar on stderr fed with the losses; disabled when stderr is not a terminal."""
    try:
        from tqdm import tqdm
    except ImportError:
        print("(no progress bar: tqdm is not installed)", file=sys.stderr)
        return None, None
    bar = tqdm(total=total, desc="training", unit="step", file=sys.stderr, disable=None)

    def update(losses: Sequence[float]) -> None:
        bar.update(1)
        if len(losses) % 10 == 1:
            bar.set_postfix(loss=f"{losses[-1]:.4g}", refresh=False)

    return update, bar


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cupy_parallel._tools import demo

    devices = _demo_devices(args.devices, parser)
    out = _demo_out(args.out, parser)
    config = demo.DemoConfig(
        devices=tuple(devices),
        steps=args.steps,
        seed=args.seed,
        dtype=args.dtype,
        batch_size=args.batch_size,
    )
    names = ", ".join(str(d) for d in devices)
    print(
        f"Training a {config.features}-{config.hidden}-{config.classes} MLP classifier "
        f"({config.dtype}, batch "
        f"{config.batch_size}) for {config.steps} SGD steps with DataParallel on "
        f"{len(devices)} device{'s' if len(devices) != 1 else ''}: {names}"
    )
    progress, bar = _progress_bar(config.steps)
    try:
        result = demo.train(config, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    verdict = "passed" if result.passed else "FAILED"
    print(
        f"gradient check: {verdict}, max |DataParallel - one device| = "
        f"{result.max_abs_difference:.3e} (tolerance {result.tolerance:.0e})"
    )
    print(f"loss: first {result.losses[0]:.6g}, last {result.losses[-1]:.6g}")
    print(
        f"throughput: {result.samples_per_second:,.0f} samples/s "
        f"({result.samples} samples in {result.seconds:.3f} s)"
    )
    try:
        demo.plot_losses(
            result.losses,
            out,
            title=f"DataParallel MLP on {len(devices)} × {devices[0].kind}",
        )
    except ImportError:
        print("loss curve: not written, matplotlib is not installed", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"loss curve: not written, {error}", file=sys.stderr)
        return 1
    print(f"loss curve: {out}")
    return 0 if result.passed else 1


# --------------------------------------------------------------------------------------------
# bench


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cupy_parallel._tools import benchmarking

    suite = args.suite if args.suite is not None else benchmarking.default_suite_dir()
    if suite is None or not suite.is_dir():
        parser.error(
            "argument --suite: no benchmark suite found (no benchmarks/ beside the package, no "
            "cupy_parallel.benchmarks installed); pass --suite DIR"
            if suite is None
            else f"argument --suite: {suite} is not a directory"
        )
    modules = benchmarking.discover(suite)
    if not modules:
        parser.error(f"argument --suite: {suite} holds no bench_*.py module defining run(quick)")
    report = benchmarking.run_all(modules, quick=args.quick, machine=collect_info)
    paths = benchmarking.write_outputs(report, args.out)
    print(benchmarking.format_table(report))
    for path in paths:
        print(f"wrote {path}")
    failed = [s["name"] for s in report["suites"] if not s["ok"]]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# the parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cupy-parallel``, with one subparser per subcommand.

    Example:
        >>> parser = build_parser()
        >>> args = parser.parse_args(["demo", "--steps", "5"])
        >>> args.command, args.steps, args.devices
        ('demo', 5, None)
    """
    parser = argparse.ArgumentParser(
        prog="cupy-parallel",
        description="Multi-device arrays for CuPy and NumPy: inspect, demo, benchmark, launch.",
    )
    parser.add_argument("--version", action="version", version=cupy_parallel.__version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser(
        "info",
        help="platform, devices and versions",
        description="Print the platform, its devices (with memory) and the versions of Python, "
        "NumPy, optree, CuPy, CUDA, NCCL and MPI.",
    )
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(handler=_info, command_parser=info)

    demo = commands.add_parser(
        "demo",
        help="train a small MLP with DataParallel on every device",
        description="Train a small MLP classifier with DataParallel on every available device "
        f"(every GPU; without one, {DEMO_HOST_DEVICES} host devices), check the first step's "
        "gradients against one device, report loss and throughput and write the loss curve. "
        "Exits with status 1 when the gradient check fails.",
    )
    demo.add_argument("--steps", type=_positive_int, default=200, help="SGD steps (default 200)")
    demo.add_argument(
        "--devices",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"use N devices (default: every GPU, or {DEMO_HOST_DEVICES} host devices)",
    )
    demo.add_argument(
        "--out",
        default=DEMO_PNG,
        help=f"PNG file for the loss curve ('.png' is appended when there is no extension), or "
        f"an existing directory to write {DEMO_PNG} into (default ./{DEMO_PNG})",
    )
    demo.add_argument("--seed", type=int, default=0, help="seeds data and parameters (default 0)")
    demo.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="float64 (checked to 1e-10, the default) or float32 (checked to 1e-4)",
    )
    demo.add_argument(
        "--batch-size", type=_positive_int, default=512, help="samples per step (default 512)"
    )
    demo.set_defaults(handler=_demo, command_parser=demo)

    bench = commands.add_parser(
        "bench",
        help="run the benchmark suite, write JSON and PNG plots",
        description="Run every bench_*.py module of the benchmark suite (each exposes "
        "run(quick) -> list of result dicts), write bench.json (results and machine info) and "
        "PNG plots to --out, and print a table. A suite that fails to import or run is reported "
        "as failed and the others still run; the exit status is then 1.",
    )
    bench.add_argument(
        "--suite",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory of bench_*.py modules (default: benchmarks/ next to the package)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="short runs (smaller sizes, fewer repeats)"
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("bench_results"),
        help="output directory (default ./bench_results)",
    )
    bench.set_defaults(handler=_bench, command_parser=bench)

    from cupy_parallel._tools import launch as launcher

    launch = commands.add_parser(
        "launch",
        help="start one process per device for a distributed program",
        description="Start N copies of `python script.py args...` on this node (or under "
        "mpiexec with --backend mpi), each with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
        "MASTER_PORT set, so that cupy_parallel.distributed.init_process_group finds the others. "
        "Several nodes: run it on each with the same --nnodes, --master-addr and --master-port.",
    )
    launcher.add_arguments(launch)
    launch.set_defaults(handler=lambda args, _parser: launcher.run(args), command_parser=launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cupy-parallel`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    Argument errors print the usage and exit with status 2 (argparse's ``SystemExit``); a
    subcommand reports errors found after parsing (``demo --devices`` beyond the GPU count, a
    ``bench --suite`` without benchmarks) the same way, with its own usage line.

    Example:
        >>> main(["info"])  # doctest: +ELLIPSIS
        platform ...
        NumPy ...
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace, argparse.ArgumentParser], int] = args.handler
    return handler(args, args.command_parser)
