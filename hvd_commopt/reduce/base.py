"""Reducer: how one bucket's flat gradient becomes the reduced gradient on every rank.

The engine calls ``start`` as soon as a bucket is complete (from the backward hooks, so the
collective overlaps the rest of backward) and ``finish`` in ``synchronize``. A reducer composes a
:class:`~hvd_commopt.compress.base.Compressor` with the collectives its payload needs; the dense
one here serves every ``collective == "allreduce"`` compressor. Sparse reducers (Top-k
allgather, gTop-k, DGC) implement the same two methods.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from ..comm.communicator import Communicator
from ..tensor_ops import TensorOps

__all__ = ["Reducer", "ReduceContext", "Pending"]


@dataclass
class ReduceContext:
    """What a reducer may use: the communicator, the tensor ops, and the scaling to apply.

    ``prescale`` multiplies the local contribution before communication and ``postscale`` the
    reduced result (Horovod's prescale/postscale factors; for op=Average ``postscale`` already
    contains 1/P).
    """

    comm: Communicator
    ops: TensorOps
    prescale: float = 1.0
    postscale: float = 1.0


@dataclass
class Pending:
    """A started reduction: the reducer's own state plus the handles it waits on."""

    name: str
    state: Any
    handles: tuple = ()

    @property
    def bytes_sent(self) -> int:
        return sum(h.bytes_sent for h in self.handles)

    @property
    def bytes_received(self) -> int:
        return sum(h.bytes_received for h in self.handles)


class Reducer(abc.ABC):
    name: str = "abstract"

    @abc.abstractmethod
    def start(self, name: str, flat: Any, ctx: ReduceContext) -> Pending:
        """Begin reducing ``flat`` (the bucket's packed gradient; the reducer may overwrite it)."""

    @abc.abstractmethod
    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        """Wait and return the reduced flat tensor (same length and dtype as the input)."""

    def state_dict(self) -> dict:
        """State that must survive a checkpoint (error-feedback residuals, ...)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state to load, got keys {sorted(state)}")
