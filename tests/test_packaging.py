"""Packaging: the wheel holds every package and the benchmark suite, and works without a checkout.

The oracle is the tree itself (every directory with an ``__init__.py`` under ``cupy_parallel/``
must be listed in ``pyproject.toml``) and a wheel built from it, unpacked and imported from
another directory, as a user who ran ``pip install`` would.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_listed_packages_are_every_package_of_the_tree() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]  # type: ignore[index]
    listed = set(setuptools["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "cupy_parallel").rglob("__init__.py")
    }
    assert listed - {"cupy_parallel.benchmarks"} == found
    assert setuptools["package-dir"] == {"cupy_parallel.benchmarks": "benchmarks"}


def test_license_is_an_spdx_string_with_its_file() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "BSD-3-Clause"  # type: ignore[index]
    assert project["license-files"] == ["LICENSE"]  # type: ignore[index]
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
        timeout=240,
        capture_output=True,
    )  # fmt: skip
    [built] = out.glob("cupy_parallel-*.whl")
    return built


@pytest.mark.slow
def test_wheel_ships_the_benchmark_suite_and_the_license(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    suite = {Path(n).name for n in names if n.startswith("cupy_parallel/benchmarks/")}
    assert {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")} <= suite
    assert "cupy_parallel/py.typed" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)


@pytest.mark.slow
def test_installed_copy_finds_its_suite_without_a_checkout(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import cupy_parallel\n"
        "from cupy_parallel._tools.benchmarking import default_suite_dir, discover\n"
        "print(cupy_parallel.__file__)\n"
        "print(sorted(p.name for p in discover(default_suite_dir())))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=elsewhere,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    location, modules = done.stdout.splitlines()
    assert location.startswith(str(site))
    expected = sorted(
        p.name for p in (ROOT / "benchmarks").glob("bench_*.py") if "def run(" in p.read_text()
    )
    assert modules == repr(expected)
