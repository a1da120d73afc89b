"""CommEngine on in-process ranks with NumPy tensors: fusion, averaging, accumulation, checks."""
import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, build_engine, run_ranks
from hvd_commopt.engine import TensorSpec
from hvd_commopt.errors import ConfigError, HvdCommoptError, RankMismatchError
from hvd_commopt.fusion import plan_bucket_cap, plan_threshold

SPECS = [TensorSpec("l1.w", (4, 3), "float32"), TensorSpec("l1.b", (4,), "float32"),
         TensorSpec("l2.w", (2, 4), "float32"), TensorSpec("l2.b", (2,), "float32")]


def grads_for(rank, scale=1.0):
    return {s.name: np.full(s.shape, (rank + 1) * scale, dtype=np.float32) + np.arange(s.numel, dtype=np.float32).reshape(s.shape)
            for s in SPECS}


def run_step(comm, engine, grads):
    for name in engine.backward_names:  # backward order
        engine.grad_ready(name, grads[name])
    return engine.reduce_step()


@pytest.mark.parametrize("threshold", [0, 16, 40, 1 << 20])
def test_average_equals_mean_of_ranks_for_any_fusion(threshold):
    def body(comm):
        eng = build_engine(comm, NumpyOps(), fusion_threshold=threshold)
        eng.register(SPECS)
        out = run_step(comm, eng, grads_for(comm.rank))
        return {k: v.copy() for k, v in out.items()}, [list(b.names) for b in eng.buckets]
    results = run_ranks(4, body)
    expect = {s.name: np.mean([grads_for(r)[s.name] for r in range(4)], axis=0) for s in SPECS}
    for out, buckets in results:
        for k in expect:
            np.testing.assert_allclose(out[k], expect[k], rtol=1e-6)
            assert out[k].shape == expect[k].shape
    assert results[0][1] == results[3][1]


def test_bucket_layout_follows_threshold_in_backward_order():
    sizes = [s.nbytes for s in reversed(SPECS)]  # 8, 32, 16, 48 bytes
    assert plan_threshold(sizes, 0) == [[0], [1], [2], [3]]
    assert plan_threshold(sizes, 40) == [[0, 1], [2], [3]]
    assert plan_threshold(sizes, 1 << 20) == [[0, 1, 2, 3]]
    assert plan_threshold([100, 1, 1], 10) == [[0], [1, 2]]  # a large tensor travels alone

    # a dense reducer's buckets follow DDP's rule: a bucket closes once it reaches the cap
    assert plan_bucket_cap(sizes, 40) == [[0, 1], [2, 3]]
    assert plan_bucket_cap(sizes, 0) == [[0], [1], [2], [3]]

    def body(comm):
        eng = build_engine(comm, NumpyOps(), fusion_threshold=40)
        eng.register(SPECS)
        return [list(b.names) for b in eng.buckets]
    assert run_ranks(1, body)[0] == [["l2.b", "l2.w"], ["l1.b", "l1.w"]]


def test_sum_op_and_predivide_factor():
    def body(comm, op, factor):
        eng = build_engine(comm, NumpyOps(), op=op, gradient_predivide_factor=factor)
        eng.register(SPECS)
        return run_step(comm, eng, grads_for(comm.rank))["l2.b"].copy()
    total = sum(grads_for(r)["l2.b"] for r in range(2))
    np.testing.assert_array_equal(run_ranks(2, body, "sum", 1.0)[0], total)
    np.testing.assert_allclose(run_ranks(2, body, "average", 2.0)[0], total / 2, rtol=1e-7)
    with pytest.raises(ConfigError, match="only applies to op=Average"):
        run_ranks(1, body, "sum", 2.0)
    with pytest.raises(ConfigError, match="hco.Average"):
        run_ranks(1, body, "max", 1.0)


def test_backward_passes_per_step_sums_passes_then_averages():
    # Closed form (Horovod): result = (1/P) * sum_r sum_n g[r, n]; integer-valued => exact.
    def body(comm):
        eng = build_engine(comm, NumpyOps(), backward_passes_per_step=3)
        eng.register(SPECS)
        acc = {s.name: np.zeros(s.shape, np.float32) for s in SPECS}
        for n in range(3):
            for name in eng.backward_names:
                acc[name] += float(comm.rank * 10 + n)  # the framework accumulates into .grad
                eng.grad_ready(name, acc[name])
            if n < 2:
                assert eng.in_flight is False  # nothing packed before the last pass
        return eng.reduce_step()["l1.w"].copy()
    out = run_ranks(2, body)
    expect = sum(r * 10 + n for r in range(2) for n in range(3)) / 2
    np.testing.assert_array_equal(out[0], np.full((4, 3), expect, np.float32))


def test_too_many_backward_passes_is_an_error():
    def body(comm):
        eng = build_engine(comm, NumpyOps(), fusion_threshold=0)
        eng.register(SPECS)
        g = grads_for(0)
        eng.grad_ready("l2.b", g["l2.b"])
        with pytest.raises(HvdCommoptError, match="raise backward_passes_per_step"):
            eng.grad_ready("l2.b", g["l2.b"])
    run_ranks(1, body)


def test_missing_gradients_take_part_as_zeros_or_fetched():
    def body(comm):
        eng = build_engine(comm, NumpyOps())
        eng.register(SPECS)
        g = grads_for(comm.rank)
        for name in eng.backward_names:
            if not (name == "l1.w" and comm.rank == 1) and name != "l2.b":
                eng.grad_ready(name, g[name])
        assert sorted(eng.missing()) == (["l1.w", "l2.b"] if comm.rank == 1 else ["l2.b"])
        out = eng.reduce_step({"l2.b": g["l2.b"]})  # the framework's gradient of a tensor whose hook did not fire
        return out["l1.w"].copy(), out["l2.b"].copy()
    (w0, b0), (w1, b1) = run_ranks(2, body)
    np.testing.assert_array_equal(w0, w1)
    np.testing.assert_allclose(w0, grads_for(0)["l1.w"] / 2, rtol=1e-7)
    np.testing.assert_allclose(b0, (grads_for(0)["l2.b"] + grads_for(1)["l2.b"]) / 2, rtol=1e-7)


def test_mixed_dtypes_split_buckets():
    specs = [TensorSpec("a", (3,), "float32"), TensorSpec("b", (2,), "float64"), TensorSpec("c", (2,), "float64")]

    def body(comm):
        eng = build_engine(comm, NumpyOps())
        eng.register(specs)
        grads = {"a": np.ones(3, np.float32) * (comm.rank + 1), "b": np.ones(2) * 4, "c": np.ones(2) * 6}
        out = run_step(comm, eng, grads)
        return [b.dtype for b in eng.buckets], out["a"].dtype, out["a"].tolist(), out["c"].tolist()
    dtypes, a_dtype, a, c = run_ranks(2, body)[0]
    assert dtypes == ["float64", "float32"] and a_dtype == np.float32
    assert a == [1.5, 1.5, 1.5] and c == [6.0, 6.0]


def test_model_that_differs_across_ranks_is_refused_naming_the_tensor():
    def body(comm):
        specs = list(SPECS)
        if comm.rank == 2:
            specs[2] = TensorSpec("l2.w", (2, 5), "float32")
        eng = build_engine(comm, NumpyOps())
        with pytest.raises(RankMismatchError) as e:
            eng.register(specs)
        return str(e.value)
    msgs = run_ranks(3, body)
    assert len(set(msgs)) == 1  # every rank raises the same error: nobody is left waiting
    assert "tensor #2 is 'l2.w' shape (2, 4) float32 on rank 0 but 'l2.w' shape (2, 5) float32 on rank 2" in msgs[0]


def test_duplicate_names_are_refused():
    def body(comm):
        with pytest.raises(ConfigError, match="duplicates"):
            build_engine(comm, NumpyOps()).register([SPECS[0], SPECS[0]])
    run_ranks(1, body)


def test_fp16_compression_predivides_and_restores_dtype():
    def body(comm):
        eng = build_engine(comm, NumpyOps(), compression=Compression.fp16)
        eng.register(SPECS)
        g = {s.name: np.full(s.shape, 60000.0, np.float32) for s in SPECS}  # sum of 2 would overflow fp16
        out = run_step(comm, eng, g)
        return out["l1.w"].dtype, float(out["l1.w"].reshape(-1)[0])
    dtype, v = run_ranks(2, body)[0]
    assert dtype == np.float32 and v == 60000.0


def test_step_stats_report_traffic_per_bucket():
    def body(comm):
        eng = build_engine(comm, NumpyOps(), fusion_threshold=0)
        eng.register(SPECS)
        run_step(comm, eng, grads_for(comm.rank))
        return eng.last_stats
    stats = run_ranks(2, body)[0]
    assert stats.bytes_sent == sum(s.nbytes for s in SPECS)  # ring: 2(P-1)/P = 1 at P=2
    assert len(stats.per_bucket) == 4 and stats.step == 0


def test_set_plan_and_state_dict_round_trip():
    def body(comm):
        eng = build_engine(comm, NumpyOps())
        eng.register(SPECS)
        eng.set_plan([[0, 1], [2, 3]])
        with pytest.raises(ValueError, match="invalid plan"):
            eng.set_plan([[0, 2], [1, 3]])
        run_step(comm, eng, grads_for(comm.rank))
        sd = eng.state_dict()
        eng2 = build_engine(comm, NumpyOps())
        eng2.register(SPECS)
        eng2.load_state_dict(sd)
        return eng2.step, len(eng.buckets)
    assert run_ranks(2, body)[0] == (1, 2)
