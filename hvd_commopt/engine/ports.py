"""The engine's outside seams: the scheduler seen from the rounds, from the step, and as
checkpointed state; and who owns a reducer.

:class:`RoundSource` is what :class:`~hvd_commopt.engine.CommEngine` needs of a scheduler (which
reducer a round uses, the step counter, draining before a re-plan); :class:`StepScheduler` adds
what the step API (:class:`~hvd_commopt.engine.trainer.Trainer`) forwards to it per step;
:class:`Checkpointable` is its saved state. All three are implemented by
:class:`hvd_commopt.schedule.Scheduler`, which the engine does not import.
:func:`own_reducer` makes a compression object passed to several optimizers a configuration:
each engine then keeps its own residuals (docs/cross-rank-check.md#shared-compression).
"""
from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Callable, Protocol, runtime_checkable

from ..errors import ConfigError
from ..host import ScheduleHost
from ..reduce.base import Reducer
from .rounds import RoundPlan

__all__ = ["RoundSource", "StepScheduler", "Checkpointable", "own_reducer"]

Tensor = Any


@runtime_checkable
class RoundSource(Protocol):
    """What the engine's rounds need of the scheduler.

    Attributes:
        step: completed optimizer steps (the one counter; a round carries it as its step).
        config: the ``Schedule.*`` configuration (a dataclass), compared across ranks.
    """

    step: int
    config: Any

    def round_plan(self) -> RoundPlan | None:
        """The reducer and name tag of the round opening now (None: no communication this step)."""
        ...

    @property
    def outstanding(self) -> int:
        """Rounds launched but not applied yet (a re-plan drains them first)."""
        ...

    def drain(self) -> None:
        """Wait for and apply every outstanding round (value-neutral)."""
        ...


@runtime_checkable
class StepScheduler(RoundSource, Protocol):
    """What the step API forwards to the scheduler (the adapter's per-step calls)."""

    name: str

    def attach(self, host: ScheduleHost) -> None: ...
    @property
    def host_or_none(self) -> ScheduleHost | None: ...
    def on_step(self, closure: Callable[[], Any] | None, synchronize: bool) -> Any: ...
    def synchronize(self) -> dict[str, Tensor]: ...
    def finalize(self) -> None: ...
    def abandon(self) -> None: ...
    def global_weights(self) -> dict[str, Tensor] | None: ...
    def swap_in_weights(self, weights: dict[str, Tensor]) -> dict[str, Tensor]: ...


@runtime_checkable
class Checkpointable(Protocol):
    """A scheduler's part of a checkpoint (docs/wrapper.md#checkpoints).

    Attributes:
        drains_for_checkpoint: saving first applies every round in flight (between steps only).
        rank_local_state: keys of :meth:`state_dict` that differ from rank to rank.
        rank_local_weights: the model's weights differ from rank to rank (local updates).
        rank_local_optimizer: the wrapped optimizer's state differs from rank to rank.
    """

    drains_for_checkpoint: bool
    rank_local_state: tuple[str, ...]
    rank_local_weights: bool
    rank_local_optimizer: bool

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict, step: int) -> None: ...


# id(reducer) -> (weakref to the reducer, weakref to its engine); by id, so that a reducer that
# defines __eq__ (unhashable) works too
_OWNERS: dict[int, tuple[Any, Any]] = {}
_OWNERS_LOCK = threading.Lock()


def own_reducer(reducer: Reducer, engine: object) -> Reducer:
    """``reducer`` if no live engine uses it yet, else a copy with its own (empty) state: a
    compression object given to several optimizers is a configuration, and each engine keeps its
    own residuals (docs/cross-rank-check.md#shared-compression)."""
    with _OWNERS_LOCK:
        for k in [k for k, (r, e) in _OWNERS.items() if r() is None or e() is None]:
            del _OWNERS[k]
        entry = _OWNERS.get(id(reducer))
        if entry is not None and entry[0]() is reducer:
            try:
                reducer = reducer.fresh()
            except (TypeError, copy.Error) as e:  # state that cannot be copied: refuse, with the fix
                raise ConfigError(f"this compression object ({reducer!r}) is already used by another optimizer "
                                  f"and cannot be copied ({e}); build one Compression.* object per optimizer") from e
        _OWNERS[id(reducer)] = (weakref.ref(reducer), weakref.ref(engine))
    return reducer
