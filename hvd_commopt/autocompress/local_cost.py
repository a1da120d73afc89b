"""The compute each method adds to a bucket on this machine and device, measured whole.

Each candidate's sub-reducer (built fresh, over a fresh memory with the same momentum, so the
training state is untouched) reduces a bucket of float32 noise on a **one-rank** communicator,
where no collective runs: what is timed is all the compute of the method on the bucket (the
memory's compensation, the selection or cast, the memory's update, the scatter or cast back and
the momentum of momentum correction), on the adapter's own tensor ops and device. The time of
dense fp32 at the same size is subtracted, and ``c0 + s·x`` (x elements) is fitted by least squares
over the sizes timed (docs/auto-compression.md#model). A first measurement on the deep MLP showed
why the whole round is timed: the selection alone, fitted as OMGS does, predicted 1 ms for a
bf16 cast of 2.8M elements that cost 14 ms once the cast back and the momentum were counted.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..buckets import Bucket, TensorSpec
from ..comm.communicator import Communicator
from ..comm.inproc import InProcBackend, InProcWorld
from ..errors import ConfigError
from ..reduce.base import ReduceContext, RoundInfo
from .choose import DENSE
from .dense import AutoMemory
from .options import Method
from .pricing import SelectFit

__all__ = ["measure_local_costs", "probe_sizes"]


def probe_sizes(max_numel: int) -> list[int]:
    """2^14, 2^17, 2^20 elements below the largest bucket, and the largest bucket itself."""
    top = max(int(max_numel), 1 << 10)
    return sorted({n for n in (1 << 14, 1 << 17, 1 << 20) if n < top} | {top})


def _fit(xs: Sequence[int], ts: Sequence[float]) -> SelectFit:
    """``(s, c0)`` of ``t ≈ c0 + s·x``, both at least 0."""
    x, t = np.asarray(xs, np.float64), np.asarray(ts, np.float64)
    if x.size >= 2:
        s, c0 = np.polyfit(x, t, 1)
        if s >= 0 and c0 >= 0:
            return float(s), float(c0)
    s = max(0.0, float(x @ t) / float(x @ x)) if float(x @ x) else 0.0
    return s, 0.0


def _kept(per_pass: Sequence[Sequence[float]], synced: bool) -> float:
    """The cost kept of one (method, size): alone, its fastest repeat of all passes; synced, the
    fastest pass's median, so that a first-time cost over a whole pass is dropped as it is alone
    (over both passes, its 5 of 10 repeats would put the median halfway to it)."""
    timed = [v for v in per_pass if v]
    if not synced:
        return min(min(v) for v in timed)
    return min(statistics.median(v) for v in timed)


def measure_local_costs(ops: Any, like: Any, methods: Sequence[Method], max_numel: int, momentum: float,
                        nesterov: bool, build: Callable[[Method, AutoMemory], Any],
                        clock: Callable[[], float] = time.perf_counter, repeats: int = 5,
                        passes: int = 2, sync: Callable[[], None] | None = None) -> dict[str, SelectFit]:
    """``{method.key: (s, c0)}``: the compute ``method`` adds to a bucket of x elements over dense
    fp32, ``c0 + s·x`` seconds (module docstring). A method that cannot run on one rank is left out.

    The candidates are timed interleaved: at each size, repeat r of dense fp32 and of every method,
    then repeat r + 1; the sizes are gone through ``passes`` times, and each (method, size) keeps
    its fastest repeat of all passes (a first-time cost at one size in the process, 37 ms for Top-k
    3 % once where a second pass gave 6 ms, does not survive the second pass). Timed one method after another, a burst of
    load on this shared 2-core machine landed on one method's whole measurement: on the deep MLP
    (2026-11-27 01:57 UTC, load 8) Top-k 1 % was fitted at 36 ms for 2.8M elements and DGC 1 % at
    6 ms, where each costs about 4 ms and 12 ms alone, and `auto` chose DGC, slower than dense
    there (docs/auto-compression.md#interleaved-costs).

    ``sync``: called before each row of repeats (one repeat of every method at one size); the
    policy passes a barrier of all ranks, which run this at once, so that each method is timed
    while every rank runs it, as the step runs every rank's compression of a bucket together. Then
    each (method, size) keeps the **median** of its repeats: the rows still drift apart by up to a
    method's time (4 ranks on 2 cores, 2026-11-27: int4 on 6.2M elements took 95-720 ms a repeat,
    the fastest where the other ranks happened to be waiting), so the fastest repeat is the cost
    without the contention, 95 ms against about 200 ms in the step; a burst of outside load on
    fewer than half of a pass's repeats still does not move the median, and of the passes the one
    with the lower median is kept, so a first-time cost over a whole pass is dropped as it is
    without ``sync`` (docs/auto-compression.md#costs-every-rank)."""
    comm = Communicator(InProcBackend(InProcWorld(1), 0), timeout_s=60.0)
    try:
        ctx = ReduceContext(comm, ops)
        sizes = probe_sizes(max_numel)
        rng = np.random.default_rng(0)
        data = {n: rng.standard_normal(n).astype(np.float32) for n in sizes}
        order = [DENSE] + [m for m in dict.fromkeys(methods) if m != DENSE]
        reducers: dict[Method, Any] = {}
        for m in order:
            mem = AutoMemory()
            mem.bind_momentum(momentum, nesterov)
            reducers[m] = build(m, mem)
        # times[m, n][p]: the timed repeats of (method, size) in pass p
        times: dict[tuple[Method, int], list[list[float]]] = {(m, n): [[] for _ in range(passes)]
                                                               for m in order for n in sizes}
        done = ops.from_numpy(np.zeros(1, np.int64), like)
        rnd = 0
        for p in range(passes):
            for n in sizes:
                b = Bucket.of(0, [TensorSpec(f"probe{n}", (n, 1), "float32")])
                for r in range(repeats + (0 if p else 1)):  # the first round allocates the memory's buffers
                    if sync is not None:
                        sync()
                    for m in list(reducers):
                        buf = ops.from_numpy(data[n], like)
                        t0 = clock()
                        try:
                            res = reducers[m].reduce(b, RoundInfo(rnd + r), buf, ctx)
                        except (ConfigError, ValueError, NotImplementedError):
                            del reducers[m]
                            continue
                        ops.to_numpy(ops.gather(res, done))  # to completion
                        if r or p:
                            times[m, n][p].append(clock() - t0)
            rnd += repeats + 1
        if DENSE not in reducers:
            return {}
        t = {k: _kept(v, sync is not None) for k, v in times.items() if k[0] in reducers}
        return {m.key: _fit(sizes, [max(0.0, t[m, n] - t[DENSE, n]) for n in sizes])
                for m in reducers if m != DENSE}
    finally:
        comm.shutdown()
