"""Round: one step's worth of gradients on their way through the collectives.

The synchronous path has one round at a time. The delayed schedules keep several (OD/CD: the
previous step's round is still in flight while the next one fills; SSD: up to k+1), so each round
owns its own fusion buffers, taken from a pool and returned once the round has been applied
(the "double buffer / k-deep ring" of docs/wrapper.md#async-buffers, sized by use rather than fixed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..reduce.base import Pending, Reducer, RoundInfo

__all__ = ["Round", "RoundPlan", "ReducedGrads"]


@dataclass(frozen=True)
class RoundPlan:
    """How the engine must reduce the round the hooks are filling now (the scheduler's answer
    when a round opens): the reducer, and the tag that suffixes its collectives' names (None
    keeps the bucket names, as the synchronous path does)."""

    reducer: Reducer
    tag: str | None = None


@dataclass
class Round:
    """A round's buffers, arrivals and handles.

    Attributes:
        info: its step and name tag, as reducers see them.
        reducer: how its buckets are reduced (chosen by the scheduler when it opened).
        flats: per bucket, the fusion buffer (None until the first member arrives).
        arrived: per bucket, the member names packed so far.
        parts: bucket index -> ``(offset, gradient)`` of its members, for a bucket whose reducer
            reads the gradients where they are (not packed; docs/selection.md#grad-parts).
        pending: bucket index -> the started reduction.
        next_launch: buckets are launched strictly in plan order; the next one to launch.
        hyper: the wrapped optimizer's hyper-parameters when the round closed (set by the
            scheduler, so a delayed round is applied with its own step's learning rate).
    """

    info: RoundInfo
    reducer: Reducer
    flats: list[Any]
    arrived: list[set] = field(default_factory=list)
    pending: dict[int, Pending] = field(default_factory=dict)
    parts: dict[int, list] = field(default_factory=dict)
    next_launch: int = 0
    hyper: Any = None

    @property
    def step(self) -> int:
        return self.info.step

    @property
    def has_arrivals(self) -> bool:
        return any(self.arrived)


class ReducedGrads(dict):
    """A round's reduced gradients, ``{name: view of the round's buffer}``, plus ``sparse``:
    ``{bucket index: (bucket, indices, values)}`` for the buckets whose reduced gradient is +0
    everywhere but at ``indices`` (repeats allowed), where it holds ``values``. A host may apply
    such a bucket to its weights at those positions only (docs/wrapper.md#sparse-update). Empty
    when any bucket of the round was not finite (the step is skipped, and the host's optimizer
    sees the non-finite gradients as before)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.sparse: dict[int, tuple[Any, Any, Any]] = {}
