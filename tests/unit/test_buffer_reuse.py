"""The engine reuses a released fusion buffer only once nothing refers to it (docs/wrapper.md#grad-views).

``HeldOps`` is NumPy's ops with ``exclusive`` answered from a set the test controls: the set
stands for the views a host keeps (NumPy itself cannot tell, so NumpyOps never reuses).
"""
import numpy as np

from hvd_commopt import NumpyOps, Schedule, build_engine, run_ranks

from .schedule_helpers import SPECS, NumpyHost, batch, init_params, loss_grads, mean_in_rank_order


class HeldOps(NumpyOps):
    def __init__(self):
        self.held: set[int] = set()

    def exclusive(self, t):
        return id(t) not in self.held


def step(eng, host, rank, t):
    g = loss_grads(host.w, *batch(rank, t))
    host.g = g
    for name in eng.backward_names:
        eng.grad_ready(name, g[name])
    eng.run_step()
    return g


def test_buffer_reused_when_free_second_one_while_held_oldest_forgotten():
    def body(comm):
        ops = HeldOps()
        eng = build_engine(comm, ops, schedule=Schedule.sync(), fusion_threshold=1 << 20)
        eng.register(SPECS)
        host = NumpyHost(init_params())
        eng.attach_host(host)
        assert len(eng.buckets) == 1
        bufs, grads = [], []
        for t in range(9):
            g = step(eng, host, comm.rank, t)
            grads.append((g, host.calls[-1]["grads"]))  # copied when the optimizer ran
            bufs.append(id(eng.engine._pool.spares[0][-1]))  # the buffer this round used, just released
            if t == 2:
                ops.held.add(bufs[-1])       # the host keeps round 2's views
            if t == 4:
                ops.held.clear()              # ... and drops them
            if t >= 5:
                ops.held.add(bufs[-1])       # from round 5 on it keeps every round's views
        return bufs, [len(s) for s in eng.engine._pool.spares], grads
    out = run_ranks(2, body)
    for bufs, spares, _ in out:
        assert bufs[0] == bufs[1] == bufs[2]          # free: the same buffer every round
        assert bufs[3] != bufs[2] and bufs[4] == bufs[3]  # held: a second one, reused while free
        assert bufs[5] in (bufs[2], bufs[3])           # both free again: one of them
        assert len(set(bufs[5:])) == 4 and spares == [4]  # all held: new ones, at most 4 kept
    for t in range(9):  # the values are those of the in-process average, whatever the buffer
        want = mean_in_rank_order([out[r][2][t][0] for r in range(2)])
        for r in range(2):
            for n, v in want.items():
                np.testing.assert_array_equal(out[r][2][t][1][n], v)
