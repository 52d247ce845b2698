"""Test-suite set-up shared by tests/ and the doctests in cupy_parallel/."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

import cupy_parallel
import cupy_parallel.distributed  # relabels its public names before doctests are collected
from cupy_parallel._src.devices import cuda_device_count

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

HOST_DEVICES = 8

# "default" keeps the whole suite within minutes on 2 cores; HYPOTHESIS_PROFILE=thorough runs the
# 2,000-example searches the issues ask for.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=_SLOW_OK, print_blob=True
)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=_SLOW_OK, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests cleanly when CuPy sees no GPU."""
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CuPy sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start tests/test_typing.py's mypy run in the background when its tests are selected.

    A process of its own (about 20 s of CPU from a cold cache): on 2 cores it checks while the
    tests before it run, instead of after them. Not in pytest-xdist's workers: each collects every
    test but runs only some, so each would start its own run; there the other worker's tests
    overlap the run that ``mypy_output`` starts.
    """
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    for item in session.items:
        if item.path.name == "test_typing.py" and "mypy_output" in getattr(
            item, "fixturenames", ()
        ):
            module = item.module  # type: ignore[attr-defined]
            module.start_mypy()
            _background.append(module.stop_mypy)
            return


_background: list[Callable[[], None]] = []
"""What ends the background work started for the tests (called when the session finishes)."""


def pytest_sessionfinish(session: pytest.Session) -> None:
    """End the background work (a run nobody waited for: the session stopped early)."""
    for stop in _background:
        stop()


@pytest.fixture(autouse=True)
def _host_devices() -> Iterator[None]:
    """Every test (and doctest) starts with 8 host devices, whatever an earlier one set."""
    cupy_parallel.set_host_device_count(HOST_DEVICES)
    yield
    cupy_parallel.set_host_device_count(HOST_DEVICES)


@pytest.fixture(params=["legacy", "non-blocking", "per-thread"])
def simulated_streams(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a ``simulated_cuda`` test on each kind of current stream (issue 37).

    See ``stream_environment`` in ``tests/helpers.py``.
    """
    from helpers import stream_environment  # tests/ is on sys.path once tests are collected

    with stream_environment(request.param) as kind:
        yield kind


@pytest.fixture(autouse=True)
def _doctests_are_worlds_of_one(request: pytest.FixtureRequest) -> Iterator[None]:
    """The doctests show ``init_process_group("mpi")`` as a script run under ``mpiexec`` has it.

    Here they run in one process, a world of one on purpose: the warning of a forgotten
    launcher (issue 34) is not raised for them. Tests pass ``world_size=1`` instead.
    """
    if not isinstance(request.node, pytest.DoctestItem):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"init_process_group\(\) made a world of one")
        yield
