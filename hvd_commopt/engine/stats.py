"""Per-step traffic and timing, readable from the optimizer (``optimizer.comm_stats``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """What one step communicated.

    Attributes:
        bytes_sent / bytes_received: this rank's traffic, from the collectives' algorithms.
        wait_seconds: time ``synchronize`` blocked waiting for communication (not overlapped).
        comm_seconds: time the progress thread spent inside collectives (overlapped or not).
        per_bucket: {bucket name: {"bytes_sent", "bytes_received", "comm_seconds"}}.
    """

    step: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    comm_seconds: float = 0.0
    per_bucket: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)
