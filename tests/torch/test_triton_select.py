"""The Triton select (torch_plugin/triton_select.py, docs/selection.md#triton-select) picks the torch
route's set bit for bit, ties, -0.0, NaN and Inf included, with no host synchronisation.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: Triton reads
``TRITON_INTERPRET=1`` when it is imported, so the cases run in a process started with it
(tests/torch/triton_interpreted.py). Both the candidate buffer's usual path and its overflow path
(the radix select finished on the data) are forced by the capacity. Skipped where triton is not
installed (CPU builds of torch do not ship it, and the test extra does not install it:
docs/selection.md#triton-select)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_commopt.select import device  # noqa: E402
from torch_plugin import device_route_ops as device_route  # noqa: E402
from torch_plugin import ops as torch_ops  # noqa: E402
from torch_plugin import triton_select  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not triton_select.AVAILABLE,
                                  reason="triton is not installed (pip install triton); the torch-op route is tested")
# on a GPU the kernels themselves are compared with the torch route (test_on_cuda_...)
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the compiled kernels are tested")


def _interpreted(case: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.torch.triton_interpreted", case], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow  # ~40 s: 72 selections in Triton's interpreter
@needs_triton
@interpreted
def test_the_triton_select_equals_the_torch_route():
    _interpreted("equal")


@needs_triton
@interpreted
def test_the_glue_between_the_kernels_makes_no_host_sync():
    """Also threshold reuse's glue, accepted and recomputed."""
    _interpreted("glue")


@pytest.mark.slow  # ~60 s: 120 reused steps in Triton's interpreter
@needs_triton
@interpreted
def test_triton_threshold_reuse_equals_the_torch_route():
    """In the band, over and under it, at the age limit, ties, zeros, NaN/Inf (docs/selection.md#triton-reuse)."""
    _interpreted("reuse")


@pytest.mark.slow  # ~3 min: 72 fused selections in Triton's interpreter
@needs_triton
@interpreted
def test_the_fused_error_feedback_add_equals_the_torch_route():
    """The sum's bits (NaN payloads included), the selection and the carried threshold, exact and
    reused (docs/selection.md#triton-fused-ef)."""
    _interpreted("fused_add")


@pytest.mark.slow  # ~90 s: 42 memory steps in Triton's interpreter
@needs_triton
@interpreted
def test_error_feedback_steps_with_the_kernels_equal_the_torch_route():
    """ErrorFeedback.compensate_select on the device route, exact and threshold reuse, the kernels
    forced on CPU tensors: values, indices and residuals bit for bit."""
    _interpreted("memory_steps")


def test_only_large_float32_cuda_tensors_take_it():
    t = torch.zeros(triton_select.MIN_N + 1)
    assert not device_route._triton_takes(t, 10)  # a CPU tensor: the torch route
    prev = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert torch_ops.TorchOps().threshold_reuse(t, 10, 8, 12, 16, prev) is None  # so reuse_candidates runs
    assert torch_ops.TorchOps().add_topk_abs_index(t, t, None, 10) is None  # so the add runs first
    assert torch_ops.TorchOps().add_threshold_reuse(t, t, None, 10, 8, 12, 16, prev) is None
    assert triton_select.adds(t, t, None) and not triton_select.adds(t, t[:-1], None)
    assert not triton_select.adds(t, t.double(), None) and not triton_select.adds(t, t, torch.zeros(4, 2))
    assert triton_select.capacity(100, 90) == 100 and triton_select.capacity(10**8, 10**6) == 4 * 10**6 + 4096


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@needs_triton
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "nonfinite"])
def test_on_cuda_the_triton_select_equals_the_torch_route(monkeypatch, kind):
    from tests.torch.triton_interpreted import data
    ops = torch_ops.TorchOps()
    for n, k in ((1 << 21, 20_000), ((1 << 22) + 3, 400_000)):
        t = data(kind, n, seed=k).cuda()
        assert device_route._triton_takes(t, k)
        got, ranked = ops.topk_abs_index(t, k), ops.topk_abs_ranked(t, k)
        with monkeypatch.context() as m:
            m.setattr(device_route, "TRITON_SELECT", False)
            want, wranked = ops.topk_abs_index(t, k), ops.topk_abs_ranked(t, k)
        assert torch.equal(got, want), (kind, n, k)
        assert torch.equal(ranked[0], wranked[0]) and torch.equal(ranked[1], wranked[1])
        assert np.array_equal(np.diff(got.cpu().numpy()) > 0, np.ones(k - 1, bool))  # ascending
        keys = wranked[1]
        for thr, age in ((keys[k - 1:k], 0), (keys[k // 2:k // 2 + 1], 0), (keys[k - 1:k], 16)):  # in, under, age
            prev = (thr.clone(), torch.tensor([age], device="cuda"))
            native = ops.threshold_reuse(t, k, int(k * 0.8), int(k * 1.2), 16, prev)
            assert native is not None
            top, valid, state = native
            got_sel = device.padded(ops, t, top, valid)
            with monkeypatch.context() as m:
                m.setattr(device_route, "TRITON_SELECT", False)
                assert ops.threshold_reuse(t, k, int(k * 0.8), int(k * 1.2), 16, prev) is None
                wtop, wvalid, wstate = device.reuse_candidates(ops, t, k, int(k * 0.8), int(k * 1.2), 16, prev)
            want_sel = device.padded(ops, t, wtop, wvalid)
            assert torch.equal(got_sel[1], want_sel[1]) and torch.equal(got_sel[0].view(torch.int32),
                                                                        want_sel[0].view(torch.int32))
            assert torch.equal(state[0], wstate[0]) and torch.equal(state[1], wstate[1])
        r = data("normal" if kind == "nonfinite" else kind, t.numel(), seed=k + 1).cuda()
        for out in (None, torch.empty_like(t)):  # the add fused: the sum's bits and its selection
            acc, idx = ops.add_topk_abs_index(r.clone(), t, out, k)
            want_acc = r.clone().add_(t)
            assert torch.equal(acc.view(torch.int32), want_acc.view(torch.int32))
            with monkeypatch.context() as m:
                m.setattr(device_route, "TRITON_SELECT", False)
                assert torch.equal(idx, ops.topk_abs_index(want_acc, k))


@pytest.mark.slow  # ~20 s: ptxas on the kernels
@needs_triton
def test_the_kernels_compile_for_an_h100_without_one():
    """Each kernel lowers to a cubin for sm_90 (Triton's own ptxas; no GPU needed): what the
    interpreter cannot show (the language's GPU lowering of histogram, cumsum, atomics)."""
    import triton
    from triton.backends.compiler import GPUTarget
    K, p = triton_select.kernels(), "*i32"
    f = "*fp32"
    gated = {"gate_ptr": p, "state_ptr": p, "ctr_ptr": p, "cap": "i32"}
    cases = [
        (K.histogram, {"bits_ptr": p, "n": "i32", "hist_ptr": p, **gated}, {"LEVEL": 1, "BINS": 2048, "MODE": 0}),
        (K.histogram, {"bits_ptr": p, "n": "i32", "hist_ptr": p, **gated}, {"LEVEL": 3, "BINS": 512, "MODE": 3}),
        (K.add_histogram, {"a_ptr": f, "b_ptr": f, "dst_ptr": f, "n": "i32", "hist_ptr": p}, {}),
        (K.find_bin, {"hist_ptr": p, "state_ptr": p, "gate_ptr": p, "ctr_ptr": p, "cap": "i32", "k": "i32"},
         {"LEVEL": 1, "BINS": 2048, "MODE": 0}),
        (K.find_bin, {"hist_ptr": p, "state_ptr": p, "gate_ptr": p, "ctr_ptr": p, "cap": "i32", "k": "i32"},
         {"LEVEL": 3, "BINS": 512, "MODE": 1}),
        (K.split, {"bits_ptr": p, "n": "i32", "state_ptr": p, "out_ptr": p, "cand_idx_ptr": p, "cand_key_ptr": p,
                   "ctr_ptr": p, "gate_ptr": p}, {"CAP": 1_004_096}),
        (K.cand_histogram, {"cand_key_ptr": p, "hist_ptr": p, **gated}, {"LEVEL": 2, "BINS": 2048}),
        (K.cand_write, {"cand_idx_ptr": p, "cand_key_ptr": p, **gated, "out_ptr": p}, {}),
        (K.above_threshold, {"bits_ptr": p, "n": "i32", "thr_ptr": p, "out_ptr": p, "ctr_ptr": p, "cap": "i32"}, {}),
        (K.add_above_threshold, {"a_ptr": f, "b_ptr": f, "dst_ptr": f, "n": "i32", "thr_ptr": p, "out_ptr": p,
                                 "ctr_ptr": p, "cap": "i32"}, {}),
        (K.count_equal, {"bits_ptr": p, "n": "i32", **gated, "counts_ptr": p}, {}),
        (K.write_overflow, {"bits_ptr": p, "n": "i32", **gated, "starts_ptr": p, "out_ptr": p}, {}),
    ]
    for fn, sig, const in cases:
        const = {**const, "BLOCK": triton_select.BLOCK} if "BLOCK" in fn.arg_names else const
        src = triton.compiler.ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
