"""The Scheduler interface, and the host interface an adapter implements for it.

Division of labour (the design of issue 4):

* The **core scheduler** holds every decision and all algorithm state: the one step counter,
  which round's collective the hooks launch (and with which reducer and wire name), which
  completed round is applied to the global replica and when, the base of the local update, the
  replica weights, the local optimizer, residuals, averaging buffers, warm-up and switch,
  checkpoint state and the final drain. It is written once against
  :class:`~hvd_commopt.tensor_ops.TensorOps` + :class:`~hvd_commopt.schedule.ops.UpdateOps`.
* The **adapter** (``torch_plugin``) supplies a :class:`ScheduleHost`: read/write the model's
  weights, read the local gradients, snapshot the optimizer's hyper-parameters, and one
  primitive, :meth:`ScheduleHost.apply_optimizer`, "run the user's wrapped optimizer once on
  these weights with these gradients". The global update U_g is therefore always the user's own
  optimizer (SGD, Adam, ... with its state, LR scheduler and param groups); the replica is a
  second set of tensors that optimizer steps on (the torch host swaps them into the parameters
  for the duration of the call, so the optimizer's state keyed by parameter *is* the replica's
  optimizer state).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import HvdCommoptError
from ..reduce.base import Reducer

__all__ = ["ScheduleHost", "Scheduler", "RoundPlan"]

Tensor = Any


class ScheduleHost(Protocol):
    """What an adapter provides to a scheduler. Tensors keep their framework shapes."""

    def weights(self) -> dict[str, Tensor]:
        """The model's current (working) weights, by registered name."""
        ...

    def assign(self, name: str, value: Tensor) -> None:
        """Make the model's weight ``name`` equal ``value`` (a no-op when ``value`` already is it)."""
        ...

    def grads(self) -> dict[str, Tensor | None]:
        """The local gradients g_i(t) as the framework holds them (None: no gradient)."""
        ...

    def hyper(self) -> Any:
        """An opaque snapshot of the wrapped optimizer's hyper-parameters (lr, momentum, ...)."""
        ...

    def param_hyper(self, name: str, key: str, default: float | None = None) -> float | None:
        """The current value of hyper-parameter ``key`` for the tensor ``name`` (its group's)."""
        ...

    def apply_optimizer(self, grads: dict[str, Tensor] | None = None, weights: dict[str, Tensor] | None = None,
                        hyper: Any = None) -> None:
        """Run the wrapped optimizer once (U_g).

        Args:
            grads: gradients to use; None = the local gradients the framework holds.
            weights: tensors to update in place instead of the model's weights (the replica);
                None = the model's own weights.
            hyper: a snapshot from :meth:`hyper` to use for this one update (restored after);
                None = the current hyper-parameters.
        """
        ...


@dataclass(frozen=True)
class RoundPlan:
    """How the engine must reduce the round the hooks are filling now.

    ``tag`` suffixes every collective's name (``bucket3:fc.w@r17``) so that rounds in flight at
    the same time have distinct names (Horovod matches collectives by name; spec §1.3, §11.3);
    None keeps the synchronous path's names.
    """

    reducer: Reducer
    tag: str | None = None


class Scheduler(abc.ABC):
    """One step counter and the per-step decisions of a schedule.

    The engine asks :meth:`round_plan` when the first gradient of a step arrives; the adapter's
    ``optimizer.step()`` calls :meth:`on_step` (unless :attr:`synchronous`, where it keeps
    Horovod's synchronize-then-step path and the engine's ``synchronize`` advances the counter).
    """

    name = "abstract"

    def __init__(self, config: Any, engine: Any):
        self.config = config
        self.engine = engine
        self.step = 0  # THE step counter: completed optimizer steps (engine.step reads it)
        self._host: ScheduleHost | None = None

    # -- wiring -------------------------------------------------------------------------------
    def attach(self, host: ScheduleHost) -> None:
        self._host = host

    @property
    def host(self) -> ScheduleHost:
        if self._host is None:
            raise HvdCommoptError(f"the {self.name} schedule has no host: the adapter must call "
                                  f"engine.attach_host(...) before training")
        return self._host

    @property
    def synchronous(self) -> bool:
        """True when the adapter should run the plain synchronous path (Schedule.sync)."""
        return False

    # -- per step -----------------------------------------------------------------------------
    def round_plan(self) -> RoundPlan | None:
        """The reducer and name tag of the round now being filled; None = don't communicate
        gradients this step (the hooks' gradients are ignored)."""
        return RoundPlan(self.engine.reducer, None)

    @abc.abstractmethod
    def on_step(self) -> None:
        """Everything ``optimizer.step()`` does under this schedule (gradients are in the host)."""

    def _warmup_step(self) -> None:
        """One synchronous step: reduce this step's gradients, then the wrapped optimizer on the
        model. Identical arithmetic to the synchronous path (engine.synchronize advances step)."""
        grads = self.host.grads()
        out = self.engine.synchronize(fetch=grads.get)
        self.host.apply_optimizer(out)

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

    def state_dict(self) -> dict:
        return {"kind": self.name}

    def load_state_dict(self, state: dict) -> None:
        self._check_kind(state)

    def _check_kind(self, state: dict) -> None:
        kind = state.get("kind", self.name)
        if kind != self.name:
            from ..errors import ConfigError
            raise ConfigError(f"this checkpoint was written with schedule '{kind}', but the optimizer uses "
                              f"'{self.name}'; build the optimizer with the same schedule to resume")
