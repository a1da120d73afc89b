"""Test tiers: ``-m "not slow"`` is the fast tier (no mpirun job, no convergence run; about two
minutes on a 2-core machine), ``-m slow`` the rest. CI runs both (.ci/run); the README's command
runs everything at once."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Triton and TensorFlow each carry their own LLVM. Loaded after TensorFlow's, Triton's library
# registers LLVM's command-line options a second time and LLVM aborts the process ("LLVM ERROR:
# inconsistency in registered CommandLine options", then "Fatal Python error: Aborted"); loaded
# first, both work. A torch test module imports TensorFlow at collection, and torch imports
# Triton lazily (the first optimizer built imports torch._dynamo, which imports Triton, often on
# an in-process rank thread), so where Triton is installed it is imported here, before any test
# module (docs/backends.md#triton-and-tensorflow).
if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401

_PARALLEL = Path(__file__).resolve().parent / "parallel"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _PARALLEL in Path(str(item.fspath)).resolve().parents:  # real mpirun jobs
            item.add_marker(pytest.mark.slow)
