"""One compression object given to several engines: each engine keeps its own state
(docs/cross-rank-check.md#shared-compression)."""
import gc

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, build_engine, run_ranks
from hvd_commopt.engine import TensorSpec

SPECS = [TensorSpec("w", (8, 5), "float32"), TensorSpec("b", (2, 5), "float32")]  # 2-D: one sparse bucket


@pytest.mark.parametrize("make", [lambda: Compression.topk(0.1), lambda: Compression.gtopk(0.1),
                                  lambda: Compression.dgc(0.1, momentum=0.9), lambda: Compression.randomk(0.1, seed=3)])
def test_second_engine_gets_a_fresh_reducer_with_the_same_config_and_compressor(make):
    def body(comm):
        comp = make()
        engines = [build_engine(comm, NumpyOps(), compression=comp) for _ in range(2)]
        for e in engines:
            e.register(SPECS)
        rng = np.random.default_rng(comm.rank)
        for e, scale in zip(engines, (1.0, -100.0)):
            for s in SPECS:
                e.grad_ready(s.name, (scale * rng.standard_normal(s.shape)).astype(np.float32))
            e.reduce_step()
        first, second = (e.reducer for e in engines)
        assert first is comp and second is not comp
        assert second.config() == comp.config() and second.compressor is comp.compressor
        key = engines[0].buckets[0].name
        assert key == engines[1].buckets[0].name  # same bucket names: state would collide if shared
        r1 = first.residual(NumpyOps(), key, np.zeros(50, np.float32))
        r2 = second.residual(NumpyOps(), key, np.zeros(50, np.float32))
        assert r1 is not None and r2 is not None and r1 is not r2
        assert np.abs(r2).max() > 10 * np.abs(r1).max()  # each holds its own gradient's leftovers
        return True
    assert run_ranks(2, body, timeout_s=20) == [True, True]


def test_a_reducer_whose_engine_is_gone_is_taken_over_as_it_is():
    def body(comm):
        comp = Compression.topk(0.1)
        e = build_engine(comm, NumpyOps(), compression=comp)
        del e
        gc.collect()
        return build_engine(comm, NumpyOps(), compression=comp).reducer is comp
    assert run_ranks(1, body) == [True]


def test_stateless_dense_compression_values_are_shared_freely():
    def body(comm):
        engines = [build_engine(comm, NumpyOps(), compression=Compression.fp16) for _ in range(2)]
        return [e.reducer.compressor is Compression.fp16 for e in engines]
    assert run_ranks(1, body) == [[True, True]]
