"""``DistributedOptimizer``: Horovod's contract on top of the core engine.

The wrapper only attaches hooks and translates tensors: a post-accumulate-grad hook per
parameter hands the gradient to :class:`hvd_commopt.engine.CommEngine`; ``step()`` calls
``synchronize()``, makes the reduced gradients ``p.grad`` (views of the fusion buffers, no copy:
docs/wrapper.md#grad-views) and runs the wrapped step.

Differences from Horovod, on purpose:
* The optimizer passed in is converted *in place* (its class becomes a dynamic subclass) and
  returned, instead of a new optimizer being built from its param_groups: its defaults and state
  survive, and an LR scheduler created before wrapping keeps driving the same object.
* Hooks are registered at size 1 too, so a single-process run exercises the same code path.
* On CUDA, each bucket is compressed and sent on a side stream while backward runs, and
  ``step()`` makes the compute stream, not the host, wait for it (:mod:`torch_plugin.streams`,
  docs/backends.md#cuda-streams).
* A parameter with no gradient on this rank takes part with zeros and receives the reduced
  gradient, so ranks stay identical even when they use different parameters (DDP's
  ``find_unused_parameters`` outcome, with no extra pass).

Every ``step()`` is the core's step (``Trainer.run_step``), whatever the schedule: the
synchronous schedule reduces and runs the wrapped optimizer; delayed and model-averaging
schedules (``schedule=Schedule.od()/.ssd()/.cd()/.cocod()/.local_sgd()``) do their own thing. This
adapter only supplies a :class:`~torch_plugin.host.TorchScheduleHost` ("run the wrapped optimizer
on these weights with these gradients", read/write weights) and the hooks. Under a delayed
schedule (OD/SSD/CD) the **model holds the local weights** w_loc during training; the global
replica w_g lives in the scheduler and is stepped by the wrapped optimizer, whose state *is* the
replica's optimizer state. ``use_global_weights()`` swaps the replica in (e.g. to evaluate) and
``finalize()`` drains the rounds in flight and leaves the model at w_g. Under CoCoD-SGD / local
SGD the model holds this worker's local model and ``finalize()`` averages the models.
"""
from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager

import torch

from hvd_commopt import build_engine, runtime
from hvd_commopt.engine import TensorSpec, Trainer
from hvd_commopt.engine.tuner import FusionOptions
from hvd_commopt.errors import ConfigError, HvdCommoptError
from hvd_commopt.process_sets import registry
from hvd_commopt.reduce import Average, Sum
from hvd_commopt.schedule.sync import SyncScheduler

from . import amp, state_check
from ._compat import repoint_lr_scheduler_step
from .devices import check_devices
from .host import TorchScheduleHost
from .buffers import BufferSync
from .ops import TorchOps
from .streams import streams_for

__all__ = ["DistributedOptimizer", "Average", "Sum"]


class _DistributedOptimizerMixin:
    """Methods grafted onto the wrapped optimizer's class."""

    _hco_user_synced = False  # inside skip_synchronize(): the user reduced already
    _hco_scaler_step = False  # GradScaler took over this step (torch_plugin/amp.py)
    _hco_state_checked = False  # the optimizer state was compared across ranks (torch_plugin/state_check.py)
    # (set at wrap time when there is nobody to compare with: one process)
    _hco_buffers: BufferSync | None = None
    _hco_state_entries: dict[str, str] = {}  # the fingerprint compared at the first step

    def _hco_setup(self, named_parameters, engine: Trainer) -> None:
        self._hco_engine = engine
        handles = [p.register_post_accumulate_grad_hook(self._hco_make_hook(n)) for n, p in named_parameters]
        me = weakref.ref(self)
        for _, p in named_parameters:
            p._hco_owner = me
        # The hooks hold the engine weakly, so a dropped optimizer is collected and its hooks go
        # with it: the parameters can then be wrapped again (see _refuse_second_wrapper).
        weakref.finalize(self, _remove_hooks, handles)
        self._hco_host = TorchScheduleHost(self, list(named_parameters))
        engine.attach_host(self._hco_host)

    def _hco_make_hook(self, name: str):
        # the CommEngine itself, not the Trainer that forwards to it: one call less per gradient
        engine_ref = weakref.ref(self._hco_engine.engine)

        def hook(p: torch.Tensor) -> None:
            engine = engine_ref()
            if engine is not None:
                g = p.grad  # a sparse one (nn.Embedding(sparse=True)) is reduced dense (docs/horovod_api.md#sparse)
                engine.grad_ready(name, g.to_dense() if g.is_sparse else g)
        return hook

    @property
    def comm_engine(self) -> Trainer:
        return self._hco_engine

    @property
    def fusion_report(self) -> dict | None:
        """The fusion plan in use: bucket count and sizes, ``phase``, and with ``fusion="mgwfbp"|
        "optimal"|"auto"`` (once the profiled steps are over) the predicted and measured
        iteration time. See :mod:`hvd_commopt.engine.tuner`."""
        return self._hco_engine.fusion_report

    @property
    def compression_report(self) -> dict | None:
        """With ``compression="auto"``: per bucket the method chosen and why, the predicted and
        measured step (docs/auto-compression.md#report); None otherwise."""
        return self._hco_engine.compression_report

    @property
    def comm_stats(self) -> dict:
        """Traffic and wait time of the last step (bytes sent/received, seconds, per bucket)."""
        return self._hco_engine.last_stats.as_dict()

    def synchronize(self) -> None:
        """Finish reducing this step's gradients and write them into ``p.grad`` (synchronous
        schedule; e.g. to clip them, then ``step()`` inside ``skip_synchronize()``)."""
        self._hco_engine.synchronize()

    @contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip synchronisation (after an explicit ``synchronize()``, e.g. to clip)."""
        self._hco_user_synced = True
        try:
            with self._hco_engine.skip_synchronize():
                yield
        finally:
            self._hco_user_synced = False

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """GradScaler's question before it looks at the gradients: reduce them first, so that its
        Inf/NaN check and the unscaling see the reduced gradients (docs/usage.md#amp)."""
        return amp.take_over_for_scaler(self)

    def _hco_take_fingerprint(self) -> None:
        """Before the first step: what the state is now (wrap, load, broadcast), to compare there."""
        if not self._hco_state_checked:
            self._hco_state_entries = state_check.first_step_fingerprint(self)

    def step(self, closure=None):
        entries = None if self._hco_state_checked else self._hco_state_entries
        if self._hco_scaler_step:
            loss = amp.scaled_step(self, closure)
        else:
            loss = self._hco_engine.run_step(closure)
        if entries is not None:  # once: after this step's own collectives (docs/cross-rank-check.md#state)
            self._hco_state_checked = True
            state_check.verify_first_step(self, entries)
        if self._hco_buffers is not None:
            self._hco_buffers.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._hco_engine.in_flight:
            raise HvdCommoptError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); this would race with the gradients being communicated. "
                "Call zero_grad() before backward() or after step().")
        self._hco_scaler_step = False  # a scaler step that never reached step() is over
        self._hco_host.drop_replaced()
        return self._hco_base.zero_grad(self, set_to_none=set_to_none)

    def finalize(self) -> None:
        """End of training: wait for the rounds still in flight, apply them, and leave the model
        at the global model (the replica w_g for OD/SSD/CD; the average of the workers' models
        for CoCoD/local SGD; nothing to do for sync). Call it on every rank after the last step."""
        self._hco_engine.finalize()

    def drain(self) -> None:
        """Wait for and apply every round in flight (value-neutral; the model is unchanged)."""
        self._hco_engine.drain()

    def use_global_weights(self):
        """Within the block, the model holds the global replica w_g (drained first), e.g. to
        evaluate the global model. Under schedules without a replica the model is unchanged."""
        return self._hco_engine.use_global_weights()

    def state_dict(self):
        """The wrapped optimizer's state plus ``"hvd_commopt"``: step, schedule state and every
        rank's per-rank state (residuals, DGC memory, local weights and, under local SGD/CoCoD,
        the local optimizer state) gathered into rank 0's copy (docs/wrapper.md#checkpoints).

        **A collective: call it on every rank**, after step() (a delayed schedule drains first),
        then save rank 0's result. Every rank can then load that one file (or rank 0 loads it and
        ``broadcast_optimizer_state`` sends it) and continues bit-exactly."""
        sd = self._hco_base.state_dict(self)
        engine = self._hco_engine
        local = {"optimizer": sd["state"]} if engine.checkpoint.rank_local_optimizer else None
        sd["hvd_commopt"] = engine.state_dict(rank_local=local)
        if self._hco_buffers is not None:
            self._hco_buffers.settle()  # the model's buffers are rank 0's when it is saved next
        self._hco_take_fingerprint()  # broadcast_optimizer_state's root may have just created its state
        return sd

    def load_state_dict(self, state_dict):
        """Load a :meth:`state_dict` (rank 0's or this rank's own); this rank takes its own part.
        Load the model's state first: per-rank local weights are then put back on each rank."""
        state_dict = dict(state_dict)
        engine_state = state_dict.pop("hvd_commopt", None)
        self._hco_engine.abandon()  # like Horovod: pending handles are dropped on load
        if engine_state is not None:
            own = self._hco_engine.load_state_dict(engine_state)
            if "optimizer" in own:  # this rank's local optimizer state (local SGD, CoCoD)
                state_dict["state"] = own["optimizer"]
        out = self._hco_base.load_state_dict(self, state_dict)
        state_check.check_loaded(self, engine_state)  # local: missing compression state, memory sizes
        self._hco_take_fingerprint()
        return out


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()


def _refuse_second_wrapper(named) -> None:
    """A parameter already wrapped by a live DistributedOptimizer would have its gradient handed
    to two engines (reduced twice, two streams of collectives): refused with the fix."""
    def live_owner():
        return next(((n, p._hco_owner()) for n, p in named
                     if getattr(p, "_hco_owner", None) is not None and p._hco_owner() is not None), None)
    hit = live_owner()
    if hit is not None:
        gc.collect()  # an optimizer the script already dropped may only await the cycle collector
        hit = live_owner()
    if hit is not None:
        raise ConfigError(
            f"parameter {hit[0]!r} is already handled by another DistributedOptimizer (its gradient would be "
            f"reduced twice). Give each DistributedOptimizer its own parameters (a GAN: one over the "
            f"generator's, one over the discriminator's), or put all parameters in one optimizer's param "
            f"groups and wrap it once; to re-wrap, drop every reference to the old optimizer first.")


def _named(optimizer: torch.optim.Optimizer, named_parameters) -> list[tuple[str, torch.Tensor]]:
    in_opt = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(in_opt)]
    else:
        named = list(named_parameters)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
            raise ConfigError("named_parameters should be a sequence of (name, parameter) tuples, "
                              "usually model.named_parameters()")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ConfigError(f"parameter names in named_parameters must be unique; duplicates: {dups}")
        named_ids = {id(p) for _, p in named}
        unnamed = [p for p in in_opt if id(p) not in named_ids]
        if unnamed:
            raise ConfigError(f"{len(unnamed)} optimizer parameter(s) missing from named_parameters "
                              f"(shapes {[tuple(p.shape) for p in unnamed][:5]}); pass "
                              f"model.named_parameters() for the model the optimizer was built on")
        opt_ids = {id(p) for p in in_opt}
        named = [(n, p) for n, p in named if id(p) in opt_ids]  # Horovod ignores the rest too
    return [(n, p) for n, p in named if p.requires_grad]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step: int = 1, op: str = Average,
                         gradient_predivide_factor: float = 1.0, fusion_threshold: int | None = None,
                         communicator=None, schedule=None, fusion: str = "threshold",
                         fusion_options=None, verbose: bool | None = None,
                         process_set=None, sparse_as_dense: bool = False,
                         model: torch.nn.Module | None = None,
                         broadcast_buffers: bool = True) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    Args:
        optimizer: any ``torch.optim`` optimizer (converted in place and returned).
        named_parameters: ``model.named_parameters()``; names must match across ranks.
        compression: ``Compression.none`` (default), ``Compression.fp16``, ``Compression.bf16``.
            ``"auto"`` / ``Compression.auto(...)``: chosen per bucket at run time (docs/auto-compression.md).
        backward_passes_per_step: local accumulation passes before one reduction (summed).
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with Average, divide by f before the sum, by size/f after.
        fusion_threshold: fusion buffer size in bytes (0 = no fusion); default from
            ``HVD_COMMOPT_FUSION_THRESHOLD`` / ``HOROVOD_FUSION_THRESHOLD``, else 25 MiB
            (``env.DEFAULT_FUSION_THRESHOLD``). Dense buckets close once they reach it, as DDP's
            do (docs/wrapper.md#first-bucket); sparse ones stay under it.
        communicator: a core Communicator; default: the one ``init()`` made.
        schedule: ``Schedule.sync()`` (default), ``.od()``, ``.ssd()``, ``.cd()``, ``.cocod(period)``,
            ``.local_sgd(period)`` (see hvd_commopt.schedule). Non-sync schedules need ``step()``
            without a closure and do not offer ``synchronize()``.
        fusion: ``"threshold"`` (default: buckets of ``fusion_threshold`` bytes), ``"none"`` (one
            tensor per bucket), or ``"mgwfbp"`` / ``"optimal"`` / ``"auto"``: the first steps run
            with the threshold plan while per-tensor gradient-ready times are recorded, the
            network is calibrated, rank 0 plans (MG-WFBP's greedy, the exact DP, or the plan the
            simulator predicts fastest) and broadcasts the plan. OMGS for sparse compression.
        fusion_options: dict of :class:`hvd_commopt.engine.tuner.FusionOptions` fields, e.g.
            ``{"warmup_steps": 2, "profile_steps": 10, "cost_model": "cost_model.json"}``.
        verbose: print the chosen plan and its predicted vs measured iteration time once on
            rank 0; default ``HVD_COMMOPT_VERBOSE``.
        process_set: reduce over this ProcessSet's ranks only (``add_process_set``); on ranks
            outside it the optimizer steps on local gradients, as in Horovod.
        sparse_as_dense: Horovod's flag, accepted: sparse gradients are always reduced dense and
            handed back sparse (docs/horovod_api.md#sparse).
        model: the model, for its buffers (BatchNorm's running statistics, ...): their names, shapes
            and dtypes are checked across ranks here, and with ``broadcast_buffers`` every rank holds
            rank 0's values before every forward, as under DDP (docs/usage.md#buffers).
        broadcast_buffers: True (default, DDP's): keep the buffers equal to rank 0's; False: leave
            them per rank (a warning here names the buffers that differ).

    Raises:
        RankMismatchError: the model differs across ranks (checked here, collectively).
        ConfigError: a bad argument, with the fix.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ConfigError("this optimizer is already a DistributedOptimizer; wrap it once")
    comm = communicator if communicator is not None else runtime.communicator()
    if process_set is not None and communicator is None:
        comm = registry(comm).optimizer_communicator(process_set)
    named = _named(optimizer, named_parameters)
    _refuse_second_wrapper(named)
    check_devices(comm, named)
    if verbose is not None:
        fusion_options = FusionOptions.coerce(fusion_options, verbose=verbose)
    engine = build_engine(comm, TorchOps(), compression=compression, fusion_threshold=fusion_threshold,
                          op=op, gradient_predivide_factor=gradient_predivide_factor,
                          backward_passes_per_step=backward_passes_per_step, schedule=schedule,
                          fusion=fusion, fusion_options=fusion_options,
                          streams=streams_for([p for _, p in named]))  # CUDA: docs/backends.md#cuda-streams
    specs = [TensorSpec(n, tuple(p.shape), TorchOps().dtype_name(p)) for n, p in named]
    engine.register(specs)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {"_hco_base": base})
    optimizer.__class__ = cls
    optimizer._hco_setup(named, engine)
    optimizer._parameter_names = {p: n for n, p in named}  # Horovod's attribute
    optimizer._hco_state_checked = comm.size == 1
    optimizer._hco_take_fingerprint()
    if model is not None:
        optimizer._hco_buffers = BufferSync(comm, model, broadcast_buffers,
                                            every_step=isinstance(engine.scheduler, SyncScheduler))
    # an LR scheduler built before wrapping left a step that bypasses ours: re-point it
    repoint_lr_scheduler_step(optimizer, base, cls.step)
    return optimizer
