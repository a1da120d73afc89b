"""The chooser: per bucket, the method whose predicted step is the shortest (a pure function).

Model (docs/auto-compression.md#model): the DAG of one synchronous step
(:func:`hvd_commopt.fusion.simulator.simulate`, docs/dag-model.md#task-graph) over the engine's
buckets in launch order. Each bucket ``b`` has

* ``gap_s``: the backward compute between the previous bucket's launch and its own (measured on
  rank 0: the fusion tuner's timeline, per bucket; the first bucket's gap includes the forward);
* per method ``m``: ``compress_s(m)`` on the compute stream (the selection or cast, fitted on this
  machine and device) and ``comm_s(m)`` on the network queue (the calibrated alpha-beta model).

The step is ``update_s`` after the later of the compute stream and the network queue. The
search, per family level (fp32 only; fp32 and bf16; and fp16; everything): the best uniform
assignment first, then coordinate descent, bucket by bucket, until no bucket changes (at most
``sweeps`` passes), each bucket taking its fastest method (equal steps: the least lossy). Then
the least lossy level whose step is within ``tie`` of the fastest level's wins, so a cast or a
sparse method is chosen only when, over the whole assignment, it pays; within a level the fastest
density wins (docs/auto-compression.md#ties): every sparse density on offer is one the convergence
tables show training. The tie used to be applied per bucket and per density: a 3 % density won
where 1 % was faster, and on ResNet-18 every bucket went back to dense although together they
saved more than the tie. Level 0 is dense fp32, so the result is never predicted slower than it.

``comm_cpu`` (docs/auto-compression.md#comm-cpu): the share of each bucket's sending that also
occupies the compute stream. On host memory the rank's own cores run the collective (the copies,
the TCP stack, an MPI library's progress), so a send "hidden behind backward" in the DAG was not
hidden in fact: the 1 MiB first bucket kept dense for that reason cost auto 9 % of the step on
the deep MLP at 1 Gbit/s. That share of the send runs on the compute stream, the rest on the
network queue (1: the step is serial, as measured on these CPU ranks). The policy passes 1 on
host memory and 0 on a device.

The simulator takes one cost function per plan; the buckets are handed to it as tensors of
``index + 1`` bytes, so that each cost function looks its bucket up by size
(:func:`predict`): the real DAG code, per-bucket costs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..fusion.simulator import SimResult, simulate
from .options import Method

__all__ = ["BucketCosts", "BucketChoice", "Choice", "predict", "choose", "TIE"]

#: A less lossy method within this fraction of the best predicted step wins (1 %).
TIE = 0.01


@dataclass(frozen=True)
class BucketCosts:
    """What one bucket costs, per candidate method (seconds).

    Attributes:
        name: the bucket's name; nbytes: its fp32 bytes.
        gap_s: backward compute before it becomes ready (module docstring).
        costs: method -> (compress_s, comm_s); the first key in least-lossy order is the
            fallback (dense fp32 must be present).
        note: why the candidates are restricted, if they are (a 1-D bucket, a dtype).
    """

    name: str
    nbytes: int
    gap_s: float
    costs: Mapping[Method, tuple[float, float]]
    note: str = ""


@dataclass(frozen=True)
class BucketChoice:
    """The decision for one bucket, with the numbers behind it and a sentence why."""

    name: str
    method: Method
    compress_s: float
    comm_s: float
    step_if_dense_s: float
    why: str


@dataclass(frozen=True)
class Choice:
    """The assignment, the predicted step with it and with dense fp32 everywhere."""

    buckets: tuple[BucketChoice, ...]
    predicted_s: float
    dense_s: float
    uniform: Method
    #: every method's uniform assignment (each bucket that cannot take it dense) and its predicted
    #: step, fastest first (equal steps: the least lossy first)
    uniforms: tuple[tuple[Method, float], ...] = ()

    @property
    def methods(self) -> list[Method]:
        return [b.method for b in self.buckets]


DENSE = Method("none")


def predict(buckets: Sequence[BucketCosts], methods: Sequence[Method], update_s: float = 0.0,
            comm_cpu: float = 0.0) -> SimResult:
    """The simulated step with ``methods[b]`` for bucket ``b`` (module docstring)."""
    send = [buckets[b].costs[m][1] for b, m in enumerate(methods)]
    # the share the rank's cores spend sending runs on the compute stream, the rest on the link
    sel = [buckets[b].costs[m][0] + comm_cpu * send[b] for b, m in enumerate(methods)]
    comm = [(1.0 - comm_cpu) * t for t in send]
    n = len(buckets)
    return simulate([[b] for b in range(n)], [b + 1 for b in range(n)], [bk.gap_s for bk in buckets],
                    lambda x: comm[int(x) - 1], update_time=update_s, compress_time=lambda x: sel[int(x) - 1])


def _best(options: Sequence[tuple[Method, float]], tie: float) -> tuple[Method, float]:
    """The fastest option of the least lossy family within ``tie`` of the fastest (module
    docstring); equal times go to the least lossy."""
    fastest = min(t for _, t in options)
    ok = [(m, t) for m, t in options if t <= fastest * (1 + tie)]
    family = min(m.family for m, _ in ok)
    return min(((m, t) for m, t in ok if m.family == family), key=lambda mt: (mt[1], mt[0].lossiness))


def _descend(buckets: Sequence[BucketCosts], step: Callable[[Sequence[Method]], float], level: int,
             sweeps: int) -> tuple[list[Method], list[tuple[Method, float]]]:
    """The fastest assignment from the methods of family <= ``level`` (equal steps: the least
    lossy): the best uniform one, then coordinate descent bucket by bucket; and the step of every
    uniform assignment it started from (each bucket that cannot use a method stays dense)."""
    cands = [sorted((m for m in b.costs if m.family <= level), key=lambda m: m.lossiness) for b in buckets]
    kinds = sorted({m for c in cands for m in c}, key=lambda m: m.lossiness)
    uniform = [(m, step([m if m in c else DENSE for c in cands])) for m in kinds]
    u, _ = _best(uniform, 0.0)
    cur = [u if u in c else DENSE for c in cands]
    for _ in range(sweeps):
        changed = False
        for i, c in enumerate(cands):
            opts = []
            for m in c:
                trial = list(cur)
                trial[i] = m
                opts.append((m, step(trial)))
            best = min(opts, key=lambda mt: (mt[1], mt[0].lossiness))[0]
            if best != cur[i]:
                cur[i], changed = best, True
        if not changed:
            break
    return cur, uniform


def choose(buckets: Sequence[BucketCosts], update_s: float = 0.0, tie: float = TIE, sweeps: int = 4,
           comm_cpu: float = 0.0) -> Choice:
    """The per-bucket methods of the shortest predicted step (module docstring)."""
    for b in buckets:
        if DENSE not in b.costs:
            raise ValueError(f"bucket {b.name!r} has no dense fp32 cost; dense is the fallback every bucket needs")
    n = len(buckets)

    def step(ms: Sequence[Method]) -> float:
        return predict(buckets, ms, update_s, comm_cpu).iteration_time

    dense_s = step([DENSE] * n)
    # per family level (fp32 only; up to bf16; ...; everything) the fastest assignment, then the
    # least lossy level within ``tie`` of the fastest one: the tie is taken once, over the whole
    # assignment (several buckets that each save less than the tie may save more together)
    levels = sorted({m.family for b in buckets for m in b.costs})
    found: list[tuple[list[Method], float]] = []
    for level in levels:
        ms, uniforms = _descend(buckets, step, level, sweeps)
        found.append((ms, step(ms)))
    uniform, _ = _best(uniforms, tie)  # for the report: the last level's, every method's uniform step
    fastest = min(t for _, t in found)
    cur = next(ms for ms, t in found if t <= fastest * (1 + tie))  # levels[0] is dense fp32: never slower
    final = step(cur)
    out = []
    for i, b in enumerate(buckets):
        m = cur[i]
        alt = list(cur)
        alt[i] = DENSE
        if_dense = step(alt)
        out.append(BucketChoice(b.name, m, b.costs[m][0], b.costs[m][1], if_dense,
                                _why(buckets, cur, i, final, update_s, comm_cpu)))
    ranked = tuple(sorted(uniforms, key=lambda mt: (mt[1], mt[0].lossiness)))
    return Choice(tuple(out), final, dense_s, uniform, ranked)


def _why(buckets: Sequence[BucketCosts], cur: Sequence[Method], i: int, final: float, update_s: float,
         comm_cpu: float) -> str:
    b, m = buckets[i], cur[i]
    ms = 1e3
    if b.note and len(b.costs) == 1:
        return f"dense only: {b.note}"
    if m != DENSE:
        alt = list(cur)
        alt[i] = DENSE
        saved = predict(buckets, alt, update_s, comm_cpu).iteration_time - final
        return (f"{m.key}: the step is {saved * ms:.3g} ms shorter than with this bucket dense "
                f"(select/cast {b.costs[m][0] * ms:.3g} ms, send {b.costs[m][1] * ms:.3g} ms instead of "
                f"{b.costs[DENSE][1] * ms:.3g} ms)")
    others = [k for k in b.costs if k != DENSE]
    if not others:
        return "dense: no other method allowed"
    steps = []
    for k in others:
        alt = list(cur)
        alt[i] = k
        steps.append((predict(buckets, alt, update_s, comm_cpu).iteration_time, k))
    t, k = min(steps, key=lambda tk: (tk[0], tk[1].lossiness))
    c_sel, c_comm = b.costs[k]
    saving = b.costs[DENSE][1] - c_comm
    if c_sel >= saving:
        return (f"dense: {k.key} would select/cast for {c_sel * ms:.3g} ms to save {saving * ms:.3g} ms of "
                f"sending (costs more than it saves)")
    if t >= final * (1 - TIE):
        why = "its sending is hidden behind backward" if not comm_cpu else f"it would save less than {TIE:.0%} of the step"
        return f"dense: {why} ({k.key} would change the step by {(t - final) * ms:+.3g} ms)"
    return f"dense: {k.key} predicts {t * ms:.4g} ms against {final * ms:.4g} ms"
