"""Schedules (OD/SSD/CD/CoCoD/local SGD) under a real ``mpirun`` with 2 and 4 ranks, and the
digits convergence check (2 ranks)."""
import json

import pytest

from tests.parallel.launch import ROOT, run_mpi, run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


@pytest.mark.parametrize("np", [2, 4])
def test_schedule_invariants_under_mpirun(np):
    run_pytest_mpi(np, "tests/parallel/mpi_schedules.py", timeout=500)


def test_schedules_converge_like_ssgd_on_digits():
    pytest.importorskip("sklearn")
    import sys
    proc = run_mpi(2, [sys.executable, str(ROOT / "tests/parallel/mpi_digits.py")], timeout=300)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("DIGITS "))
    acc = json.loads(line[len("DIGITS "):])
    ssgd = acc.pop("ssgd")
    assert ssgd > 90.0, acc
    for name, a in acc.items():
        assert a >= ssgd - 1.0, f"{name}: {a:.2f}% vs SSGD {ssgd:.2f}% (all: {acc})"


#: The algorithms whose defaults the convergence matrix shows training short of S-SGD on the digits
#: CNN at 2 ranks, with the bound this single-seed check gives them (points): LAGS (Top-k with one
#: bucket per layer) -0.65 over 3 seeds (-0.83 to -0.56) on an Intel Xeon (docs/convergence-matrix.md;
#: the library warns, #warnings), and -1.11 on seed 0 on an AMD EPYC (2026-11-27: the same seed, other
#: float rounding in the CPU's kernels, so another trajectory). Every other algorithm keeps 1 point.
SHORT_ON_DIGITS_CNN = {"lags": 1.5}


@pytest.mark.slow
def test_every_algorithm_converges_like_ssgd_on_digits_at_lr_01_momentum_09():
    """The library's defaults for every algorithm, what users run (SGD lr 0.1, momentum 0.9, cosine
    decay), 2 ranks, the digits CNN: within 1 point of S-SGD (benchmarks/convergence.py;
    random-k at density 0.3, where it is measured to train, docs/topk.md#randomk-momentum)."""
    pytest.importorskip("sklearn")
    import sys
    variants = "ssgd,topk,gtopk,lags,omgs,dgc,randomk_d03,od,ssd,cd,cocod,local_sgd"
    proc = run_mpi(2, [sys.executable, "-m", "benchmarks.convergence", "--task", "digits", "--epochs", "10",
                       "--variants", variants], timeout=400)
    acc = {}
    for ln in proc.stdout.splitlines():
        if ln.startswith("CONV "):
            r = json.loads(ln[5:])
            acc[r["variant"]] = r["acc"]
    assert sorted(acc) == sorted(variants.split(",")), proc.stdout[-3000:]
    ssgd = acc.pop("ssgd")
    assert ssgd > 95.0, acc
    for name, a in acc.items():
        bound = SHORT_ON_DIGITS_CNN.get(name, 1.0)
        assert a >= ssgd - bound, f"{name}: {a:.2f}% vs SSGD {ssgd:.2f}%, bound {bound} points (all: {acc})"

