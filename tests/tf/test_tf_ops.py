"""TFOps equals NumpyOps (the reference TensorOps) on the same data: ties, dtypes, host exchange."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvd_commopt import NumpyOps  # noqa: E402
from tf_plugin.ops import TF_DTYPES, TFOps  # noqa: E402

T, N = TFOps(), NumpyOps()


def np_of(x):
    return T.to_numpy(x)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 3, 7, 20, 64])
def test_topk_abs_matches_numpy_with_many_ties(seed, k):
    rng = np.random.default_rng(seed)
    # Few distinct magnitudes, both signs, zeros: ties at the boundary in most cases.
    x = (rng.integers(-3, 4, size=64)).astype(np.float32)
    tv, ti = T.topk_abs(tf.constant(x), k)
    nv, ni = N.topk_abs(x, k)
    assert ti.dtype == tf.int64
    np.testing.assert_array_equal(np_of(ti), ni)
    np.testing.assert_array_equal(np_of(tv), nv)
    assert np.all(np.diff(np_of(ti)) > 0), "indices must be ascending (canonical form)"


def test_topk_abs_k_at_least_n_and_all_zero():
    x = np.zeros(5, np.float32)
    v, i = T.topk_abs(tf.constant(x), 9)
    np.testing.assert_array_equal(np_of(i), np.arange(5))
    v, i = T.topk_abs(tf.constant(x), 2)
    np.testing.assert_array_equal(np_of(i), [0, 1])  # ties towards the lower index


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_elementwise_and_layout_match_numpy(dtype):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(17).astype(dtype)
    b = rng.standard_normal(17).astype(dtype)
    ta, tb = tf.constant(a), tf.constant(b)
    np.testing.assert_allclose(np_of(T.scale(ta, 0.25)), N.scale(a.copy(), 0.25), rtol=1e-3)
    np.testing.assert_array_equal(np_of(T.add(ta, tb)), N.add(a.copy(), b))
    np.testing.assert_array_equal(np_of(T.sub(ta, tb)), N.sub(a.copy(), b))
    np.testing.assert_array_equal(np_of(T.cat([ta, tb])), N.cat([a, b]))
    np.testing.assert_array_equal(np_of(T.slice(ta, 3, 9)), N.slice(a, 3, 9))
    assert T.numel(ta) == 17 and T.dtype_name(ta) == dtype and T.shape(ta) == (17,)
    assert T.device_name(ta) == "cpu"
    np.testing.assert_array_equal(np_of(T.reshape(T.cat([ta, ta[:1]]), (3, 6))), np.concatenate([a, a[:1]]).reshape(3, 6))


def test_copy_into_pack_buffer_variable_and_tensor():
    from tf_plugin.ops import PackBuffer
    buf = T.empty(10, "float32", like=tf.zeros(1))
    assert isinstance(buf, PackBuffer) and T.numel(buf) == 10 and T.dtype_name(buf) == "float32"
    buf = T.copy_into(buf, 2, tf.constant([[1.0, 2.0], [3.0, 4.0]]))
    ref = N.copy_into(np.zeros(10, np.float32), 2, np.array([[1, 2], [3, 4]], np.float32))
    np.testing.assert_array_equal(np_of(buf), ref)  # partial cover: zeros elsewhere
    full = T.empty(6, "float32")
    for off, part in ((3, [4.0, 5.0, 6.0]), (0, [1.0, 2.0, 3.0])):  # any packing order
        full = T.copy_into(full, off, tf.constant(part))
    snap = T.slice(full, 0, 6)
    np.testing.assert_array_equal(np_of(snap), [1, 2, 3, 4, 5, 6])
    again = T.copy_into(full, 0, tf.constant([9.0]))  # reuse of a used buffer (the engine's pool)
    np.testing.assert_array_equal(np_of(again), [9, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(np_of(snap), [1, 2, 3, 4, 5, 6])  # earlier results unchanged
    v = tf.Variable(tf.zeros(4))
    T.copy_into(v, 1, tf.constant([7.0, 8.0]))
    np.testing.assert_array_equal(v.numpy(), [0, 7, 8, 0])
    t = T.copy_into(tf.zeros(10), 7, tf.constant([5.0, 6.0, 7.0]))
    np.testing.assert_array_equal(np_of(t), N.copy_into(np.zeros(10, np.float32), 7, np.array([5, 6, 7], np.float32)))


def test_bfloat16_cast_matches_numpy_bit_patterns_and_round_trips():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(1000) * 10).astype(np.float32)
    x[:4] = [1.00390625, 1.01171875, -2.00781250, 0.0]  # exact halfway cases: round to even
    tb = T.cast(tf.constant(x), "bfloat16")
    host = T.to_numpy(tb)
    assert host.dtype == np.uint16
    np.testing.assert_array_equal(host, N.cast(x, "bfloat16"))
    back = T.from_numpy(host, like=tb)
    assert back.dtype == tf.bfloat16
    np.testing.assert_array_equal(np_of(T.cast(back, "float32")), N.cast(N.cast(x, "bfloat16"), "float32"))


def test_float16_cast_matches_numpy():
    x = np.linspace(-60000, 60000, 101).astype(np.float32)
    np.testing.assert_array_equal(np_of(T.cast(tf.constant(x), "float16")), N.cast(x, "float16"))


def test_sparse_ops_match_numpy():
    rng = np.random.default_rng(3)
    dst = rng.standard_normal(12).astype(np.float32)
    idx = np.array([3, 1, 3, 11, 0, 3], np.int64)
    vals = rng.standard_normal(6).astype(np.float32)
    np.testing.assert_allclose(np_of(T.scatter_add(tf.constant(dst), tf.constant(idx), tf.constant(vals))),
                               N.scatter_add(dst.copy(), idx, vals), rtol=1e-6)
    np.testing.assert_array_equal(np_of(T.gather(tf.constant(dst), tf.constant(idx))), N.gather(dst, idx))
    np.testing.assert_array_equal(np_of(T.index_fill(tf.constant(dst), tf.constant(idx), 0.5)),
                                  N.index_fill(dst.copy(), idx, 0.5))
    put = N.gather(dst, idx) * np.float32(0.5)  # repeated indices carry equal values
    np.testing.assert_array_equal(np_of(T.index_copy(tf.constant(dst), tf.constant(idx), tf.constant(put))),
                                  N.index_copy(dst.copy(), idx, put))
    np.testing.assert_array_equal(np_of(T.arange(5)), N.arange(5))
    assert T.arange(5).dtype == tf.int64


def test_merge_and_selection_ops_match_numpy():
    rng = np.random.default_rng(4)
    idx = rng.integers(0, 20, size=40).astype(np.int64)
    vals = rng.standard_normal(40).astype(np.float32)
    tu, ts = T.unique_sum(tf.constant(idx), tf.constant(vals))
    nu, ns = N.unique_sum(idx, vals)
    np.testing.assert_array_equal(np_of(tu), nu)
    np.testing.assert_allclose(np_of(ts), ns, rtol=1e-5, atol=1e-6)
    test = np.array([4, 7, 19, 100], np.int64)
    np.testing.assert_array_equal(np_of(T.isin(tf.constant(idx), tf.constant(test))), N.isin(idx, test))
    np.testing.assert_array_equal(np_of(T.isin(tf.constant(idx), tf.constant(test[:0]))), N.isin(idx, test[:0]))
    np.testing.assert_array_equal(np_of(T.isin(tf.constant(idx), tf.constant(test), invert=True)),
                                  N.isin(idx, test, invert=True))
    mask = vals > 0
    np.testing.assert_array_equal(np_of(T.nonzero(tf.constant(mask))), N.nonzero(mask))
    np.testing.assert_array_equal(np_of(T.abs_ge(tf.constant(vals), 0.7)), N.abs_ge(vals, 0.7))
    assert T.norm(tf.constant(vals)) == pytest.approx(N.norm(vals), rel=1e-6)


def test_host_exchange_is_a_writable_copy():
    t = tf.constant([1.0, 2.0])
    a = T.to_numpy(t)
    a[0] = 5.0  # an MPI backend reduces in place into the host buffer
    assert float(t[0]) == 1.0
    v = T.copy_into(T.empty(3, "float32"), 0, tf.constant([1.0, 2.0, 3.0]))
    assert T.to_numpy(v).flags.writeable
    np.testing.assert_array_equal(np_of(T.from_numpy(np.arange(3, dtype=np.int32), like=t)), [0, 1, 2])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"])
def test_byte_view_round_trips_bit_exactly_and_matches_numpy(dtype):
    """tf.bitcast changes the shape between widths; as_bytes/from_bytes stay 1-D (docs/topk.md#one-message)."""
    from tests.unit.test_packed_exchange import VALUE_DTYPES, special_values
    a = special_values(dtype) if dtype in VALUE_DTYPES else np.arange(-5, 32).astype(dtype)
    t = T.from_numpy(a.copy(), like=tf.zeros([0], dtype=TF_DTYPES[dtype]))
    assert t.dtype == TF_DTYPES[dtype]
    b = T.as_bytes(t)
    assert b.dtype == tf.uint8 and tuple(b.shape) == (a.nbytes,)
    assert b.numpy().tobytes() == N.as_bytes(a).tobytes()
    back = T.from_bytes(b, dtype)
    assert back.dtype == t.dtype and tuple(back.shape) == (a.size,)
    assert T.as_bytes(back).numpy().tobytes() == b.numpy().tobytes()
    assert int(tf.size(T.from_bytes(T.as_bytes(t[:0]), dtype))) == 0


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_packed_topk_with_tf_tensors_equals_the_oracle(dtype, index_dtype):
    """Top-k's one byte message with TF tensors on in-process ranks: bit for bit the scatter-add
    of every rank's top-k (docs/topk.md#one-message)."""
    from hvd_commopt import Compression, run_ranks
    from hvd_commopt.reduce import ReduceContext
    from tests.reducers import reduce_once
    n, k, P = 500, 7, 3
    rows = [tf.cast(np.random.default_rng(r).standard_normal(n).astype(np.float32), TF_DTYPES[dtype])
            for r in range(P)]
    leaves = [T.topk_abs(x, k) for x in rows]
    ref = T.scatter_add(T.zeros(n, dtype, like=rows[0]), T.cat([i for _, i in leaves]), T.cat([v for v, _ in leaves]))

    def body(comm):
        red = Compression.topk(k / n, index_dtype=index_dtype, min_k=1)
        return reduce_once(red, "b", rows[comm.rank], ReduceContext(comm, T, 1.0, 1.0))

    for out in run_ranks(P, body):
        assert out.dtype == ref.dtype and T.as_bytes(out).numpy().tobytes() == T.as_bytes(ref).numpy().tobytes()
