"""The engine's two outside seams: the scheduler it drives its rounds for, and who owns a reducer.

:class:`StepScheduler` is all the engine knows of :mod:`hvd_commopt.schedule` (which it does not
import). :func:`own_reducer` makes a compression object passed to several optimizers a
configuration: each engine then keeps its own residuals (docs/cross-rank-check.md#shared-compression).
"""
from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Callable, Protocol

from ..errors import ConfigError
from ..host import ScheduleHost
from ..reduce.base import Reducer
from .rounds import RoundPlan

__all__ = ["StepScheduler", "own_reducer"]

Tensor = Any


class StepScheduler(Protocol):
    """What the engine needs of its scheduler (implemented by :class:`hvd_commopt.schedule.Scheduler`)."""

    name: str
    step: int
    drains_for_checkpoint: bool
    rank_local_state: tuple[str, ...]
    rank_local_weights: bool
    rank_local_optimizer: bool

    def attach(self, host: ScheduleHost) -> None: ...
    @property
    def host_or_none(self) -> ScheduleHost | None: ...
    def round_plan(self) -> RoundPlan | None: ...
    def on_step(self, closure: Callable[[], Any] | None, synchronize: bool) -> Any: ...
    def synchronize(self) -> dict[str, Tensor]: ...
    @property
    def outstanding(self) -> int: ...
    def drain(self) -> None: ...
    def finalize(self) -> None: ...
    def abandon(self) -> None: ...
    def global_weights(self) -> dict[str, Tensor] | None: ...
    def swap_in_weights(self, weights: dict[str, Tensor]) -> dict[str, Tensor]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict, step: int) -> None: ...


# id(reducer) -> (weakref to the reducer, weakref to its engine); by id, so that a reducer that
# defines __eq__ (unhashable) works too
_OWNERS: dict[int, tuple[Any, Any]] = {}
_OWNERS_LOCK = threading.Lock()


def own_reducer(reducer: Reducer, engine: Any) -> Reducer:
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
