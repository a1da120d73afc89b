"""Round: one step's worth of gradients on their way through the collectives.

The synchronous path has one round at a time. The delayed schedules keep several (OD/CD: the
previous step's round is still in flight while the next one fills; SSD: up to k+1), so each round
owns its own fusion buffers, taken from a pool and returned once the round has been applied
(the "double buffer / k-deep ring" of spec §11.3, sized by use rather than fixed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..reduce.base import Pending, Reducer

__all__ = ["Round"]


@dataclass
class Round:
    """A round's buffers, arrivals and handles.

    Attributes:
        step: the step (scheduler counter) whose gradients it carries.
        reducer: how its buckets are reduced (chosen by the scheduler when it opened).
        tag: suffix of its collectives' names (None: the bucket names, as in the sync path).
        flats: per bucket, the fusion buffer (None until the first member arrives).
        arrived: per bucket, the member names packed so far.
        pending: bucket index -> the started reduction.
        next_launch: buckets are launched strictly in plan order; the next one to launch.
        meta: the scheduler's per-round data (the optimizer hyper-parameters at launch).
    """

    step: int
    reducer: Reducer
    tag: str | None
    flats: list[Any]
    arrived: list[set] = field(default_factory=list)
    pending: dict[int, Pending] = field(default_factory=dict)
    next_launch: int = 0
    meta: Any = None

    def wire_name(self, bucket_name: str) -> str:
        return bucket_name if self.tag is None else f"{bucket_name}@{self.tag}"

    @property
    def has_arrivals(self) -> bool:
        return any(self.arrived)
