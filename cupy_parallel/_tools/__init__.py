"""The tools built on the public package: the ``cupy-parallel`` CLI, demo, benchmarks, launcher.

This layer sits above the library: it imports ``cupy_parallel`` like any user does, and nothing in
``cupy_parallel._src`` imports it.
"""
