"""The runtime policy of ``compression="auto"``: profile, decide on rank 0, broadcast, watch.

Driven by the Trainer once per step (``step_end``, the same step on every rank), after the fusion
tuner (docs/auto-compression.md#policy):

0. before step 0 (:meth:`AutoPolicy.prepare`, when the wrapper attaches its optimizer, every
   rank): the link is calibrated and rank 0 times each candidate's compute, and the buckets start
   from the methods these predict with no backward to hide behind, so that neither the calibration
   nor dense warm-up steps are paid inside training (docs/auto-compression.md#before-step-0);
1. ``wait``: while a planned ``fusion=`` is still profiling or measuring, nothing is done (its
   plan decides the buckets; a re-plan restarts this policy, ``AutoReducer.relayout``);
2. ``warmup``: ``warmup_steps`` steps, with the methods of step 0 (dense fp32 where none were chosen);
3. ``profile``: ``profile_steps`` steps; per bucket, the compute between launches and the time
   its ``start`` took (this rank's clock);
4. decide (every rank enters, the same step): the link is calibrated once
   (:func:`hvd_commopt.calibrate.calibrate`; the fusion tuner's model or ``cost_model=`` when
   given; the one of step 0 when made), rank 0 measures the compute each candidate adds on its tensor ops (once per bucket layout)
   (:func:`~hvd_commopt.autocompress.local_cost.measure_local_costs`), chooses
   (:func:`~hvd_commopt.autocompress.decide.decide`) and broadcasts; every rank applies the same
   assignment (rounds of a delayed schedule in flight are drained first);
5. ``settle`` one step, ``measure`` ``measure_steps`` steps (the median period is the measured
   step; a decision measured slower than the step before it by more than ``margin`` is undone on
   rank 0's verdict, and its methods are not chosen for those buckets again; a decision kept is
   followed by the trial of the fastest predicted uniform assignments, :mod:`.trial`), then
   ``watch``: every ``period`` steps rank 0 compares the median of its last
   ``measure_steps`` periods with the prediction and broadcasts its verdict; a difference above
   ``margin`` re-profiles (with the current assignment) and decides again, with a fresh
   calibration of the link (a link that got slower) unless a cost model was given.

The prediction's constant part ``update_s`` (the optimizer step and what the model does not
see) is fitted on the profiled steps: the measured median period minus the simulated step of the
assignment in use (docs/auto-compression.md#model).
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections import deque
from typing import Any, Callable, Protocol, Sequence

from ..calibrate import calibrate
from ..errors import ConfigError
from ..fusion.cost_model import AlphaBeta, CostModel
from ..host import ScheduleHost
from ..reduce.base import Reducer
from .choose import DENSE
from .decide import Profile, candidates, decide, measured_methods
from .options import AutoOptions, Method
from .local_cost import measure_local_costs
from .methods import build_method
from .pricing import SelectFit
from .report import format_report
from .trial import TrialChecks

#: The message sizes auto's calibration times (16 KiB, 64 KiB, 1 MiB, 4 MiB): about 50 MB on the link.
#: Up to 2 MiB only, under a load average of 50 the fit at 10 Gbit/s came out as 6.8 ms + 0 s/B: the
#: scheduling noise swamped the bandwidth term, and every method looked free to send. From 64 KiB
#: only, the allgather's alpha came out as 20 ms at 1 Gbit/s (ResNet-18's job, load 8), where the
#: sparse methods send 10-250 KB: 16 KiB pins the intercept at their sizes.
CALIBRATION_SIZES = (1 << 14, 1 << 16, 1 << 20, 1 << 22)

__all__ = ["AutoPolicy", "PolicyPort", "Routing"]


class Routing(Protocol):
    """What the policy drives (implemented by :class:`~hvd_commopt.autocompress.reducer.AutoReducer`)."""

    options: AutoOptions
    timing: Any
    like: Any
    memory: Any  # the shared memory (its momentum, for timing each candidate alike)
    adaptive: bool  # an Adam-type optimizer is wrapped: no sparse candidates (casts and quantisers remain)

    @property
    def kinds_text(self) -> str: ...  # the kinds read and the candidates they give (docs/auto-compression.md#kinds)

    def sub(self, method: Method) -> Reducer: ...
    def method_of(self, bucket_name: str) -> Method: ...
    def assign(self, methods: dict[str, Method]) -> None: ...


class PolicyPort(Protocol):
    """What the policy reads of the engine (implemented by :class:`~hvd_commopt.engine.CommEngine`)."""

    comm: Any
    ops: Any
    tuner: Any
    scheduler: Any

    @property
    def buckets(self) -> list[Any]: ...


class AutoPolicy(TrialChecks):
    """The decisions of one :class:`~hvd_commopt.autocompress.reducer.AutoReducer` (module docstring)."""

    def __init__(self, reducer: Routing, clock: Callable[[], float] = time.perf_counter,
                 log: Callable[[str], None] | None = None):
        self.reducer = reducer
        self.options = reducer.options
        self.clock = clock
        self.log = log or (lambda msg: print(msg, file=sys.stdout, flush=True))
        self.cost_model: CostModel | None = None
        self.report: dict[str, Any] | None = None
        self.decisions = 0
        self._warned = False
        self._rank = 0
        self._previous: dict[str, Method] | None = None
        self._banned: set[tuple[str, str]] = set()  # (bucket, kind) measured slower than predicted
        # a revert awaiting its check: the undone methods, their measured step, the bans it added
        self._undone: tuple[dict[str, Method], float, set[tuple[str, str]]] | None = None
        self._prepared = False
        # the model's best uniform assignment, to be measured once after the decision, and the
        # decision it is measured against (docs/auto-compression.md#trial)
        self._alternatives: list[dict[str, Method]] = []
        self._trial: tuple[dict[str, Method], float] | None = None
        self._trial_decision: tuple[dict[str, Method], float] | None = None
        self._confirming = False
        self._fit_cache: dict[tuple[tuple[str, ...], int], dict[str, SelectFit]] = {}
        self.restart()

    def restart(self) -> None:
        """Start over from the warm-up (a new bucket layout)."""
        self.phase = "warmup"
        self._steps = 0
        self._t_prev: float | None = None
        self._names: list[str] = []
        self._samples: list[tuple[float, list[float], list[float]]] = []
        self._recent: deque[float] = deque(maxlen=self.options.measure_steps or 1)
        self._since = 0
        self._recalibrate = False

    def prepare(self, port: PolicyPort, host: ScheduleHost) -> None:
        """Before step 0 (module docstring, step 0): decide from the calibrated link and the
        measured compute alone, the backward taken as leaving nothing to hide behind. Once, where
        the host holds float32 weights (they say the device) and the layout is final (no planned
        ``fusion=`` still profiling); more than one rank only. Every rank calls it."""
        if self._prepared or port.comm.size == 1 or not host.holds_weights or port.tuner.phase not in ("static", "done"):
            return
        self._prepared = True
        ops = port.ops
        like = next((w for w in host.weights().values() if ops.dtype_name(w) == "float32"), None)
        if like is None or not port.buckets:
            return
        if self.reducer.like is None:
            self.reducer.like = ops.zeros(1, "float32", like=like)
        n = len(port.buckets)
        self._samples = [(0.0, [0.0] * n, [0.0] * n)]
        self._decide(port, before_step0=True)

    # -- per step ---------------------------------------------------------------------------
    def step_end(self, port: PolicyPort) -> None:
        """A step ended on every rank (same count); may decide, collectively."""
        now = self.clock()
        rows = self.reducer.timing.take()
        prev, self._t_prev = self._t_prev, now
        if port.tuner.phase not in ("static", "done"):
            self.phase, self._steps = "wait", 0
            return
        names = [b.name for b in port.buckets]
        if names != self._names:
            self.restart()
            self._t_prev, self._names = now, names
            return
        if prev is None:
            return
        period = now - prev
        opts = self.options
        if self.phase == "wait":
            self.phase, self._steps = "warmup", 0
        self._steps += 1
        if self.phase == "warmup":
            if self._steps >= opts.warmup_steps:
                self.phase, self._samples = "profile", []
            return
        if self.phase == "profile":
            if len(rows) == len(names):
                gaps, sel, last = [], [], prev
                for _, t0, t1 in rows:
                    gaps.append(max(0.0, t0 - last))
                    sel.append(t1 - t0)
                    last = t1
                self._samples.append((period, gaps, sel))
            if len(self._samples) >= opts.profile_steps:
                self._decide(port)
            return
        if self.phase == "settle":
            self.phase, self._recent = "measure", deque(maxlen=max(opts.measure_steps, 1))
            return
        self._recent.append(period)
        if self.phase == "measure":
            if len(self._recent) >= opts.measure_steps:
                self.phase, self._since = "watch", 0
                self._measured(port)
            return
        self._since += 1
        if self._since >= opts.period:
            self._since = 0
            self._watch(port)

    # -- decisions ----------------------------------------------------------------------------
    def _cost_model(self, port: PolicyPort) -> CostModel:
        comm = port.comm
        if self.options.cost_model is not None:
            return CostModel.load(self.options.cost_model)
        if comm.size == 1:
            return CostModel(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0), None, ranks=1)
        tuned = port.tuner.cost_model
        if self.cost_model is None and tuned is not None:
            return tuned
        if self.cost_model is not None and not self._recalibrate:
            return self.cost_model
        kw: dict[str, Any] = {}
        if comm.buffer_kind != "numpy":
            like, ops = self.reducer.like, port.ops
            if like is None:
                raise ConfigError("compression='auto' calibrates the link with the engine's tensors, and no "
                                  "float32 bucket was seen; pass Compression.auto(cost_model=...)")
            kw["make_buffer"] = lambda nbytes: ops.zeros(nbytes // 4, "float32", like=like)
        # a light calibration (docs/auto-compression.md#limits): four sizes, four timed runs each,
        # point-to-point only for the methods priced by it; the fusion tuner's default moves about
        # 0.35 GB, half a minute of a 100 Mbit/s link at every decision
        p2p = ("p2p",) if {"gtopk", "oktopk"} & set(self.options.allow) else ()
        return calibrate(comm, sizes=CALIBRATION_SIZES, repeats=4, warmup=1,
                         collectives=("allreduce", "allgather") + p2p, **kw)

    def _decide(self, port: PolicyPort, before_step0: bool = False) -> None:
        comm = port.comm
        self._rank = comm.rank
        self.cost_model = self._cost_model(port)
        self._recalibrate = False
        payload: Any = None
        try:
            self._measure_compute(port)  # on every rank at once, as the step runs it
            if comm.rank == 0:
                payload = self._choose_on_rank0(port)
        except (ConfigError, ValueError, OSError, KeyError) as e:
            payload = {"error": f"{type(e).__name__}: {e}"} if comm.rank == 0 else None
        payload = comm.broadcast_object(payload, root=0, name="autocompress.choice") if comm.size > 1 else payload
        if "error" in payload:
            self.phase = "failed"
            raise ConfigError(f"compression='auto': choosing failed on rank 0 ({payload['error']}); "
                              f"pass a fixed Compression.* instead")
        self._previous = None if before_step0 else {b.name: self.reducer.method_of(b.name) for b in port.buckets}
        tries = not before_step0 and self.options.cost_model is None  # a given model: the user's link, not this one
        self._alternatives = [{k: Method.parse(v) for k, v in a.items()} for a in payload.get("alternatives", ())] if tries else []
        self._trial = self._trial_decision = None
        self._confirming = False
        self._assign(port, {k: Method.parse(v) for k, v in payload["assignment"].items()})
        self.report = dict(payload["report"])
        if not before_step0:  # the step-0 decision is not a re-decision the report counts
            self.decisions += 1
        self.report["decisions"] = self.decisions
        if payload.get("warning") and not self._warned:
            self._warned = True
            warnings.warn(payload["warning"], stacklevel=2)
        if before_step0:  # the profile of the steps to come decides next (module docstring)
            self.report["phase"] = "before step 0"
            self.restart()
        else:
            self.phase = "settle" if self.options.measure_steps else "watch"
        self._since = 0
        if self.options.verbose and comm.rank == 0:
            self.log(format_report(self.report))

    def _assign(self, port: PolicyPort, methods: dict[str, Method]) -> None:
        sched = port.scheduler
        if sched is not None and sched.outstanding:
            sched.drain()  # rounds in flight use the old methods; draining is value-neutral
        self.reducer.assign(methods)

    def _fits(self, port: PolicyPort, methods: Sequence[Method], max_numel: int) -> dict[str, SelectFit]:
        """Each candidate's compute on this machine, measured whole (:mod:`.local_cost`)."""
        like = self.reducer.like
        if like is None or not methods:
            return {}
        key = (tuple(m.key for m in methods), int(max_numel))  # measured once per layout (module docstring)
        if key not in self._fit_cache:
            mem = self.reducer.memory
            comm = port.comm
            sync = (lambda: comm.barrier(name="autocompress.costs")) if comm.size > 1 else None
            self._fit_cache[key] = measure_local_costs(port.ops, like, methods, max_numel, float(mem.momentum or 0.0),
                                                       bool(mem.nesterov), build_method, sync=sync)
        return self._fit_cache[key]

    def _measure_compute(self, port: PolicyPort) -> None:
        """Every rank measures the candidates' compute at the same time, though only rank 0's
        figures are used: the step runs every rank's compression at once, and where ranks share
        cores (more ranks than cores, or emulated hosts on one machine) or memory bandwidth, a
        method timed on rank 0 alone, the others waiting, costs less than in the step. On 4 ranks
        sharing 2 cores the transformer's int4 was priced at half its cost and chosen over bf16,
        then ran 0.87x its speed (docs/auto-compression.md#costs-every-rank)."""
        cands, _ = candidates(port.buckets, self.options, ranks=port.comm.size, adaptive=self.reducer.adaptive,
                              banned=self._banned)
        self._fits(port, *measured_methods(port.buckets, cands))

    def _choose_on_rank0(self, port: PolicyPort) -> dict[str, Any]:
        buckets = port.buckets
        like = self.reducer.like  # host memory: the rank's cores run its collectives (docs/auto-compression.md#comm-cpu)
        comm_cpu = 0.0 if like is not None and port.ops.on_device(like) else 1.0
        return decide(buckets, Profile.of(self._samples, len(buckets)), [self.reducer.method_of(b.name) for b in buckets],
                      self.cost_model, self.options, lambda ms, top: self._fits(port, ms, top), ranks=port.comm.size,
                      adaptive=self.reducer.adaptive, banned=self._banned, comm_cpu=comm_cpu,
                      kinds=self.reducer.kinds_text)

    def _measured(self, port: PolicyPort) -> None:
        """The decision's steps are measured. Rank 0 checks it against the step it replaced and
        broadcasts the verdict: a decision measured slower than the profiled step before it by more
        than ``margin`` is undone, and the methods it brought to a bucket are not chosen for that
        bucket again (docs/auto-compression.md#revert)."""
        rep = self.report
        if rep is None or not self._recent:
            return
        m = statistics.median(self._recent)
        rep["measured_s"], rep["measured_steps"] = m, len(self._recent)
        rep["prediction_error"] = rep["predicted_s"] / m - 1 if m > 0 else None
        rep["phase"] = "measured"
        if self._undone is not None:
            self._check_revert(port, m)
            return
        if self._trial is not None:
            if not self._trial_step(port, m) and self.options.verbose and self._rank == 0:
                self.log(format_report(rep))
            return
        prev, self._previous = self._previous, None
        changed = {k: v for k, v in (prev or {}).items() if self.reducer.method_of(k) != v}
        revert = bool(changed) and m > rep["profiled_period_s"] * (1 + self.options.margin)
        comm = port.comm
        if comm.size > 1 and prev is not None:
            revert = bool(comm.broadcast_object(revert, root=0, name="autocompress.revert"))
        if revert:
            bans = {(k, self.reducer.method_of(k).kind) for k in changed if self.reducer.method_of(k) != DENSE}
            self._undone = ({b.name: self.reducer.method_of(b.name) for b in port.buckets}, m, bans)
            self._banned |= bans
            rep["reverted"] = (f"measured {m * 1e3:.4g} ms against {rep['profiled_period_s'] * 1e3:.4g} ms before: "
                               f"back to the previous methods; not chosen again for these buckets: "
                               + ", ".join(f"{k} {self.reducer.method_of(k).key}" for k in sorted(changed)))
            self._assign(port, prev)
            for b in rep["buckets"]:
                b["method"] = prev[b["bucket"]].key if b["bucket"] in prev else b["method"]
            rep["undone_predicted_s"], rep["predicted_s"] = rep["predicted_s"], rep["profiled_period_s"]
            rep["phase"] = "reverted"
            self.phase, self._recent = "settle", deque(maxlen=max(self.options.measure_steps, 1))
        elif self._alternatives:
            self._trial_step(port, m)
        if self.options.verbose and self._rank == 0:
            self.log(format_report(rep))

    def _check_revert(self, port: PolicyPort, m: float) -> None:
        """The methods a revert brought back are measured (``m``): if they are not faster than the
        undone decision was, the machine slowed down, not the choice (a load swing between the
        profile and the measurement), so the decision comes back and its bans are lifted. Rank 0's
        verdict, broadcast (docs/auto-compression.md#revert)."""
        undone, m_decision, bans = self._undone
        self._undone = None
        rep = self.report
        restore = m >= m_decision
        comm = port.comm
        if comm.size > 1:
            restore = bool(comm.broadcast_object(restore, root=0, name="autocompress.recheck"))
        if rep is not None:
            rep["revert_check"] = (f"the previous methods measured {m * 1e3:.4g} ms against the undone decision's "
                                   f"{m_decision * 1e3:.4g} ms: " + ("the decision is restored" if restore
                                                                     else "the revert stands"))
        if restore:
            self._banned -= bans
            self._assign(port, undone)
            if rep is not None:
                rep.pop("reverted", None)
                rep["predicted_s"] = rep.pop("undone_predicted_s", rep["predicted_s"])
                for b in rep["buckets"]:
                    b["method"] = undone.get(b["bucket"], Method.parse(b["method"])).key
                rep["phase"] = "restored"
            self.phase, self._recent = "settle", deque(maxlen=max(self.options.measure_steps, 1))
        if self.options.verbose and self._rank == 0 and rep is not None:
            self.log(format_report(rep))

    def _watch(self, port: PolicyPort) -> None:
        """Every ``period`` steps: rank 0's verdict on re-deciding, broadcast (module docstring)."""
        comm = port.comm
        verdict = False
        rep = self.report
        if comm.rank == 0 and rep is not None and self._recent:
            m = statistics.median(self._recent)
            rep["measured_s"] = m
            pred = rep["predicted_s"]
            verdict = bool(pred > 0 and abs(m / pred - 1) > self.options.margin)
        if comm.size > 1:
            verdict = bool(comm.broadcast_object(verdict, root=0, name="autocompress.watch"))
        if verdict:
            self.phase, self._samples, self._steps = "profile", [], 0
            self._recalibrate = True
            if rep is not None:
                rep["phase"] = "re-deciding"
