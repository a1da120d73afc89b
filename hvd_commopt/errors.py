"""Errors raised by hvd_commopt. Each message says what went wrong and how to fix it."""
from __future__ import annotations

__all__ = [
    "HvdCommoptError",
    "CollectiveTimeoutError",
    "RankFailedError",
    "RankMismatchError",
    "LaunchEnvironmentError",
    "ConfigError",
]


class HvdCommoptError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class CollectiveTimeoutError(HvdCommoptError):
    """A collective did not complete within the configured timeout.

    Attributes:
        op: the collective's kind ("allreduce", "broadcast", ...).
        name: the collective's name (e.g. the bucket it carries).
        missing_ranks: ranks known not to have entered it, or None where the backend cannot tell.
    """

    def __init__(self, message: str, op: str = "", name: str = "", missing_ranks: list[int] | None = None):
        super().__init__(message)
        self.op = op
        self.name = name
        self.missing_ranks = missing_ranks


class RankFailedError(HvdCommoptError):
    """Another rank failed (an uncaught exception) or ended its script while this rank waits for
    it in a collective, so the collective can never complete.

    Raised from the wait as soon as the peer's notice arrives, instead of a
    :class:`CollectiveTimeoutError` after the whole timeout.

    Attributes:
        failed_rank: the rank that failed or left.
        op: the collective this rank was waiting in.
        name: its name (e.g. the bucket it carries).
    """

    def __init__(self, message: str, failed_rank: int = -1, op: str = "", name: str = ""):
        super().__init__(message)
        self.failed_rank = failed_rank
        self.op = op
        self.name = name


class RankMismatchError(HvdCommoptError):
    """Ranks disagree on something that must be identical (the registered model, a plan, a setting)."""


class LaunchEnvironmentError(HvdCommoptError):
    """The launcher's environment is inconsistent or a launcher is missing."""


class ConfigError(HvdCommoptError, ValueError):
    """A bad argument or setting."""


class NonFiniteGradientError(HvdCommoptError):
    """A rank's gradient for a compressed bucket holds NaN or Inf under ``nonfinite="raise"``
    (docs/wrapper.md#nonfinite)."""
