"""A :class:`~hvd_commopt.engine.CommEngine`'s checkpoint: what is saved, gathered and restored.

Shared state (the step counter, the schedule's shared state) is saved once; per-rank state (the
reducer's memory, the schedule's rank-local state, local weights, the adapter's ``rank_local``)
is gathered into rank 0's result, one part per rank (docs/wrapper.md#checkpoints). Loading takes
this rank's part; the other ranks' parts are held until the next step, so that rank 0 can load a
checkpoint and save it again unchanged, and ``broadcast_optimizer_state`` can send them on.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from .. import checkpoint
from ..comm.communicator import Communicator
from ..host import ScheduleHost
from ..reduce.base import Reducer
from ..tensor_ops import TensorOps
from .ports import Checkpointable

__all__ = ["StatePort", "engine_state", "load_engine_state"]


@runtime_checkable
class StatePort(Protocol):
    """What a checkpoint reads of the engine (implemented by :class:`~hvd_commopt.engine.CommEngine`)."""

    comm: Communicator
    ops: TensorOps
    reducer: Reducer


def engine_state(engine: StatePort, sched: Checkpointable, step: int, host: ScheduleHost | None,
                 held_parts: dict[int, dict], rank_local: dict | None = None) -> dict:
    """Step counter, schedule state, and every rank's per-rank state (residuals, DGC memory,
    local weights, the schedule's local state, ``rank_local`` from the adapter) gathered into
    rank 0's result (docs/wrapper.md#checkpoints). **A collective: call it on every rank.** The
    caller has drained first where ``sched.drains_for_checkpoint``; ``held_parts``: the other
    ranks' parts of a checkpoint loaded and not stepped since, which stand as they were."""
    sched_state = dict(sched.state_dict())
    local = {"reducer": engine.reducer.state_dict(),
             "schedule": {k: sched_state.pop(k) for k in sched.rank_local_state if k in sched_state}}
    if sched.rank_local_weights and host is not None:
        local["weights"] = dict(host.weights())
    local.update(rank_local or {})
    per_rank = (engine.reducer.holds_rank_state or bool(sched.rank_local_state) or sched.rank_local_weights
                or rank_local is not None)
    state = checkpoint.gather(engine.comm, engine.ops, {"step": step, "schedule": sched_state}, local,
                              per_rank)
    for r in state["ranks"]:  # loaded here, not stepped since: the checkpoint's parts stand
        if r != engine.comm.rank and r in held_parts:
            state["ranks"][r] = held_parts[r]
    return state


def load_engine_state(engine: StatePort, sched: Checkpointable, host: ScheduleHost | None,
                      state: dict) -> tuple[dict, dict[int, dict]]:
    """Restore a checkpoint from :func:`engine_state` (rank 0's, or this rank's own) into the
    reducer, the schedule and the host's weights, after the caller abandoned what was in flight.
    Returns what the adapter gave as ``rank_local`` when saving ({} when the per-rank state was
    reset: another world size, docs/wrapper.md#checkpoints) and the other ranks' parts, to hold
    until the next step."""
    shared, own, first = checkpoint.select(engine.comm, state)
    held = {} if own is None else {int(r): p for r, p in state.get("ranks", {}).items()
                                   if int(r) != engine.comm.rank}
    if own is None:  # keep what every rank shares (a compressor's epoch), drop the memory
        engine.reducer.load_state_dict(checkpoint.shared_of((first or {}).get("reducer"), ("memory",)))
    else:
        engine.reducer.load_state_dict(own.get("reducer", {}))
    sched_state = dict(shared.get("schedule", {}))
    sched_state.update((own or {}).get("schedule", {}))
    sched.load_state_dict(sched_state, int(shared.get("step", 0)))
    own = own or {}
    if own.get("weights") and host is not None:
        w = host.weights()
        for n, v in own["weights"].items():
            host.assign(n, engine.ops.copy_(w[n], v))
    return {k: v for k, v in own.items() if k not in ("reducer", "schedule", "weights")}, held
