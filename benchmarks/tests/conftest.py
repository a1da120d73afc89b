"""The benchmark harness's tests. Those that launch ranks under ``mpirun`` or on emulated hosts
are CI's slow tier, as tests/parallel is (tests/conftest.py); the rest are fast."""
from __future__ import annotations

from pathlib import Path

import pytest

_MPIRUN = {"test_bench_quick.py", "test_netemu.py", "test_launcher_netemu.py"}


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.parent == here and path.name in _MPIRUN:
            item.add_marker(pytest.mark.slow)
