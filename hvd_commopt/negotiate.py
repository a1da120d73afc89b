"""Cross-rank check of a tensor collective's metadata before its payload moves.

A tensor collective (``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter``
and their grouped forms) first exchanges a small :class:`Request` (its kind, dtype, shape, root,
op) with one object allgather. Every rank then applies the same rules to the same list, so a
mismatch (a shape, a dtype, a root, or a different collective altogether) raises the same
:class:`TensorMismatchError` on every rank, naming each rank's request, before any buffer of the
wrong size reaches the backend (which would crash MPI or return garbage). This is Horovod's
coordinator check, done as one allgather per call (docs/horovod_api.md#negotiation).

The same exchange carries ``join``: a rank that called ``join()`` keeps answering negotiation
rounds with a "join" request and takes part in the others' allreduces with zeros, as Horovod
does (docs/horovod_api.md#join).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .comm.handle import JoinedReply
from .errors import ConfigError, RankMismatchError

__all__ = ["Request", "TensorMismatchError", "negotiate", "verdict", "JOINABLE", "NEGOTIATE_NAME"]

# One name for every negotiation round, so the MPI timeout diagnosis compares like with like
# even when the ranks asked for different collectives.
NEGOTIATE_NAME = "negotiate"
# Collectives a joined rank can take part in (with zeros); the others fail while a rank is joined.
JOINABLE = ("allreduce", "grouped_allreduce", "barrier")
# How shapes must agree: the whole shape, or all but the first dimension (per tensor for groups).
_REST_ONLY = ("allgather", "grouped_allgather", "alltoall")


class TensorMismatchError(RankMismatchError, ConfigError):
    """Ranks called a tensor collective with different shapes, dtypes, roots or ops, or called
    different collectives (a RuntimeError, as Horovod's; also a ConfigError, as before)."""


@dataclass(frozen=True)
class Request:
    """What one rank asks for. Grouped collectives give a tuple of dtypes and of shapes.

    ``args`` are the payload arguments a joined rank needs to take part (allreduce: op, prescale,
    postscale, compression); ``joined_for`` (join only) counts the rounds spent joined.
    """

    kind: str
    name: str = ""
    dtype: Any = ""
    shape: Any = ()
    root: int = -1
    op: str = ""
    args: tuple = field(default=(), compare=False)
    joined_for: int = 0

    def describe(self) -> str:
        if self.kind in ("join", "barrier"):
            return self.kind
        if self.kind.startswith("grouped_"):
            what = ", ".join(f"{d}{list(s)}" for d, s in zip(self.dtype, self.shape))
            return f"{self.kind} of [{what}]"
        extra = f" root {self.root}" if self.root >= 0 else ""
        extra += f" op {self.op}" if self.op else ""
        return f"{self.kind} {self.dtype}{list(self.shape)}{extra}"

    def key(self) -> tuple:
        """What must be equal on every rank."""
        if self.kind in _REST_ONLY:
            shapes = [tuple(s[1:]) for s in self.shape] if self.kind.startswith("grouped_") else tuple(self.shape[1:])
            return (self.kind, self.dtype, tuple(shapes) if isinstance(shapes, list) else shapes, self.op)
        return (self.kind, self.dtype, tuple(self.shape), self.root, self.op)


def verdict(reqs: list[Request], ranks: list[int] | None = None) -> str | None:
    """None when the active (non-joined) requests can run together, else why not. Pure: every
    rank reaches the same answer from the same list. ``ranks``: global rank of each entry."""
    ranks = ranks if ranks is not None else list(range(len(reqs)))
    active = [(r, q) for r, q in zip(ranks, reqs) if q.kind != "join"]
    joined = [r for r, q in zip(ranks, reqs) if q.kind == "join"]
    if not active:
        return None
    desc = "; ".join(f"rank {r}: {q.describe()}" for r, q in zip(ranks, reqs))
    name = active[0][1].name
    if len({q.kind for _, q in active}) > 1:
        return (f"ranks called different collectives at the same point ('{name}'): {desc}. Every rank "
                f"must issue the same collectives in the same order")
    kind = active[0][1].kind
    if joined and kind not in JOINABLE:
        return (f"{kind} '{name}' cannot run while rank(s) {joined} have called join() (only "
                f"allreduce can): {desc}")
    if len({q.key() for _, q in active}) > 1:
        rule = "in dtype and in every dimension but the first" if kind in _REST_ONLY else "in shape and dtype"
        if kind in ("broadcast",):
            rule += " and root rank"
        if kind in ("allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter"):
            rule += " and op"
        return f"{kind} '{name}': tensors must agree across ranks {rule}; got {desc}"
    return None


def negotiate(comm: Any, req: Request, ranks: list[int] | None = None) -> list[Request]:
    """Every rank's request (one object allgather); raises TensorMismatchError on every rank
    when they cannot run together. A size-1 communicator skips the exchange."""
    if comm.size == 1:
        return [req]
    reqs = [q.request if isinstance(q, JoinedReply) else q for q in comm.allgather_object(req, name=NEGOTIATE_NAME)]
    why = verdict(reqs, ranks)
    if why is not None:
        raise TensorMismatchError(why)
    return reqs
