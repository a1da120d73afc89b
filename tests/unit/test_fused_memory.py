"""The fused selection of every memory (docs/selection.md#fused-ef) equals compensate + select +
update bit for bit, step after step, with snapshots taken and a round rolled back in between
(docs/wrapper.md#nonfinite): Top-k with momentum correction (μ 0 and 0.9, Nesterov on/off),
DGC's memory with each selection mode, plain error feedback. ``check_fused`` takes the
TensorOps, so tests/torch and tests/tf run the same comparison on their tensors."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import NumpyOps
from hvd_commopt.compress.dgc import DGCSelector
from hvd_commopt.memory.dgc import DGCMemory
from hvd_commopt.memory.error_feedback import ErrorFeedback
from hvd_commopt.memory.momentum import MomentumCorrection
from hvd_commopt.select.strategies import select_with_memory
from hvd_commopt.compress.topk import TopKSelector

N = 100_000  # above ExactTopK.small_n: the sampled bracket and the fused candidate pass run

CASES = {
    "mc_mu0": lambda: (TopKSelector(0.01), _bound(MomentumCorrection(), 0.0, False)),
    "mc_mu09": lambda: (TopKSelector(0.01), _bound(MomentumCorrection(), 0.9, False)),
    "mc_mu09_nesterov": lambda: (TopKSelector(0.01), _bound(MomentumCorrection(), 0.9, True)),
    "mc_mu09_thr": lambda: (TopKSelector(0.01, selection="threshold", tau=3),
                            _bound(MomentumCorrection(), 0.9, False)),
    "mc_nomask": lambda: (TopKSelector(0.01), _bound(MomentumCorrection(momentum_masking=False), 0.9, False)),
    "dgc_exact": lambda: (DGCSelector(0.01, selection="exact"), DGCMemory(0.9)),
    "dgc_exact_nesterov": lambda: (DGCSelector(0.01, selection="exact"), DGCMemory(0.9, nesterov=True)),
    "dgc_threshold": lambda: (DGCSelector(0.01, selection="threshold", tau=3), DGCMemory(0.9)),
    "dgc_sampled": lambda: (DGCSelector(0.01), DGCMemory(0.9)),
    "ef": lambda: (TopKSelector(0.01), ErrorFeedback()),
    "ef_thr": lambda: (TopKSelector(0.01, selection="threshold", tau=3), ErrorFeedback()),
}


def _bound(mem, mu, nesterov):
    mem.bind_momentum(mu, nesterov)
    return mem


def _state(ops, mem):
    """Every stored tensor of the memory as host arrays (u and v for DGC's, the residual else)."""
    sd = mem.state_dict()
    out = {}
    for part, tensors in sd.items():
        for name, t in tensors.items():
            out[(part, name)] = np.array(ops.to_numpy(t), copy=True)
    return out


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a)


def check_fused(ops, case: str, steps: int = 6, rollback_at: int = 3, snapshots: bool = True) -> None:
    comp_f, mem_f = CASES[case]()
    comp_u, mem_u = CASES[case]()
    rng = np.random.default_rng(7)
    like = ops.from_numpy(np.zeros(N, np.float32), like=None)
    for step in range(steps):
        x = rng.standard_normal(N).astype(np.float32)
        x[rng.integers(0, N, 50)] *= 30  # a few large entries, as real gradients have
        before = _state(ops, mem_f)
        if snapshots:
            mem_f.snapshot(ops, "", like, step)
            mem_u.snapshot(ops, "", like, step)
        vf, i_f = select_with_memory(comp_f, mem_f, ops, None, step, ops.from_numpy(x.copy(), like=like))
        acc = mem_u.compensate(ops, "", ops.from_numpy(x.copy(), like=like))
        vu, iu = comp_u.select(ops, acc, None, step)
        mem_u.update(ops, "", acc, iu)
        assert np.array_equal(np.asarray(ops.to_numpy(i_f)), np.asarray(ops.to_numpy(iu))), (case, step)
        assert np.array_equal(np.asarray(ops.to_numpy(vf)).view(np.uint32),
                              np.asarray(ops.to_numpy(vu)).view(np.uint32)), (case, step)
        assert _same(_state(ops, mem_f), _state(ops, mem_u)), (case, step)
        if snapshots and step == rollback_at:  # the reduced bucket came back non-finite
            assert mem_f.rollback(ops, "", step) and mem_u.rollback(ops, "", step)
            assert _same(_state(ops, mem_f), before), (case, step)
            assert _same(_state(ops, mem_u), before), (case, step)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_compensate_select_update_with_rollback(case):
    check_fused(NumpyOps(), case)


@pytest.mark.parametrize("case", ["mc_mu09", "mc_mu09_nesterov", "dgc_exact", "ef"])
def test_fused_equals_unfused_without_snapshots(case):
    """Without snapshots (no rollback possible) the memories accumulate in place."""
    check_fused(NumpyOps(), case, snapshots=False)


def test_rollback_after_a_later_snapshot_is_refused_and_state_kept():
    """Delayed schedules: a later round already built on the memory, so the rollback of the
    earlier round returns False and nothing changes."""
    ops = NumpyOps()
    comp, mem = CASES["dgc_exact"]()
    like = np.zeros(N, np.float32)
    rng = np.random.default_rng(1)
    for step in range(2):
        mem.snapshot(ops, "", like, step)
        select_with_memory(comp, mem, ops, None, step, rng.standard_normal(N).astype(np.float32))
    state = _state(ops, mem)
    assert not mem.rollback(ops, "", 0)
    assert _same(_state(ops, mem), state)
