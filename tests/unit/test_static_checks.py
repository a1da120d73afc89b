"""The static checks of CI's fast tier: ruff over the library, the adapters, the tests, the
benchmarks and the examples, and mypy over hvd_commopt/ (rules and strictness in pyproject.toml;
the test extra installs both, pinned)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff() -> None:
    r = _run("ruff", "check", "--no-cache", "hvd_commopt", "torch_plugin", "tf_plugin", "tests", "benchmarks", "examples",
             "setup.py")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy() -> None:
    r = _run("mypy")  # the files and the strictness: [tool.mypy] in pyproject.toml
    assert r.returncode == 0, r.stdout + r.stderr
