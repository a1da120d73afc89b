"""The convergence matrix's short version (docs/convergence-matrix.md#ci-guard): every algorithm at
its defaults on the digits MLP, 2 ranks, one seed, SGD lr 0.1 momentum 0.9, cosine decay, under a
real ``mpirun``; each one's final test accuracy against S-SGD's in the same job.

The bounds are the measured gaps (docs/convergence-matrix.md#measured), not the target: each
algorithm must reach its measured gap less 1.5 points (one seed's gap moves by about that much
between seeds on this task; one test image is 0.28 points), so a regression fails and an
improvement does not.
"""
import json
import sys

import pytest

from tests.parallel.launch import run_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")
pytest.importorskip("sklearn")

ONE_SEED_MARGIN = 1.5  # points: one seed's gap moves by about this much between seeds on this task
# the gap (points, vs S-SGD's 97.22 %) each algorithm showed in the matrix at this set-up, seed 0
# (docs/convergence-matrix.md#measured); random-k at 1 % diverges and is warned about instead.
# 2026-11-26 evening, from measured seed-0 runs only (docs/convergence-matrix.md#ci-guard): gTop-k and
# Ok-Topk -0.83 (masking only what the merge applied), Top-k -0.28, LAGS -0.28 and SSD + Top-k -0.55
# (masking off by default for Top-k).
MEASURED_GAP = {
    "topk": -0.28, "gtopk": -0.83, "oktopk": -0.83, "lags": -0.28, "dgc": -0.55, "od": -0.28, "ssd": -0.28,
    "ssd_topk": -0.55, "cd": 0.28, "od_dgc": -1.11, "cocod": 0.56, "local_sgd": 0.28,
}
EPOCHS = 10


@pytest.mark.slow
def test_every_algorithm_at_its_defaults_trains_the_digits_mlp_like_ssgd():
    variants = ["ssgd", *MEASURED_GAP]
    proc = run_mpi(2, [sys.executable, "-m", "benchmarks.convergence", "--task", "digits_mlp", "--epochs",
                       str(EPOCHS), "--variants", ",".join(variants)], timeout=1200)
    acc = {}
    for ln in proc.stdout.splitlines():
        if ln.startswith("CONV "):
            r = json.loads(ln[5:])
            acc[r["variant"]] = r["acc"]
    assert sorted(acc) == sorted(variants), proc.stdout[-3000:]
    ssgd = acc.pop("ssgd")
    assert ssgd > 95.0, acc
    low = {name: round(a - ssgd, 2) for name, a in acc.items() if a - ssgd < MEASURED_GAP[name] - ONE_SEED_MARGIN}
    assert not low, f"below the measured gap less {ONE_SEED_MARGIN} points: {low} (S-SGD {ssgd:.2f}%, all: {acc})"
