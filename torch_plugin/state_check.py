"""The optimizer state checked across ranks once, at the first step (docs/cross-rank-check.md#state).

Why the first step and not ``load_state_dict``: Horovod's idiom loads the checkpoint on rank 0 only
and then calls ``broadcast_optimizer_state`` on every rank, so a collective inside
``load_state_dict`` would leave rank 0 alone in it; and the mistake to catch includes a rank that
never loaded at all. Every rank takes the first step, at the same point of its stream of
collectives, so the check runs there: its 32-byte digest is allgathered after the step's own
collectives (the communicator's single FIFO keeps them in the same order on every rank). The
fingerprint itself is taken outside the step, whenever the state is set before it: at wrap time,
after ``load_state_dict`` and after ``state_dict()`` (``broadcast_optimizer_state`` creates the
root's state, then calls it), so the step makes no host copy (a GPU step stays free of device-to-
host transfers). Nothing runs at the later steps. A checkpoint loaded after the first step is not compared (nothing tells the ranks
that did not load that they should take part).

What is compared: the wrapped optimizer's state (by value under the synchronous and delayed
schedules, where it is the same on every rank; by structure under local SGD / CoCoD, where it is
the worker's own) and hyper-parameters, and the compressor's state (the memory by structure: its
values are per rank; the rest by value). Local checks at load time (no collective): a warning when
the checkpoint lacks the compression memory the optimizer keeps, an error on a memory tensor whose
size is not its bucket's.
"""
from __future__ import annotations

import warnings
from typing import Any

from hvd_commopt import cross_rank_state as crs

__all__ = ["FIX", "first_step_fingerprint", "verify_first_step", "check_loaded"]

FIX = ("Load the same checkpoint on every rank (rank 0's optimizer.state_dict(), which gathers every rank's "
       "part, then optimizer.load_state_dict(...) on every rank), or load it on rank 0 and call "
       "broadcast_optimizer_state(optimizer, root_rank=0) on every rank (docs/usage.md#checkpoints)")


def first_step_fingerprint(opt: Any) -> dict[str, str]:
    """This rank's optimizer and compression state as ``{path: entry}`` (no collective)."""
    trainer = opt._hco_engine
    ops = trainer.ops
    params = [p for g in opt.param_groups for p in g["params"]]
    sd = opt._hco_base.state_dict(opt)
    shared = not trainer.checkpoint.rank_local_optimizer
    out: dict[str, str] = {}
    for idx, st in sd["state"].items():
        name = opt._parameter_names.get(params[idx], f"#{idx}") if idx < len(params) else f"#{idx}"
        crs.fingerprint(ops, st, f"optimizer.state[{name}]", shared, out)
    for i, group in enumerate(sd["param_groups"]):
        crs.fingerprint(ops, {k: v for k, v in group.items() if k != "params"}, f"optimizer.param_groups[{i}]",
                        True, out)
    red = trainer.reducer.state_dict()
    crs.fingerprint(ops, red.get("memory", {}), "compression.memory", False, out)
    crs.fingerprint(ops, {k: v for k, v in red.items() if k != "memory"}, "compression", True, out)
    return out


def verify_first_step(opt: Any, entries: dict[str, str]) -> None:
    """Compare ``entries`` across ranks (one digest allgather); every rank raises the same error."""
    crs.verify_same_state(opt._hco_engine.comm, entries, "the optimizer state at the first step", FIX,
                          name="verify.optimizer_state.digest (at the first step, on every rank)")


def check_loaded(opt: Any, engine_state: dict | None) -> None:
    """After ``load_state_dict``: warn once when the checkpoint lacks the compression memory this
    optimizer keeps; refuse a memory tensor whose size is not its bucket's."""
    trainer = opt._hco_engine
    why = crs.missing_compression_state(engine_state, trainer.reducer.holds_rank_state)
    if why is not None:
        warnings.warn(f"rank {trainer.comm.rank}: the loaded checkpoint lacks the compression state this "
                      f"optimizer keeps ({trainer.reducer!r}): {why}. The error-feedback / DGC memory starts at "
                      f"zero; the rest is restored (docs/usage.md#checkpoints).", RuntimeWarning, stacklevel=3)
    memory = trainer.reducer.state_dict().get("memory", {})
    crs.check_memory_shapes(trainer.ops, memory, {b.name: b.numel for b in trainer.buckets})
