"""``join()``: a rank that has run out of data keeps the others' collectives going.

Horovod's semantics (docs/horovod_api.md#join): after ``join()`` a rank takes part in every
allreduce the other ranks still run, contributing zeros (so an average is the sum of the
others' tensors divided by the full size), until every rank has joined; a collective that
cannot run with a joined rank (allgather, broadcast, ...) fails on the ranks that called it.
``join()`` returns, on every rank, the rank that joined last.

On a backend that can see its peers' collectives (MPI: :mod:`hvd_commopt.comm.mpi_join`; Gloo
and NCCL under mpirun through the MPI control plane: ``torch_plugin/join_follow.py``) the
joined rank follows every collective the others run, the optimizer's buckets included. Elsewhere
it runs on the negotiation rounds of :mod:`hvd_commopt.negotiate`: the joined rank answers each
round with a "join" request carrying how many rounds it has been joined, reads what the others
asked for, and mirrors the payload with zeros of that dtype and shape.
"""
from __future__ import annotations

import math
from typing import Any

from .collectives import _allreduce_payload, _grouped_payload
from .comm.communicator import Communicator
from .comm.handle import JoinedReply
from .matching import _request, plan
from .negotiate import NEGOTIATE_NAME, Request, verdict
from .tensor_ops import TensorOps

__all__ = ["join"]


def join(comm: Communicator, ops: TensorOps, like: Any = None) -> int:
    """Take part in the other ranks' collectives until every rank joined; return the last
    rank to join (the same on every rank). ``like``: a tensor whose device the zeros use."""
    if comm.size == 1:
        return 0
    if comm.backend.follows_joined:  # every collective, the optimizer's buckets included
        return comm.follow_joined(Request("join", "join"))
    rounds = 0
    while True:
        offers = comm.allgather_object(JoinedReply(Request("join", "join", joined_for=rounds)), name=NEGOTIATE_NAME)
        if all(isinstance(o, JoinedReply) for o in offers):
            joined_for = [o.request.joined_for for o in offers]
            fewest = min(joined_for)  # fewest rounds joined = joined last
            return max(r for r, n in enumerate(joined_for) if n == fewest)
        rounds += 1
        what, keys = plan(offers)
        if what != "run":
            continue
        for key in keys:
            reqs = [_request(o, key) for o in offers]
            if verdict(reqs) is not None:
                continue  # the ranks that asked raise; this one stays joined
            q = next(q for q in reqs if q.kind != "join")
            if q.kind == "allreduce":
                pre, post, comp = q.args
                zeros = ops.zeros(math.prod(q.shape), q.dtype, like)
                _allreduce_payload(comm, ops, zeros, q.dtype, q.op, comp, pre, post, q.name).wait()
            elif q.kind == "grouped_allreduce":
                pre, post, comp = q.args
                zeros = [ops.zeros(math.prod(s), d, like) for d, s in zip(q.dtype, q.shape)]
                _grouped_payload(comm, ops, zeros, q.dtype, q.op, comp, pre, post, q.name).wait()
            # barrier: the negotiation round itself was the barrier
