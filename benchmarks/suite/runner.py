"""What a suite variant is built from and into: :class:`Ctx` (the builders' inputs), :class:`Runner`
(a built variant) and :class:`Skip` (a variant this tree refuses). Apart from the table of
variants (:mod:`benchmarks.suite.variants`), so that each module stays under 400 lines.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

__all__ = ["Skip", "Ctx", "Runner"]


class Skip(Exception):
    """The variant cannot run in this tree (feature missing or refused); the message says why."""


@dataclass
class Ctx:
    """What builders need besides the model: mode, world, hyper-parameters, process groups.

    ``mode`` is "throughput" (schedules without warm-up, so the steady state is timed) or "tta"
    (time-to-accuracy: warm-ups as given). ``period`` is the model-averaging period of CoCoD/local
    SGD (the throughput harness times blocks of whole periods).
    """

    mode: str
    rank: int
    size: int
    lr: float = 0.01
    momentum: float = 0.9
    optimizer: str = "sgd"  # "sgd" (with ``momentum``) or "adamw" (the transformer's time-to-accuracy)
    density: float = 0.001
    period: int = 4
    warmup_steps: int = 0
    steps_per_epoch: int | None = None
    powersgd_start: int = 2
    profile_steps: int = 5
    batch_size: int | None = None
    cost_model: Any = None
    ddp_group: Any = None
    new_ddp_group: Callable[[], Any] | None = None
    gloo_comm: Callable[[], Any] | None = None
    backend_comm: Callable[[str], Any] | None = None  # "mpi"/"gloo" -> our Communicator on it
    communicator: Any = None  # set for "<variant>@<backend>": our variants run on it
    # a new Communicator of ours on a Gloo group of its own, as each DDP gets one (None: our default
    # backend is not Gloo); every one of our variants that is not pinned to a backend gets one
    fresh_comm: Callable[[], Any] | None = None


@dataclass
class Runner:
    """A built variant: call ``module`` forward, ``opt.step()``; the rest is reporting.

    ``ours`` variants expose the library's per-step accounting (``comm_stats``); ``drain`` waits
    for rounds a delayed schedule keeps in flight (so a block's time includes its communication,
    and nothing of it spills into the next variant's block).
    """

    name: str
    module: nn.Module
    opt: torch.optim.Optimizer
    params: nn.Module
    ours: bool = False
    native_kernels: bool = True  # False: the NumPy host kernels (docs/selection.md#native-sweep)
    native_half_sum: bool = True  # False: MPI's bf16 ring adds through NumPy (docs/backends.md#half-ring)
    native_quant: bool = True  # False: the quantisers' composed torch ops on the host too (docs/quantize.md#native)
    pair_sum: bool = True  # False: small sums at 2 ranks by Gloo's allreduce (docs/backends.md#pair-sum)
    direct: bool = True  # False: every collective through the progress thread (docs/backends.md#direct-start)
    long_wait_pauses: bool = True  # False: the waiter polls every 200 us however long (docs/backends.md#direct-wait)
    analytic_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def bytes_sent_last_step(self) -> int | None:
        if not self.ours:
            return None
        return int(self.opt.comm_stats.get("bytes_sent", 0))

    def drain(self) -> None:
        if self.ours:
            self.opt.drain()

    def tuning(self) -> bool:
        """True while a planned fusion strategy is still warming up, profiling or settling, or
        ``compression="auto"`` has not yet measured its decision (its report is None until the
        first decision; its phase is the policy's, "watch" once a decision was measured and kept
        or reverted): the suite times what a long run gets, not the decision's profiling
        (docs/auto-compression.md#policy)."""
        if not self.ours:
            return False
        rep = getattr(self.opt, "fusion_report", None)
        if bool(rep) and rep.get("phase") in ("warmup", "profile", "settle", "measure"):
            return True
        if not self.name.partition("@")[0].startswith("auto"):  # auto, auto_dense, auto_nphalf
            return False
        auto = self.opt.compression_report
        return auto is None or auto.get("phase") in ("wait", "warmup", "profile", "settle", "measure")

    def finalize(self) -> None:
        if self.ours:
            self.opt.finalize()

    @contextlib.contextmanager
    def eval_weights(self) -> Iterator[None]:
        """The weights to evaluate: the global replica under delayed schedules, else the model."""
        if self.ours:
            with self.opt.use_global_weights():
                yield
        else:
            yield
