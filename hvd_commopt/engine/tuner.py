"""``fusion=``: the engine's bucketing strategy, planned at run time from a profile.

Papers: MG-WFBP (Shi, Chu, Li, INFOCOM 2019 / TPDS 2021; docs/mgwfbp.md#mgwfbp), OMGS-SGD for sparse buckets
(Shi et al., INFOCOM 2020; docs/lags-omgs.md#omgs), the DAG model of S-SGD (docs/dag-model.md#task-graph). Strategies:

* ``"threshold"``: Horovod's fusion threshold (``fusion_threshold`` bytes); ``"none"``: one
  tensor per bucket (WFBP). Static, nothing is measured.
* ``"mgwfbp"``: the reference greedy (docs/mgwfbp.md#greedy); OMGS (docs/lags-omgs.md#omgs) when the reducer sparsifies.
* ``"optimal"``: the exact DP of the same model (docs/mgwfbp.md#exact-dp; the Pareto DP of
  docs/lags-omgs.md#omgs-exact-dp when sparse).
* ``"auto"``: every candidate of :func:`~hvd_commopt.fusion.auto.candidate_plans`, keeping the
  one the simulator predicts fastest.

The knobs are :class:`~hvd_commopt.engine.fusion_options.FusionOptions`; verbose mode prints the
report with :func:`~hvd_commopt.engine.fusion_report.format_report` (both importable from here too).

How the engine drives a :class:`FusionTuner` (a state machine; no thread of its own):
``register()`` calls :meth:`~FusionTuner.initial_plan`, every ``grad_ready`` calls
:meth:`~FusionTuner.grad_ready`, and the end of every ``synchronize()`` calls
:meth:`~FusionTuner.step_end`, which returns a new plan for ``engine.set_plan`` or None. The
planned strategies go through these phases:

1. ``warmup``: ``warmup_steps`` steps with the threshold plan, nothing recorded;
2. ``profile``: ``profile_steps`` steps with the threshold plan, gradient-ready times recorded
   (:mod:`.profiler` defines ``tb``, ``forward_s`` and the period);
3. at the end of the last profiled step, on every rank: :func:`hvd_commopt.calibrate.calibrate`
   once (skipped if a cost model was given), then rank 0 plans from *its* profile and broadcasts
   the plan (``comm.broadcast_object``), and every rank returns the same plan;
4. ``settle``: one step to allocate the new fusion buffers; ``measure``: ``measure_steps``
   steps timed end to end; then the report is complete, printed once on rank 0 when verbose.

Choices:

* **Rank 0 plans, everyone follows** (B-Caffe's ``MPI_Bcast`` of the merge set; docs/mgwfbp.md#t-mg-6).
  Profiles differ between ranks (noise, stragglers); planning on each rank from its own would
  give different buckets, different collectives, and a hang.
* **Never on one rank only**: every transition happens at a step count (``synchronize`` is
  collective, so counts agree) or in ``register()`` (collective); the only rank-local input is
  rank 0's profile, and its outcome is broadcast. A planning error on rank 0 (an unreadable
  cost-model file) is broadcast too and raised on every rank.
* **Re-plan when the tensor set changes**: ``register()`` with other names or sizes restarts at
  the warm-up with the threshold plan; the same set keeps the current plan.
* The cost per bucket follows the reducer (:mod:`.pricing`); for sparse reducers the top-k
  selection cost ``s`` is fitted on rank 0 with the engine's tensor ops unless given.
* Predicted vs measured: the prediction is the simulator's period for rank 0's profile; the
  measurement is the median period on this rank with the new plan (each rank's report carries
  its own measurement; rank 0 prints its own). The threshold plan gets the same pair from the
  profiled steps, which checks the model on the plan that was actually run.
* Sparse reducers keep error-feedback residuals per bucket name; a plan change moves them onto
  the new buckets, element by element, so no residual mass is lost at the switch
  (docs/lags-omgs.md#replan-residuals).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from .. import env
from ..calibrate import calibrate
from ..errors import ConfigError
from ..fusion.auto import candidate_plans, choose_plan
from ..fusion.cost_model import AlphaBeta, CostModel
from ..fusion.exact import plan_optimal
from ..fusion.mgwfbp import plan_mgwfbp
from ..fusion.omgs import plan_omgs
from ..select.exact_topk import ExactTopK
from ..fusion.pricing import PER_LAYER_DENSITY, fit_select_cost
from ..fusion.threshold import plan_bucket_cap, plan_per_tensor, plan_single, plan_threshold, validate_plan
from ..reduce.base import Reducer
from ..reduce.dense import DenseAllreduce
from .fusion_options import FIRST_BUCKET_BYTES, FusionOptions
from .fusion_report import format_report
from .profiler import Profile, StepProfiler

__all__ = ["FusionTuner", "FusionOptions", "STRATEGIES", "PLANNED", "format_report"]

STRATEGIES = ("threshold", "none", "mgwfbp", "optimal", "auto")
PLANNED = ("mgwfbp", "optimal", "auto")


def _print(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)


class FusionTuner:
    """The fusion strategy of one engine (module docstring).

    Args:
        strategy: one of :data:`STRATEGIES`.
        comm: the engine's communicator (calibration and the plan broadcast).
        threshold_bytes: the threshold plan's cap (the engine's ``fusion_threshold``).
        reducer: the engine's reducer (prices its buckets itself, ``Reducer.price``); None = dense.
        ops: the engine's tensor ops (native-buffer calibration, top-k timing).
        options: :class:`FusionOptions` or a dict of its fields.
        clock: seconds, monotonic; injectable for tests.
        log: where the report line goes (default: stdout).
    """

    def __init__(self, strategy: str, comm: Any, *, threshold_bytes: int, reducer: Reducer | None = None,
                 ops: Any = None, options: Any = None, clock: Callable[[], float] = time.perf_counter,
                 log: Callable[[str], None] | None = None):
        if strategy not in STRATEGIES:
            raise ConfigError(f"fusion must be one of {STRATEGIES}, got {strategy!r}")
        self.strategy = strategy
        self.comm, self.threshold_bytes, self.ops = comm, int(threshold_bytes), ops
        self.reducer = reducer if reducer is not None else DenseAllreduce()
        self.options = FusionOptions.coerce(options)
        self.clock = clock
        self.log = log or _print
        self.verbose = env.verbose() if self.options.verbose is None else bool(self.options.verbose)
        if self.planned and self.reducer.sparse and self.reducer.density is None:
            raise ConfigError(PER_LAYER_DENSITY)  # refused now, not after profiling
        self.phase = "static"
        self.plan: list[list[int]] = []
        self.plans_made = 0
        self.cost_model: CostModel | None = None
        self._key: tuple | None = None
        self._profiler: StepProfiler | None = None
        self._profile: Profile | None = None
        self._report: dict[str, Any] | None = None
        self._measured: list[float] = []
        self._steps = 0
        self._like: Any = None
        self.recording = False

    @property
    def planned(self) -> bool:
        return self.strategy in PLANNED

    # -- engine hooks -----------------------------------------------------------------------
    def _threshold_plan(self, sizes: Sequence[int]) -> list[list[int]]:
        """The "threshold" plan: a dense reducer gets DDP's buckets (a 1 MiB first bucket, then
        buckets that close once they reach the threshold, docs/wrapper.md#first-bucket); a sparse
        reducer Horovod's hard cap, one selection per bucket spanning it."""
        if self.reducer.sparse:
            return plan_threshold(sizes, self.threshold_bytes)
        first = FIRST_BUCKET_BYTES if self.options.first_bucket_bytes is None else self.options.first_bucket_bytes
        return plan_bucket_cap(sizes, self.threshold_bytes, first_bytes=first or None)

    def initial_plan(self, names: Sequence[str], sizes_bytes: Sequence[int],
                     explicit: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
        """The plan to register now (names and sizes in backward order). Restarts profiling when
        the tensor set differs from the last one; an ``explicit`` plan is used as is (static)."""
        key = (tuple(names), tuple(int(s) for s in sizes_bytes))
        if explicit is None and self.planned and self.options.plan_file:
            explicit = self._pinned_plan(list(names))
            if explicit is not None:
                self._key, self.phase, self.recording = key, "static", False
                self.plan = explicit
                self._report = self._static_report(key[1], "pinned")
                return self.plan
        if explicit is not None:
            self._key, self.phase, self.recording = key, "static", False
            self.plan = [list(g) for g in explicit]
            self._report = self._static_report(key[1], "explicit")
            return self.plan
        if key == self._key and self.plan:
            return self.plan
        self._key = key
        sizes = list(key[1])
        if self.strategy == "none":
            self.plan = plan_per_tensor(len(sizes))
        else:
            self.plan = self._threshold_plan(sizes)
        self._report = self._static_report(sizes, self.strategy)
        if self.planned and sizes:
            self.phase, self._steps, self._measured = "warmup", 0, []
            self._profiler = StepProfiler(key[0], sizes, self.clock)
            self._report["chosen"] = "threshold"  # until rank 0's plan arrives
            self.recording = self.options.warmup_steps == 0
            if self.recording:
                self.phase = "profile"
        return self.plan

    def grad_ready(self, name: str, tensor: Any = None) -> None:
        """A gradient was handed to the engine (recorded while profiling)."""
        if self.recording:
            self._profiler.arrived(name)
            if self._like is None and tensor is not None:
                self._like = tensor

    def step_end(self) -> list[list[int]] | None:
        """A step ended (every rank, same count). Returns the new plan to set, or None."""
        ph = self.phase
        if ph in ("static", "done"):
            return None
        prof = self._profiler
        opts = self.options
        self._steps += 1
        if ph == "warmup":
            prof.boundary(record=False)
            if self._steps >= opts.warmup_steps:
                self.phase, self.recording = "profile", True
            return None
        if ph == "profile":
            prof.boundary(record=True)
            if prof.recorded < opts.profile_steps:
                return None
            self.recording = False
            return self._make_plan()
        period = prof.boundary(record=False)
        if ph == "settle":
            self.phase = "measure"
            return None
        self._measured.append(period)
        if len(self._measured) >= opts.measure_steps:
            self._finish()
        return None

    # -- planning (every rank enters; rank 0 decides) ----------------------------------------
    def _make_plan(self) -> list[list[int]]:
        comm = self.comm
        if self.cost_model is None and self.options.cost_model is None:
            self.cost_model = self._calibrate()
        payload = None
        if comm.rank == 0:
            try:
                payload = self._plan_on_rank0()
            except (ConfigError, ValueError, OSError, KeyError) as e:
                payload = {"error": f"{type(e).__name__}: {e}"}
        payload = comm.broadcast_object(payload, root=0, name="fusion.plan")
        self._like = None
        if "error" in payload:
            self.phase = "static"
            raise ConfigError(f"fusion={self.strategy!r}: planning failed on rank 0 ({payload['error']}); "
                              f"training can go on with fusion='threshold'")
        self.plan = [list(g) for g in payload["plan"]]
        self._report = payload["report"]
        self.plans_made += 1
        if self.options.plan_file and comm.rank == 0:
            self._save_plan(self.options.plan_file, list(self._key[0]))
        if self.options.measure_steps == 0:
            self._finish()
        else:
            self.phase = "settle"
        return self.plan

    # -- pinned plans (docs/lags-omgs.md#pinned-plan) -------------------------------------------
    def _pinned_plan(self, names: list[str]) -> list[list[int]] | None:
        """Rank 0 reads ``plan_file`` (if it exists) and broadcasts it; None = plan as usual."""
        path = self.options.plan_file
        payload = None
        if self.comm.rank == 0:
            try:
                with open(path) as f:
                    payload = json.load(f)
            except FileNotFoundError:
                payload = {"missing": True}
            except (OSError, ValueError) as e:
                payload = {"error": f"{type(e).__name__}: {e}"}
        payload = self.comm.broadcast_object(payload, root=0, name="fusion.pinned")
        if payload.get("missing"):
            return None
        if "error" in payload:
            raise ConfigError(f"cannot read the pinned fusion plan {path!r}: {payload['error']}; delete it to "
                              f"plan again")
        if payload.get("names") != names:
            raise ConfigError(f"the pinned fusion plan {path!r} is for other tensors (or another backward "
                              f"order) than this model's; delete it or point plan_file elsewhere")
        plan = [list(map(int, g)) for g in payload["plan"]]
        validate_plan(plan, len(names))
        return plan

    def _save_plan(self, path: str, names: list[str]) -> None:
        with open(path, "w") as f:
            json.dump({"names": names, "plan": self.plan, "strategy": self.strategy,
                       "chosen": self._report.get("chosen")}, f)

    def _calibrate(self) -> CostModel:
        comm = self.comm
        if comm.size == 1:
            return CostModel(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0), None, ranks=1)
        kw = dict(self.options.calibrate or {})
        if comm.buffer_kind != "numpy" and "make_buffer" not in kw:
            like, ops = self._like, self.ops
            if ops is None or like is None:
                raise ConfigError("calibrating a native-buffer backend needs the engine's tensor ops; "
                                  "pass fusion_options={'cost_model': ...} instead")
            kw["make_buffer"] = lambda nbytes: ops.zeros(nbytes // 4, "float32", like=like)
        return calibrate(comm, **kw)

    def _plan_on_rank0(self) -> dict[str, Any]:
        opts = self.options
        cm = self.cost_model if self.cost_model is not None else CostModel.load(opts.cost_model)
        self.cost_model = cm
        prof = self._profile = self._profiler.profile()
        sizes, tb, fwd = list(prof.sizes_bytes), list(prof.backward_times), prof.forward_s
        select_s, select_c0 = opts.select_s, 0.0
        sparse = self.reducer.sparse
        if sparse and select_s is None and self.ops is not None and self._like is not None:
            # the reducers' exact selection (a fresh one: its counters stay the reducer's), on
            # sizes up to the whole gradient, the largest bucket a plan can make; with its fixed
            # cost per call (docs/lags-omgs.md#omgs-fit)
            ops, exact = self.ops, ExactTopK()
            select_s, select_c0 = fit_select_cost(ops, self._like, self.reducer.density, sum(sizes) // 4, self.clock,
                                                  select=lambda buf, k: exact.select(ops, buf, k).values)
        pr = self.reducer.price(cm, select_s, select_c0)
        sel = pr.select_time
        thr = self._threshold_plan(sizes)
        linear_cost = pr.alpha_beta if pr.exact_linear else pr.comm_time
        if self.strategy == "auto":
            strategies = candidate_plans(sizes, tb, linear_cost, threshold_bytes=self.threshold_bytes,
                                         select_time=sel, resolution_s=opts.resolution_s)
            chosen = None
        else:
            if self.strategy == "mgwfbp":
                chosen = "omgs" if sparse else "mgwfbp"
                plan = (plan_omgs(sizes, tb, pr.comm_time, sel) if sparse
                        else plan_mgwfbp(sizes, tb, pr.alpha_beta))
            else:
                chosen = "optimal"
                plan = plan_optimal(sizes, tb, pr.comm_time, compress_time=sel, resolution_s=opts.resolution_s)
            strategies = {"per_tensor": plan_per_tensor(len(sizes)), "single": plan_single(len(sizes)),
                          "threshold": thr, chosen: plan}
        choice = choose_plan(strategies, sizes, tb, pr.comm_time, compress_time=sel, forward_time=fwd)
        name = choice.name if chosen is None else chosen
        plan = [list(g) for g in strategies[name]]
        res = choice.results[name]
        report = {
            "strategy": self.strategy, "chosen": name, "buckets": len(plan),
            "bucket_bytes": [sum(sizes[i] for i in g) for g in plan],
            "bucket_tensors": [len(g) for g in plan],
            "predicted_s": res.iteration_time, "non_overlapped_comm_s": res.non_overlapped_comm,
            "measured_s": None, "measured_steps": 0, "prediction_error": None,
            "threshold": {"buckets": len(thr), "threshold_bytes": self.threshold_bytes,
                          "predicted_s": choice.results["threshold"].iteration_time,
                          "measured_s": prof.period_s},
            "candidates_s": {k: r.iteration_time for k, r in choice.results.items()},
            "comm": pr.description, "select_s": select_s if sparse else None,
            "select_c0": select_c0 if sparse else None,
            "cost_model": cm.to_dict(),
            "profile": {"rank": 0, "steps": prof.steps, "tensors": len(sizes), "bytes": sum(sizes),
                        "forward_s": fwd, "backward_s": prof.backward_s, "out_of_order": prof.out_of_order,
                        "missing": prof.missing},
            "planned_after_steps": self._steps, "plans_made": self.plans_made + 1,
        }
        return {"plan": plan, "report": report}

    def _finish(self) -> None:
        self.phase = "done"
        rep = self._report
        if self._measured:
            m = statistics.median(self._measured)
            rep["measured_s"], rep["measured_steps"] = m, len(self._measured)
            rep["prediction_error"] = rep["predicted_s"] / m - 1 if m > 0 else None
        if self.verbose and self.comm.rank == 0:
            self.log(format_report(rep))

    def _static_report(self, sizes: Sequence[int], how: str) -> dict[str, Any]:
        plan = self.plan
        return {"strategy": how, "chosen": how, "buckets": len(plan),
                "bucket_bytes": [sum(sizes[i] for i in g) for g in plan],
                "bucket_tensors": [len(g) for g in plan], "threshold_bytes": self.threshold_bytes}

    # -- results ----------------------------------------------------------------------------
    @property
    def report(self) -> dict[str, Any] | None:
        """The plan in use (``phase`` says where the tuner is: "static", "warmup", "profile",
        "settle", "measure", "done"); once planned, also the predicted and measured iteration
        time. None before ``initial_plan``."""
        if self._report is None:
            return None
        return dict(self._report, phase=self.phase)

    @property
    def profile(self) -> Profile | None:
        """Rank 0's profile the plan was made from (None on other ranks and before planning).
        ``profile.to_json()`` is the input format of ``python -m hvd_commopt.plan``."""
        return self._profile
