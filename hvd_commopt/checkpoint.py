"""Checkpoints that resume bit-exactly from one rank's file (docs/wrapper.md#checkpoints).

Horovod's idiom saves ``optimizer.state_dict()`` on rank 0 and loads it on every rank (or loads
it on rank 0 and calls ``broadcast_optimizer_state``). That is only exact when the optimizer's
state is the same on every rank, and here it is not: error-feedback residuals, DGC's memory, the
local weights and local optimizer state of the delayed and model-averaging schedules differ from
rank to rank. So the engine's state is split in two:

* **shared** state, the same on every rank (the step counter, the replica, schedule counters),
  saved once;
* **per-rank** state, gathered from every rank into rank 0's ``state_dict()`` under
  ``"ranks"``: ``{rank: part}``. Rank 0 holds every rank's part; any other rank holds only its
  own, so per-rank files keep working.

:func:`gather` is therefore a **collective**: every rank must call ``state_dict()`` (then rank 0
saves), exactly as every rank calls ``broadcast_optimizer_state``; when no state differs from rank
to rank (synchronous SGD without error feedback) it communicates nothing, so Horovod's examples,
which call ``state_dict()`` on rank 0 alone, work unchanged. :func:`select` is local: each
rank picks its own part from whatever checkpoint it was given.

World size: the checkpoint records it. Loading at another size keeps the shared state and
**resets the per-rank state with a warning** (residuals and DGC memory start at zero, the model
keeps the weights it was given, local optimizer state is rank 0's): per-rank state has no
meaning for a rank that did not exist, and redistributing residuals would change what is sent.

The per-rank parts travel as host NumPy copies (:class:`HostTensor`) and come back as the
adapter's CPU tensors, so ``torch.save`` / ``torch.load(weights_only=True)`` round-trip them.
This module is the only place that gathers or selects; the engine and the adapters call it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ConfigError
from .tensor_ops import TensorOps

__all__ = ["FORMAT", "gather", "select", "HostTensor"]

FORMAT = 1
_PLAIN = (str, int, float, bool, bytes, type(None), np.generic)


@dataclass
class HostTensor:
    """A tensor on its way between ranks: dtype name and a NumPy copy (bf16 as uint16 bits)."""

    dtype: str
    array: np.ndarray


def to_host(ops: TensorOps, obj: Any) -> Any:
    """``obj`` with every tensor replaced by a :class:`HostTensor` copy (picklable, framework-free)."""
    if isinstance(obj, dict):
        return {k: to_host(ops, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(ops, v) for v in obj)
    if isinstance(obj, _PLAIN):
        return obj
    return HostTensor(ops.dtype_name(obj), np.array(ops.to_numpy(obj), copy=True))


def from_host(ops: TensorOps, obj: Any) -> Any:
    """The inverse of :func:`to_host`: the adapter's tensors, on the CPU."""
    if isinstance(obj, HostTensor):
        t = ops.from_numpy(obj.array, like=ops.zeros(0, obj.dtype, like=None))
        return t if ops.dtype_name(t) == obj.dtype else ops.cast(t, obj.dtype)
    if isinstance(obj, dict):
        return {k: from_host(ops, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_host(ops, v) for v in obj)
    return obj


def gather(comm: Any, ops: TensorOps, shared: dict, local: dict, per_rank: bool = True) -> dict:
    """The checkpoint: ``shared`` plus every rank's ``local`` part on rank 0 (only its own part on
    the other ranks). A collective when ``per_rank`` (the configuration keeps state of its own on
    each rank): every rank must call it, in the same order."""
    state = {"format": FORMAT, "world_size": comm.size, "rank": comm.rank, **shared}
    if comm.size == 1:
        state["ranks"] = {0: local}
        return state
    if not per_rank:
        # Nothing differs from rank to rank (synchronous SGD without error feedback): no
        # collective, so Horovod's idiom of calling state_dict() on rank 0 alone keeps working.
        # Decided from the configuration, which the wrap-time check makes identical on every
        # rank; not from the content: a rank that just loaded a checkpoint holds residuals where
        # a fresh one holds none yet (docs/wrapper.md#checkpoints).
        state["ranks"] = {r: local for r in range(comm.size)}
        return state
    parts = comm.allgather_object(to_host(ops, local),
                                  name="optimizer.state_dict (a collective: call it on every rank)")
    keep = range(comm.size) if comm.rank == 0 else (comm.rank,)
    state["ranks"] = {r: from_host(ops, parts[r]) for r in keep}
    return state


def select(comm: Any, state: dict) -> tuple[dict, dict | None, dict | None]:
    """(shared state, this rank's own part or None = reset, the lowest saved rank's part) of a
    checkpoint, on this rank (the last one supplies what is identical on every rank, e.g. a
    reducer's compressor state, when the own part is reset).

    A checkpoint without ``"format"`` (written before per-rank parts existed) is this rank's own
    state as it is. At another world size the own part is None, with a warning.
    """
    if "format" not in state:
        own = {"reducer": state.get("reducer", {})}
        return state, own, own
    if state["format"] != FORMAT:
        raise ConfigError(f"checkpoint format {state['format']!r} is not supported (this version reads "
                          f"{FORMAT}); resume with the version that wrote it")
    shared = {k: v for k, v in state.items() if k not in ("format", "world_size", "rank", "ranks")}
    saved = int(state["world_size"])
    ranks = {int(k): v for k, v in state.get("ranks", {}).items()}  # keys may come back as str
    first = ranks[min(ranks)] if ranks else None
    if saved != comm.size:
        warnings.warn(f"rank {comm.rank}: this checkpoint was saved by {saved} ranks and is loaded by "
                      f"{comm.size}: the shared state (step, schedule, replica) is restored, the per-rank "
                      f"state (error-feedback residuals, DGC memory, local weights and local optimizer "
                      f"state) starts afresh (docs/wrapper.md#checkpoints). To resume exactly, run with "
                      f"{saved} ranks.", RuntimeWarning, stacklevel=3)
        return shared, None, first
    if comm.rank not in ranks:
        raise ConfigError(
            f"rank {comm.rank}: this checkpoint holds the per-rank state of rank(s) {sorted(ranks)} only. "
            f"Save rank 0's optimizer.state_dict() (called on every rank: it gathers every rank's part) "
            f"and load that file on every rank, or load each rank's own file")
    return shared, ranks[comm.rank], first


def shared_of(part: dict | None, keys: tuple[str, ...]) -> dict:
    """The entries of a per-rank part other than ``keys`` (e.g. a reducer's compressor state,
    identical on every rank) to keep when the per-rank state is reset."""
    return {} if part is None else {k: v for k, v in part.items() if k not in keys}
