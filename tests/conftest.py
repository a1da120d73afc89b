"""Test tiers: ``-m "not slow"`` is the fast tier (no mpirun job, no convergence run; about two
minutes on a 2-core machine), ``-m slow`` the rest. CI runs both (.ci/run); the README's command
runs everything at once."""
from __future__ import annotations

from pathlib import Path

import pytest

_PARALLEL = Path(__file__).resolve().parent / "parallel"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _PARALLEL in Path(str(item.fspath)).resolve().parents:  # real mpirun jobs
            item.add_marker(pytest.mark.slow)
