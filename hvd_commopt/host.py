"""The host: what an adapter provides so the core's schedulers can run a training step.

Division of labour:

* The **core scheduler** (:mod:`hvd_commopt.schedule`) holds every decision and all algorithm
  state: the one step counter, which round's collective the hooks launch, which completed round
  is applied and when, the replica weights, the local optimizer, residuals, averaging buffers,
  warm-up and switch, checkpoint state and the final drain. It is written once against
  :class:`~hvd_commopt.tensor_ops.TensorOps`.
* The **adapter** supplies a :class:`ScheduleHost`: read/write the model's weights, read the
  local gradients, snapshot the optimizer's hyper-parameters, and one primitive,
  :meth:`ScheduleHost.apply_optimizer`, "run the user's wrapped optimizer once on these weights
  with these gradients". The global update is therefore always the user's own optimizer (SGD,
  Adam, ... with its state, LR scheduler and param groups).

:class:`GradientCapture` is the host of callers that apply the reduced gradients themselves
(TensorFlow's ``DistributedGradientTape``, tests): its "optimizer" only keeps the gradients it
is given. It holds no weights, so only schedules that reduce gradients accept it.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from .errors import HvdCommoptError

__all__ = ["ScheduleHost", "MomentumSwitch", "OptimizerFamily", "ADAPTIVE", "GradientCapture"]

Tensor = Any


@runtime_checkable
class ScheduleHost(Protocol):
    """What an adapter provides to a scheduler. Tensors keep their framework shapes.

    Attributes:
        holds_weights: False for a host that only receives gradients (no weights(), assign(),
            swap_weights()): schedules that update weights themselves refuse it.
    """

    holds_weights: bool

    def weights(self) -> dict[str, Tensor]:
        """The model's current (working) weights, by registered name."""
        ...

    def assign(self, name: str, value: Tensor) -> None:
        """Make the model's weight ``name`` equal ``value`` (a no-op when ``value`` already is it)."""
        ...

    def swap_weights(self, new: dict[str, Tensor]) -> dict[str, Tensor]:
        """Let the model hold ``new`` (e.g. the global replica, to evaluate it) and return what it
        held, to be swapped back the same way. Cheap where the framework can swap buffers."""
        ...

    def grads(self) -> dict[str, Tensor | None]:
        """The local gradients g_i(t) as the framework holds them (None: no gradient)."""
        ...

    def set_grads(self, grads: dict[str, Tensor]) -> None:
        """Make ``grads`` the gradients the framework holds (where its optimizer reads them)."""
        ...

    def hyper(self) -> Any:
        """An opaque snapshot of the wrapped optimizer's hyper-parameters (lr, momentum, ...)."""
        ...

    def param_hyper(self, name: str, key: str, default: float | None = None) -> float | None:
        """The current value of hyper-parameter ``key`` for the tensor ``name`` (its group's)."""
        ...

    def apply_optimizer(self, grads: dict[str, Tensor] | None = None, weights: dict[str, Tensor] | None = None,
                        hyper: Any = None, closure: Callable[[], Any] | None = None) -> Any:
        """Run the wrapped optimizer once; returns what it returns (the closure's loss).

        Args:
            grads: gradients to use (with ``weights`` None, first :meth:`set_grads`, as a
                synchronous step does); None = the framework's own.
            weights: tensors to update in place instead of the model's weights (the replica);
                None = the model's own weights.
            hyper: a snapshot from :meth:`hyper` to use for this one update (restored after);
                None = the current hyper-parameters.
            closure: passed to the optimizer (PyTorch's ``step(closure)``).
        """
        ...


@runtime_checkable
class MomentumSwitch(Protocol):
    """A host whose wrapped optimizer can run without its momentum (torch.optim.SGD's can, Keras'
    cannot): what momentum correction needs when it applies the optimizer's momentum itself
    (docs/dgc.md#optimizer-momentum)."""

    def hyper_without_momentum(self) -> Any:
        """The hyper-parameter override (the shape of :meth:`ScheduleHost.hyper`) that runs the
        optimizer without momentum; None when this optimizer cannot."""
        ...


#: :meth:`OptimizerFamily.optimizer_family` of an optimizer with a per-coordinate second moment
#: (Adam, AdamW, NAdam, RAdam, Adamax, Adagrad, RMSprop): docs/adaptive-optimizers.md.
ADAPTIVE = "adaptive"


@runtime_checkable
class OptimizerFamily(Protocol):
    """A host that says which family its wrapped optimizer belongs to: sparse compression adapts
    to an adaptive one (density warm-up, no momentum correction, docs/adaptive-optimizers.md)."""

    def optimizer_family(self) -> str:
        """:data:`ADAPTIVE` for an optimizer that divides by a per-coordinate second moment;
        "sgd" for SGD and its momentum forms; "other" for anything else."""
        ...


class GradientCapture:
    """A host whose "optimizer" keeps the gradients it is given (see the module docstring)."""

    holds_weights = False

    def __init__(self) -> None:
        self._grads: dict[str, Tensor | None] = {}
        self._result: dict[str, Tensor] | None = None

    def set_grads(self, grads: dict[str, Tensor | None]) -> None:
        """The framework's local gradients (missing names count as None: they reduce as zeros)."""
        self._grads = dict(grads)

    def grads(self) -> dict[str, Tensor | None]:
        return dict(self._grads)

    def hyper(self) -> Any:
        return None

    def param_hyper(self, name: str, key: str, default: float | None = None) -> float | None:
        return default

    def apply_optimizer(self, grads=None, weights=None, hyper=None, closure=None) -> Any:
        if weights is not None or closure is not None:
            raise HvdCommoptError("internal: a gradient-capturing host cannot step weights or run a closure")
        self._result = dict(grads) if grads is not None else dict(self._grads)
        return None

    def take(self) -> dict[str, Tensor]:
        """The gradients of the last step (once)."""
        if self._result is None:
            raise HvdCommoptError("internal: no step has handed gradients to the capture host")
        out, self._result = self._result, None
        return out

    def _no_weights(self, *_a: Any, **_k: Any) -> Any:
        raise HvdCommoptError("internal: a gradient-capturing host holds no weights")

    weights = assign = swap_weights = _no_weights
