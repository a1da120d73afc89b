"""What the MPI backend learns from its peers' positions: ``join()``'s follower, and a step that
only some ranks take. A data backend with MPI as its control plane (torch.distributed under
mpirun, docs/backends.md#control-plane) uses both: its collectives are marked on the control
plane, and :func:`follow` takes the data backend's way of taking part.

Both read the position every rank's status responder reports (:mod:`hvd_commopt.comm.mpi`): the
collective it is in (its number in the rank's stream, kind, name, and the buffer description a
joined rank needs), its last finished one, and since when it has been joined. Nothing here runs
on the step's path: the follower runs only on a rank that called ``join()``, the stall check only
on a thread that has already waited seconds for a collective.

* **join** (docs/horovod_api.md#join). A joined rank answers the collective that the other ranks
  are in at its own position in the stream with zeros of the same dtype and size (an allreduce's
  sum is then the others' sum, an average the others' sum over the full size, as Horovod's), an
  empty part in an allgather, its :class:`~hvd_commopt.comm.handle.JoinedReply` in an object
  exchange (so a negotiation round reads "join"), and the same barrier. It does this for every
  collective, the optimizer's fused and compressed buckets included, until every rank has joined
  and every rank has reached the same position; then one barrier, and every rank returns the rank
  that joined last (the largest position at join; the larger rank on a tie). Collectives whose
  zeros would not mean "no contribution" are refused on the joined rank with the reason (its
  failure notice ends the others' wait in seconds): point-to-point rounds (gTop-k, Adasum) and
  model averaging (local SGD, CoCoD-SGD, DiLoCo average weights, not gradients: zeros would
  shrink the model).
* **stall** (docs/horovod_api.md#one-rank-step). When every rank waits inside a collective and
  they are not all in the same one, none can ever complete (each needs the others in its own;
  point-to-point rounds, which involve only some ranks, are never judged).
  Seen twice, one second apart, with nobody having moved, that is reported at once, naming which
  rank is in which collective, instead of after the collective timeout (300 s by default).
  A rank behind another is not such a case when the leader's collective at the trailer's number
  was the trailer's (same kind and name): the leader finished it and the trailer's thread has not
  yet noticed (a starved progress thread under load). Each rank reports the (number, kind, name)
  of its last :data:`HISTORY_LEN` collectives for this comparison; only a difference at the same
  number, or a trailer further behind than the leader's history reaches, is a mismatch
  (docs/horovod_api.md#one-rank-step).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, RankFailedError

__all__ = ["follow", "mirror", "stalled", "MODEL_AVERAGING_TAGS", "HISTORY_LEN"]

# Round tags of the schedules that average weights rather than gradients (``bucket@<tag><n>``).
MODEL_AVERAGING_TAGS = ("local_sgd", "cocod", "diloco")
_FOLLOW_POLL_S = 0.001
_STALL_AFTER_S = 1.0  # a wait shorter than this is never examined
_STALL_CONFIRM_S = 1.0  # the same positions must be seen this far apart
HISTORY_LEN = 64  # collectives each rank reports for the stall check's same-number comparison


def _behind_only(seen: list[tuple[tuple, tuple]]) -> bool:
    """True when every pair of positions agrees at the same number: each rank's (seq, op, name)
    equals the (op, name) at that seq in the history of every rank ahead of it (equal seqs:
    the positions themselves). ``seen``: (position, history) per rank."""
    for where, _ in seen:
        for other, history in seen:
            if other[0] < where[0]:
                continue
            if other[0] == where[0]:
                if tuple(other[1:3]) != tuple(where[1:3]):
                    return False
                continue
            at = [h for h in history if h[0] == where[0]]
            if not at or tuple(at[-1][1:3]) != tuple(where[1:3]):
                return False  # a different collective at that number, or too far behind to tell
    return True


def _position(st: dict) -> int:
    """The number of the collective a peer is in, or will start next."""
    if st["where"] is not None:
        return int(st["where"][0])
    return int(st["last"][0]) + 1 if st["last"] else 0


def _refusal(op: str, name: str, desc: Any) -> str | None:
    tag = name.partition("@")[2]
    if tag.startswith(MODEL_AVERAGING_TAGS):
        return (f"it averages model weights ('{name}'), and a joined rank's zeros would shrink the model: "
                f"with a model-averaging schedule give every rank the same number of steps (equal shards, "
                f"e.g. DistributedSampler(drop_last=True)) instead of join()")
    if desc is None:
        return (f"a {op} is a point-to-point round (gTop-k, Adasum) that a joined rank cannot answer with zeros; "
                f"use a dense or Top-k compression with join(), or give every rank the same number of steps")
    return None


def mirror(be: Any, op: str, name: str, desc: Any, reply: bytes) -> None:
    """Take part in ``op`` on the MPI backend ``be`` as a joined rank (host zeros)."""
    inf = float("inf")
    if op == "allreduce":
        dtype, n, rop = desc
        be.allreduce_(np.zeros(n, dtype=np.dtype(dtype)), rop, name, inf)
    elif op == "allgather":
        dtype, n, equal = desc
        if equal:  # every rank promised the same count: zeros (index 0 with value 0 adds nothing)
            be.allgather_equal(np.zeros(n, dtype=np.dtype(dtype)), name, inf)
        else:
            be.allgather(np.zeros(0, dtype=np.dtype(dtype)), name, inf)
    elif op == "allgather_object":
        be.allgather_host(np.frombuffer(reply, dtype=np.uint8).copy(), name, inf)
    elif op == "reducescatter":
        dtype, counts, rop = desc
        be.reducescatter(np.zeros(int(sum(counts)), dtype=np.dtype(dtype)), list(counts), rop, name, inf)
    elif op == "alltoall":
        be.alltoall(np.zeros(0, dtype=np.dtype(desc[0])), [0] * be.size, name, inf)
    elif op == "broadcast":
        dtype, n, root = desc
        be.broadcast_(np.zeros(n, dtype=np.dtype(dtype)), root, name, inf)
    elif op == "barrier":
        be.barrier(name, inf)
    else:  # pragma: no cover - every kind above; a new one must be added here
        raise ConfigError(f"join(): no way to take part in a {op} ('{name}')")


TakePart = Callable[[str, str, Any, bytes], None]


def follow(be: Any, reply: bytes, take_part: TakePart) -> int:
    """``join()`` on its progress thread: see the module docstring. ``be``: the MPIBackend whose
    status responder reports the positions (the data backend's own, or its control plane's,
    docs/backends.md#control-plane); ``take_part(op, name, desc, reply)`` runs one collective
    as a joined rank on the data backend (:func:`mirror` for MPI's own collectives)."""
    be._joined_at = be._seq
    try:
        while True:
            states = be._query_peers()
            failed = be.peer_failure()
            if failed is not None:
                raise RankFailedError(f"rank {be.rank}: join() cannot complete: {failed[1]}", failed_rank=failed[0],
                                      op="join", name="join")
            if len(states) < be.size - 1:
                continue  # a peer did not answer within the grace period: ask again
            for r, st in sorted(states.items()):
                if st.get("left") and st.get("joined") is None:
                    raise RankFailedError(f"rank {be.rank}: join() cannot complete: rank {r} ended its script "
                                          f"without calling join(). Every rank must call join() after its loop",
                                          failed_rank=r, op="join", name="join")
            me = be._seq
            active = {r: st for r, st in states.items() if st.get("joined") is None}
            if not active:
                if all(_position(st) == me for st in states.values()):
                    joins = {r: int(st["joined"]) for r, st in states.items()}
                    joins[be.rank] = int(be._joined_at)
                    take_part("barrier", "join", (), reply)  # every rank saw every rank joined; keep us joined till then
                    last = max(joins.values())
                    return max(r for r, j in joins.items() if j == last)
                time.sleep(_FOLLOW_POLL_S)
                continue
            here = [st["where"] for _, st in sorted(active.items())
                    if st["where"] is not None and int(st["where"][0]) == me]
            if not here:
                time.sleep(_FOLLOW_POLL_S)  # the others compute; their next collective is ours to answer
                continue
            _, op, name, desc = (tuple(here[0]) + (None,))[:4]
            why = _refusal(op, name, desc)
            if why is not None:
                raise ConfigError(f"rank {be.rank} called join(), and the other ranks now run collective #{me} "
                                  f"{op} '{name}', which a joined rank cannot take part in: {why}")
            take_part(op, name, desc, reply)
    finally:
        be._joined_at = None


def stalled(be: Any, waited_s: float) -> tuple[list[int], str] | None:
    """See the module docstring; (the ranks in another collective, why) or None."""
    mine = be._where  # read once: the progress thread changes it
    if waited_s < _STALL_AFTER_S or mine is None or be._joined_at is not None or not be._can_query:
        be._stall = None
        return None
    now = time.monotonic()
    if be._stall is not None and now - be._stall[1] < _STALL_CONFIRM_S:
        return None
    states = be._query_peers()
    if len(states) < be.size - 1 or any(st["where"] is None or st.get("joined") is not None
                                         for st in states.values()):
        be._stall = None
        return None
    seen = tuple((r, tuple(st["where"][:3])) for r, st in sorted(states.items())) + ((be.rank, tuple(mine[:3])),)
    if len({w[1:] for _, w in seen}) == 1 or any(w[1] == "sendrecv" for _, w in seen):
        # all in the same collective: slow, not stuck; point-to-point rounds (process sets,
        # gTop-k) legitimately involve only some ranks
        be._stall = None
        return None
    histories = {r: st.get("history", ()) for r, st in states.items()}
    histories[be.rank] = be._history
    if _behind_only([(w, tuple(histories[r])) for r, w in seen]):
        be._stall = None  # a rank behind on a collective the others finished: slow, not stuck
        return None
    if be._stall is None or be._stall[0] != seen:
        be._stall = (seen, now)
        return None
    other = [r for r, st in sorted(states.items()) if tuple(st["where"][1:3]) != tuple(mine[1:3])]
    parts = "; ".join(f"rank {r} waits in its collective #{w[0]} {w[1]} '{w[2]}'" for r, w in seen)
    be._broken = True
    return other, (f"every rank waits in a collective that not every rank is in ({parts}): a step or collective "
                   f"that only some ranks run (an extra step on one rank, a call under `if rank == ...`). Every "
                   f"rank must issue the same collectives in the same order; for uneven data call join() on "
                   f"every rank after its loop (docs/horovod_api.md#join)")
