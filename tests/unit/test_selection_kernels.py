"""The selection's kernel seam (hvd_commopt/select/kernels.py): every implementation satisfies its
protocol, every adapter's ops satisfy TensorOps, and ``kernels_for`` picks the host kernels only
where every tensor has a host view."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt.numpy_ops import NumpyOps
from hvd_commopt.select import kernels as K
from hvd_commopt.select.host import HostKernels
from hvd_commopt.select.portable import PortableKernels
from hvd_commopt.tensor_ops import TensorOps


def _adapter_ops(name: str):
    if name == "numpy":
        return NumpyOps()
    if name == "torch":
        pytest.importorskip("torch")
        from torch_plugin.ops import TorchOps
        return TorchOps()
    pytest.importorskip("tensorflow")
    from tf_plugin.ops import TFOps
    return TFOps()


@pytest.mark.parametrize("adapter", ["numpy", "torch", "tensorflow"])
def test_every_adapter_satisfies_tensor_ops(adapter):
    assert isinstance(_adapter_ops(adapter), TensorOps)


@pytest.mark.parametrize("adapter", ["numpy", "torch", "tensorflow"])
def test_host_and_portable_kernels_satisfy_selection_kernels(adapter):
    ops = _adapter_ops(adapter)
    portable = PortableKernels(ops)
    for kern in (HostKernels(ops, portable), portable):
        assert isinstance(kern, K.SelectionKernels)
        assert kern.ops is ops


def test_kernels_for_picks_host_kernels_only_where_every_tensor_has_a_view(monkeypatch):
    ops = NumpyOps()
    x = np.zeros(10, np.float32)
    assert isinstance(K.kernels_for(ops, x, None), HostKernels)
    assert isinstance(K.kernels_for(ops, x, np.zeros((4, 4), np.float32)[:, 0]), PortableKernels)  # strided
    assert K.kernels_for(ops, x) is K.kernels_for(ops, x)  # one pair per ops object
    monkeypatch.setattr(K, "HOST_KERNELS", False)
    assert isinstance(K.kernels_for(ops, x), PortableKernels)


def test_portable_kernels_equal_host_kernels_on_numpy():
    """The portable kernels on NumpyOps' primitives give the host kernels' bits."""
    ops = NumpyOps()
    host, portable = HostKernels(ops, PortableKernels(ops)), PortableKernels(ops)
    rng = np.random.default_rng(3)
    for dtype in (np.float16, np.float32, np.float64):
        x = rng.standard_normal(5000).astype(dtype)
        x[::97], x[1::89], x[2::83] = np.nan, -np.inf, -0.0
        for op in ("ge", "gt", "le", "lt"):
            for thr in (0.0, -1.0, 0.5, float("nan"), float("inf")):
                hi, hv = host.abs_where(x, op, thr)
                pi, pv = portable.abs_where(x, op, thr)
                assert np.array_equal(hi, pi) and hv.tobytes() == pv.tobytes(), (dtype, op, thr)
        for k in (1, 40, 2500, 5000):
            a, b = host.kth_largest_abs(x, k), portable.kth_largest_abs(x, k)
            assert (a == b) or (a != a and b != b), (dtype, k)


@pytest.mark.parametrize("adapter", ["numpy", "torch", "tensorflow"])
def test_fixed_capacity_primitives_agree_with_numpy(adapter):
    """argsort (stable, both directions), searchsorted, where, equal: the device route's merge
    primitives (docs/gtopk.md#merge-fixed) give NumPy's answers on every adapter."""
    ops, ref = _adapter_ops(adapter), NumpyOps()
    keys = np.array([3, -1, 7, 3, 3, 0, 7, -1, 2], np.int64)
    t = ops.from_numpy(keys.copy(), like=ops.arange(1, like=None))
    for desc in (False, True):
        got = np.asarray(ops.to_numpy(ops.argsort(t, descending=desc)))
        assert got.tolist() == ref.argsort(keys, descending=desc).tolist()
        order = sorted(range(keys.size), key=lambda j: (-keys[j] if desc else keys[j], j))  # stable
        assert got.tolist() == order
    srt = np.array([0, 2, 2, 5, 9], np.int64)
    q = np.array([2, 10, -3, 5, 6], np.int64)
    s = ops.searchsorted(ops.from_numpy(srt, like=t), ops.from_numpy(q, like=t))
    assert np.asarray(ops.to_numpy(s)).tolist() == [1, 5, 0, 3, 4]
    m = ops.equal(ops.from_numpy(q, like=t), ops.from_numpy(np.array([2, 1, -3, 0, 6], np.int64), like=t))
    assert np.asarray(ops.to_numpy(m)).tolist() == [True, False, True, False, True]
    w = ops.where(m, ops.from_numpy(q, like=t), ops.from_numpy(srt, like=t))
    assert np.asarray(ops.to_numpy(w)).tolist() == [2, 2, -3, 5, 6]
    c = ops.cumsum(ops.from_numpy(np.array([3, 0, 2, 5], np.int64), like=t))
    assert np.asarray(ops.to_numpy(c)).tolist() == [3, 3, 5, 10]


@pytest.mark.parametrize("adapter", ["numpy", "torch", "tensorflow"])
def test_device_route_primitives_agree_with_the_host_selection(adapter):
    """The device route's primitives (docs/selection.md#device-route) in every adapter:
    topk_abs_index is ExactTopK's set (ties to the lower index, NaN above +Inf), the flags read
    back as the host checks say."""
    from hvd_commopt.select.device import DeviceKernels
    from hvd_commopt.select.exact_topk import ExactTopK
    ops = _adapter_ops(adapter)
    assert isinstance(DeviceKernels(ops), K.SelectionKernels) and DeviceKernels(ops).sync_free
    rng = np.random.default_rng(7)
    for dtype in (np.float16, np.float32, np.float64):
        a = (rng.integers(-5, 6, 3000) * 0.5).astype(dtype)
        a[::89], a[1::97], a[2::7] = np.nan, -np.inf, -0.0
        x = ops.from_numpy(a.copy(), like=None)
        for k in (1, 33, 1500, 2999, 3000):
            ref = ExactTopK().select(NumpyOps(), a.copy(), k).indices
            assert np.array_equal(np.asarray(ops.to_numpy(ops.topk_abs_index(x, k))), ref), (dtype, k)
        fin = ops.from_numpy(np.ones(4, dtype), like=None)
        got = ops.read_flags([ops.finite_flag(x), ops.finite_flag(x, "any"), ops.finite_flag(fin)])
        assert got == (False, True, True)
        picked = ops.to_numpy(ops.where(ops.finite_flag(x), fin, np.inf))
        assert np.all(np.isinf(np.asarray(picked)))


@pytest.mark.parametrize("adapter", ["numpy", "torch", "tensorflow"])
def test_clip_to_norm_equals_the_host_clipping(adapter):
    """DGC's clipping with the norm kept on the device (docs/dgc.md#clip-on-device) is, bit for bit,
    the host route's ``coef = max_norm / (norm(t) + 1e-6); scale(t, coef) if coef < 1`` in every
    adapter and dtype, clipped or not."""
    ops = _adapter_ops(adapter)
    rng = np.random.default_rng(5)
    for dtype in (np.float16, np.float32, np.float64):
        for spread in (1e-3, 0.3, 10.0):
            a = (rng.standard_normal(2000) * spread).astype(dtype)
            a[::37] = -0.0
            host = ops.from_numpy(a.copy(), like=None)
            coef = 2.5 / (ops.norm(host) + 1e-6)
            if coef < 1:
                host = ops.scale(host, coef)
            dev = ops.clip_to_norm_(ops.from_numpy(a.copy(), like=None), 2.5, 1e-6)
            h, d = np.asarray(ops.to_numpy(host)), np.asarray(ops.to_numpy(dev))
            assert h.tobytes() == d.tobytes(), (dtype, spread)
