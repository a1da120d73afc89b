"""DAG performance model of one S-SGD iteration under a bucket plan (docs/dag-model.md#task-graph, docs/mgwfbp.md#timeline-model).

Conventions shared by every planner in :mod:`hvd_commopt.fusion`:

* Tensors are indexed by **backward position** ``i = 0..L-1``: position 0 is the first gradient
  to become ready (layer ``L`` in docs/mgwfbp.md#backward-positions), position ``L-1`` the last (layer 1). Layer ``l``
  (1-based, forward order) is position ``L - l``.
* ``backward_times[i]`` is ``tb`` of that tensor (docs/mgwfbp.md#inputs): the time between the previous
  gradient-ready event (or the start of backward, for position 0) and this tensor's
  gradient-ready event. So tensor ``i`` is ready at ``sum(backward_times[:i+1])`` after backward
  starts (docs/mgwfbp.md#greedy ``taub[l] + tb[l]``).
* A plan is a list of contiguous groups of positions in backward order
  (:func:`hvd_commopt.fusion.threshold.validate_plan`).

The task graph (docs/dag-model.md#task-graph)::

    F -> B_0 -> B_1 -> ... -> B_{L-1}                  (one compute stream)
    S_b after the last B of bucket b, before the next B  (optional compression, e.g. top-k, docs/lags-omgs.md#omgs)
    C_b <- (S_b or last B of b), C_{b-1}               (one network queue, buckets in plan order)
    U   <- every C_b and the end of the compute stream
    t_iter = finish(U) = longest path

With ``compress_time=None`` this is exactly the docs/mgwfbp.md#timeline-model that MG-WFBP's planner optimises:
bucket ready = ready time of its last tensor; comm start = max(previous comm end, ready);
duration = ``comm_time(Σ bytes)`` (wait-free backpropagation). With ``compress_time`` it is the
OMGS timeline of docs/lags-omgs.md#omgs (backward and top-k serial on the GPU, communication concurrent).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .threshold import validate_plan

__all__ = ["SimResult", "simulate", "ready_times", "check_profile"]


@dataclass(frozen=True)
class SimResult:
    """Predicted timings of one iteration (seconds, from the start of the forward pass).

    Attributes:
        iteration_time: finish time of the update, the DAG's longest path.
        compute_time: forward + backward + compression + update, i.e. the iteration time with
            free communication.
        non_overlapped_comm: ``iteration_time - compute_time`` (>= 0): communication the
            compute stream could not hide (docs/mgwfbp.md#greedy-algorithm).
        comm_total: sum of all bucket communication durations.
        compute_end: when the compute stream (backward + compression) finishes.
        comm_end: when the last bucket's communication finishes (``compute_end``'s counterpart).
        bucket_ready, bucket_start, bucket_end: per bucket, in plan order; "ready" is when the
            bucket may be sent (its last gradient, plus its compression if any).
    """

    iteration_time: float
    compute_time: float
    non_overlapped_comm: float
    comm_total: float
    compute_end: float
    comm_end: float
    bucket_ready: tuple[float, ...]
    bucket_start: tuple[float, ...]
    bucket_end: tuple[float, ...]


def check_profile(sizes_bytes: Sequence[int], backward_times: Sequence[float]) -> None:
    """Raise ValueError unless sizes and backward times are aligned, finite and non-negative."""
    if len(sizes_bytes) != len(backward_times):
        raise ValueError(f"need one backward time per tensor: got {len(sizes_bytes)} sizes and "
                         f"{len(backward_times)} backward times (both in backward order)")
    for i, s in enumerate(sizes_bytes):
        if not (s >= 0) or int(s) != s:
            raise ValueError(f"sizes_bytes[{i}] = {s!r}: sizes must be non-negative integers (bytes)")
    for i, t in enumerate(backward_times):
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"backward_times[{i}] = {t!r}: backward times must be finite seconds >= 0")


def ready_times(backward_times: Sequence[float], start: float = 0.0) -> list[float]:
    """Gradient-ready instants ``start + Σ_{q<=i} tb[q]``, accumulated left to right.

    Every planner uses this helper so that their predicted times and the simulator's agree to the
    last bit (the same additions in the same order).
    """
    out, t = [], start
    for tb in backward_times:
        t = t + tb
        out.append(t)
    return out


class _Dag:
    """Tasks added in topological order; finish = max(dependency finishes) + duration."""

    def __init__(self) -> None:
        self.start: list[float] = []
        self.finish: list[float] = []

    def add(self, duration: float, deps: Sequence[int]) -> int:
        if not (math.isfinite(duration) and duration >= 0):
            raise ValueError(f"task duration {duration!r} must be finite and >= 0; check the "
                             f"cost functions passed to simulate()")
        start = max((self.finish[d] for d in deps), default=0.0)
        self.start.append(start)
        self.finish.append(start + duration)
        return len(self.finish) - 1


def simulate(plan: Sequence[Sequence[int]], sizes_bytes: Sequence[int],
             backward_times: Sequence[float], comm_time: Callable[[int], float], *,
             forward_time: float = 0.0, update_time: float = 0.0,
             compress_time: Callable[[int], float] | None = None) -> SimResult:
    """Longest path of the iteration DAG for ``plan`` (see the module docstring).

    Args:
        plan: contiguous groups of backward positions.
        sizes_bytes: bytes of each tensor, backward order.
        backward_times: ``tb`` per tensor, backward order (module docstring).
        comm_time: bucket bytes -> seconds on the network, e.g. an :class:`AlphaBeta` or
            ``CostModel.comm_time_fn("topk", density=0.001)``. ``comm_time(0)`` should be 0.
        forward_time: everything before backward (read, H2D, forward), seconds.
        update_time: the optimizer step after all communication.
        compress_time: bucket bytes -> seconds of compression on the compute stream, run after
            the bucket's last gradient and before the next tensor's backward (docs/lags-omgs.md#omgs). ``None`` for
            dense communication.

    Returns:
        :class:`SimResult`.
    """
    check_profile(sizes_bytes, backward_times)
    n = len(sizes_bytes)
    validate_plan(plan, n)
    dag = _Dag()
    f = dag.add(float(forward_time), [])
    compute_dur = float(forward_time)
    prev_compute, prev_comm = f, None
    ready, start, end, comm_total = [], [], [], 0.0
    for group in plan:
        for i in group:
            prev_compute = dag.add(float(backward_times[i]), [prev_compute])
            compute_dur += float(backward_times[i])
        nbytes = sum(int(sizes_bytes[i]) for i in group)
        if compress_time is not None:
            s_dur = float(compress_time(nbytes))
            prev_compute = dag.add(s_dur, [prev_compute])
            compute_dur += s_dur
        c_dur = float(comm_time(nbytes))
        deps = [prev_compute] if prev_comm is None else [prev_comm, prev_compute]
        prev_comm = dag.add(c_dur, deps)
        ready.append(dag.finish[prev_compute])
        start.append(dag.start[prev_comm])
        end.append(dag.finish[prev_comm])
        comm_total += c_dur
    u_deps = [prev_compute] if prev_comm is None else [prev_comm, prev_compute]
    u = dag.add(float(update_time), u_deps)
    compute_dur += float(update_time)
    t_iter = dag.finish[u]
    return SimResult(
        iteration_time=t_iter,
        compute_time=compute_dur,
        non_overlapped_comm=max(0.0, t_iter - compute_dur),
        comm_total=comm_total,
        compute_end=dag.finish[prev_compute],
        comm_end=dag.finish[prev_comm] if prev_comm is not None else dag.finish[prev_compute],
        bucket_ready=tuple(ready),
        bucket_start=tuple(start),
        bucket_end=tuple(end),
    )
