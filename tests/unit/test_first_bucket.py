"""DDP's small first bucket under "threshold" fusion (docs/wrapper.md#first-bucket)."""
from hvd_commopt.engine.tuner import FIRST_BUCKET_BYTES, FusionTuner
from hvd_commopt.fusion.threshold import plan_bucket_cap, plan_threshold
from hvd_commopt.reduce import DenseAllreduce


class OneRank:
    rank, size = 0, 1


MB = 1024 * 1024


def test_first_group_is_capped_then_the_threshold_applies():
    sizes = [MB // 2, MB // 2, MB // 2, 10 * MB, 10 * MB, 10 * MB]
    assert plan_threshold(sizes, 25 * MB) == [[0, 1, 2, 3, 4], [5]]
    assert plan_threshold(sizes, 25 * MB, first_bytes=MB) == [[0, 1], [2, 3, 4], [5]]
    # a first tensor larger than the cap travels alone, as any tensor larger than the threshold
    assert plan_threshold([2 * MB, MB], 25 * MB, first_bytes=MB) == [[0], [1]]
    # the cap never exceeds the threshold itself; 0 disables fusion as before
    assert plan_threshold(sizes, MB // 2, first_bytes=MB) == [[i] for i in range(6)]
    assert plan_threshold(sizes, 0, first_bytes=MB) == [[i] for i in range(6)]


def test_dense_threshold_fusion_gets_ddps_first_bucket_sparse_does_not():
    sizes = [MB // 2] * 8  # 4 MiB in all, under the 25 MiB threshold
    names = [f"t{i}" for i in range(8)]
    dense = FusionTuner("threshold", OneRank(), threshold_bytes=25 * MB, reducer=DenseAllreduce())
    assert FIRST_BUCKET_BYTES == MB and dense.initial_plan(names, sizes) == [[0, 1], list(range(2, 8))]
    off = FusionTuner("threshold", OneRank(), threshold_bytes=25 * MB, reducer=DenseAllreduce(),
                      options={"first_bucket_bytes": 0})
    assert off.initial_plan(names, sizes) == [list(range(8))]

    class Sparse(DenseAllreduce):
        sparse, density = True, 0.01
    sparse = FusionTuner("threshold", OneRank(), threshold_bytes=25 * MB, reducer=Sparse())
    assert sparse.initial_plan(names, sizes) == [list(range(8))]


def test_dense_buckets_close_once_they_reach_the_cap_as_ddp_does():
    # ResNet-18's backward order (MiB): DDP's rule puts the 9 MiB conv into the first bucket and
    # leaves the last bucket small; the hard cap leaves 25 MiB for after backward
    sizes = [MB // 64, 9 * MB, 9 * MB, 9 * MB, 9 * MB, 2 * MB, 2 * MB]
    assert plan_bucket_cap(sizes, 25 * MB, first_bytes=MB) == [[0, 1], [2, 3, 4], [5, 6]]
    assert plan_threshold(sizes, 25 * MB, first_bytes=MB) == [[0], [1, 2], [3, 4, 5, 6]]
    assert plan_bucket_cap(sizes, 25 * MB) == [[0, 1, 2, 3], [4, 5, 6]]
    names = [f"t{i}" for i in range(len(sizes))]
    dense = FusionTuner("threshold", OneRank(), threshold_bytes=25 * MB, reducer=DenseAllreduce())
    assert dense.initial_plan(names, sizes) == [[0, 1], [2, 3, 4], [5, 6]]
