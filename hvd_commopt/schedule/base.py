"""The Scheduler interface and the port it drives the engine's rounds through.

A scheduler owns the step: ``optimizer.step()`` always reaches :meth:`Scheduler.on_step` (through
``Trainer.run_step``), whatever the schedule, and only the scheduler changes the one step
counter. It sees the engine through :class:`RoundPort` (open/close/finish/release/abandon a round,
the bucket layout, the tensor ops) and the adapter through a :class:`~hvd_commopt.host.ScheduleHost`
(see :mod:`hvd_commopt.host` for the division of labour).
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Protocol, runtime_checkable

from ..buckets import Bucket
from ..comm.communicator import Communicator
from ..engine.rounds import Round, RoundPlan
from ..errors import ConfigError, HvdCommoptError
from ..host import ScheduleHost
from ..reduce.base import ReduceContext, Reducer
from ..reduce.known_gaps import warn_known_gap
from ..tensor_ops import TensorOps

__all__ = ["RoundPort", "Scheduler", "RoundPlan", "with_override"]

Tensor = Any


def with_override(snapshot: Any, override: Any) -> Any:
    """A host's hyper-parameter ``snapshot`` with ``override`` (the same shape: one dict, or one
    dict per parameter group) laid over it; ``override`` None leaves it as it is."""
    if override is None or snapshot is None:
        return snapshot
    if isinstance(snapshot, dict):
        return {**snapshot, **override}
    return [dict(s, **o) for s, o in zip(snapshot, override)]


@runtime_checkable
class RoundPort(Protocol):
    """What a scheduler may use of the engine (implemented by :class:`~hvd_commopt.engine.CommEngine`).

    Attributes:
        comm, ops: the communicator and the adapter's tensor ops.
        reducer: the reducer the user configured (``compression=``); ctx: its scaling.
    """

    comm: Communicator
    ops: TensorOps
    reducer: Reducer
    ctx: ReduceContext

    @property
    def names(self) -> list[str]:
        """Registered tensor names, in registration order."""
        ...

    @property
    def buckets(self) -> list[Bucket]:
        """The current bucket layout."""
        ...

    def close_round(self, fetch: Callable[[str], Any] | None = None) -> Round | None:
        """Pack what is missing, launch every bucket of this step's round, return it."""
        ...

    def finish_round(self, rnd: Round) -> dict[str, Tensor]:
        """Wait for a closed round; its reduced gradients as views of its buffers (which are not
        reused while a view lives, so a host may keep them as its gradients)."""
        ...

    def release_round(self, rnd: Round) -> None:
        """Return a finished round's buffers to the pool."""
        ...

    def abandon_round(self, rnd: Round) -> None:
        """Wait for a round's collectives, drop the results, release its buffers."""
        ...


class Scheduler(abc.ABC):
    """One step counter and the per-step decisions of a schedule.

    The engine asks :meth:`round_plan` when the first gradient of a step arrives; the adapter's
    ``optimizer.step()`` reaches :meth:`on_step`.

    Attributes:
        needs_weights: the schedule updates weights itself (a replica, a local update, model
            averaging), so it needs a host that holds them; the synchronous schedule does not.
        drains_for_checkpoint: ``state_dict()`` first applies every round in flight, so it must be
            called between steps (the synchronous schedule, like Horovod, saves at any time and
            drops what is in flight).
        rank_local_state: keys of :meth:`state_dict` that differ from rank to rank (gathered
            per rank into a checkpoint, docs/wrapper.md#checkpoints); the others are shared.
        rank_local_weights: the model's weights differ from rank to rank (local updates).
        rank_local_optimizer: the wrapped optimizer's state differs from rank to rank (it steps
            on local gradients).
    """

    name = "abstract"
    needs_weights = True
    drains_for_checkpoint = True
    rank_local_state: tuple[str, ...] = ()
    rank_local_weights = False
    rank_local_optimizer = False

    def __init__(self, config: Any, port: RoundPort):
        self.config = config
        self.port = port
        self.ops = port.ops
        self.step = 0  # THE step counter: completed optimizer steps (engine.step reads it)
        self._host: ScheduleHost | None = None
        self._hyper_override: Any = None  # the wrapped optimizer's momentum switched off (momentum correction)

    # -- wiring -------------------------------------------------------------------------------
    def attach(self, host: ScheduleHost) -> None:
        if self.needs_weights and not host.holds_weights:
            raise ConfigError(
                f"schedule '{self.name}' updates the weights itself (a global replica, a local update or "
                f"model averaging), which a wrapper that only returns gradients cannot do. Use the "
                f"optimizer wrapper (torch_plugin.DistributedOptimizer, tf_plugin.DistributedOptimizer for "
                f"Keras) with this schedule.")
        self._host = host
        # momentum correction: the reducer binds the optimizer's momentum (docs/dgc.md#optimizer-momentum)
        self._hyper_override = self.port.reducer.bind_host(host, self.port.names)
        warn_known_gap(self.name, None, host, list(self.port.names), "Schedule")  # docs/convergence-matrix.md#warnings

    @property
    def host(self) -> ScheduleHost:
        if self._host is None:
            raise HvdCommoptError(f"the {self.name} schedule has no host: the adapter must call "
                                  f"engine.attach_host(...) before training")
        return self._host

    def step_hyper(self) -> Any:
        """This step's hyper-parameters for an update applied later (a delayed round): the
        host's snapshot with momentum correction's override in it, so a deferred update runs the
        wrapped optimizer without momentum exactly as a synchronous step does
        (docs/ssd-sgd.md#sparse-delayed)."""
        return with_override(self.host.hyper(), self._hyper_override)

    @property
    def host_or_none(self) -> ScheduleHost | None:
        return self._host

    # -- per step -----------------------------------------------------------------------------
    def round_plan(self) -> RoundPlan | None:
        """The reducer and name tag of the round now being filled; None = don't communicate
        gradients this step (the hooks' gradients are ignored)."""
        return RoundPlan(self.port.reducer, None)

    @abc.abstractmethod
    def on_step(self, closure: Callable[[], Any] | None = None, synchronize: bool = True) -> Any:
        """Everything ``optimizer.step()`` does under this schedule (gradients are in the host).

        Args:
            closure: PyTorch's ``step(closure)`` (the synchronous schedule only).
            synchronize: False inside ``skip_synchronize()`` (Horovod's contract: apply the
                gradients as they are).
        """

    def synchronize(self) -> dict[str, Tensor]:
        """Horovod's ``optimizer.synchronize()``: only the synchronous schedule has it."""
        raise HvdCommoptError(
            f"optimizer.synchronize() is for the synchronous schedule; with schedule '{self.name}' gradients "
            f"are sent from the hooks and applied inside step(). To clip, clip the gradients before step(): "
            f"they hold the local gradient, which drives the local update.")

    def _no_closure(self, closure: Callable[[], Any] | None) -> None:
        if closure is not None:
            raise ConfigError(f"step(closure) is not supported with schedule '{self.name}': compute the loss "
                              f"and call backward() before step()")

    def _reduce_now(self) -> dict[str, Tensor]:
        """Close, reduce and release this step's round; its gradients (views of the round's
        buffers, which the host may keep: docs/wrapper.md#grad-views)."""
        rnd = self.port.close_round(self.host.grads().get)
        if rnd is None:
            raise HvdCommoptError(f"the '{self.name}' schedule does not reduce gradients at step {self.step}")
        out = self.port.finish_round(rnd)
        self.port.release_round(rnd)
        return out

    def _sync_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One synchronous step: reduce this step's gradients, run the wrapped optimizer on the
        model with them, advance the step counter (also the warm-up step of other schedules)."""
        loss = self.host.apply_optimizer(self._reduce_now(), closure=closure, hyper=self._hyper_override)
        self.step += 1
        return loss

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        """Rounds launched but not yet applied (0 for synchronous schedules)."""
        return 0

    def drain(self) -> None:
        """Wait for every outstanding collective and fold it into the state. Value-neutral: the
        weights later steps compute are the same as if the drain had not happened."""

    def finalize(self) -> None:
        """End of training: drain, then leave the model at the global model."""
        self.drain()

    def abandon(self) -> None:
        """Wait for outstanding collectives (to keep ranks aligned) and drop them."""

    def global_weights(self) -> dict[str, Tensor] | None:
        """The global replica's weights after a drain; None when the model holds the global
        weights itself (sync, CoCoD, local SGD)."""
        return None

    def swap_in_weights(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """Let the model hold ``weights``; returns what it held (``use_global_weights``)."""
        return self.host.swap_weights(weights)

    def state_dict(self) -> dict:
        return {"kind": self.name}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore the schedule's state and the step counter (``step``, saved beside it)."""
        self._check_kind(state)
        self.step = int(step)

    def _check_kind(self, state: dict) -> None:
        kind = state.get("kind", self.name)
        if kind != self.name:
            raise ConfigError(f"this checkpoint was written with schedule '{kind}', but the optimizer uses "
                              f"'{self.name}'; build the optimizer with the same schedule to resume")
