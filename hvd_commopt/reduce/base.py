"""Reducer: how one bucket's flat gradient becomes the reduced gradient on every rank.

The engine calls ``start(bucket, rnd, flat, ctx)`` as soon as a bucket is complete (from the
backward hooks, so the collective overlaps the rest of backward) and ``finish`` when the step
needs the result. The bucket (:class:`~hvd_commopt.buckets.Bucket`) and the round
(:class:`RoundInfo`) are passed as data: per-bucket state is keyed by ``bucket.name``, anything
that depends on the step (random-k's shared seed, DGC's warm-up epoch) reads ``rnd.step``, and
collectives are named ``rnd.wire(bucket)`` (distinct for rounds in flight together).

A reducer composes a :class:`~hvd_commopt.compress.base.Compressor` or a selector with the
collectives its payload needs, and with a :class:`~hvd_commopt.memory.base.Memory` when it
remembers what it did not send. ``start`` returns a :class:`Pending` whose ``state`` is a small
record type of the reducer's own.
"""
from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import Any, Sequence

from ..buckets import Bucket
from ..comm.communicator import Communicator
from ..errors import ConfigError
from ..fusion.pricing import Pricing, dense_pricing
from ..host import ScheduleHost
from ..memory.error_feedback import TensorStore
from ..tensor_ops import TensorOps

__all__ = ["Reducer", "ReduceContext", "Pending", "RoundInfo", "Average", "Sum", "REDUCE_AVERAGING_OPS",
           "check_op", "Min", "Max", "Product", "Adasum", "TENSOR_OPS", "check_tensor_op"]

# Horovod's op names for gradient reduction, defined once for the core and both adapters.
Average = "average"
Sum = "sum"
# Element-wise ops of the tensor allreduce (hco.allreduce(t, op=hco.Min)); the backend names them
# "min"/"max"/"prod". Adasum is a reducer of its own (reduce/adasum.py), dispatched by the
# tensor allreduce and the optimizer.
Min = "min"
Max = "max"
Product = "product"
Adasum = "adasum"
TENSOR_OPS = (Average, Sum, Min, Max, Product, Adasum)
# The gradient reductions of the optimizers (Adasum: docs/adasum.md#adasum).
REDUCE_AVERAGING_OPS = (Average, Sum, Adasum)


def check_op(op: Any) -> str:
    """``op`` if it is Average, Sum or Adasum, else a ConfigError naming the choices."""
    if op not in REDUCE_AVERAGING_OPS:
        raise ConfigError(f"op must be one of {REDUCE_AVERAGING_OPS} (hco.Average / hco.Sum / hco.Adasum), got {op!r}")
    return op


def check_tensor_op(op: Any) -> str:
    """``op`` if the tensor allreduce knows it (Average/Sum/Min/Max/Product/Adasum), else a ConfigError."""
    if op not in TENSOR_OPS:
        raise ConfigError(f"op must be one of {TENSOR_OPS} (hco.Average / Sum / Min / Max / Product / Adasum), "
                          f"got {op!r}")
    return op


@dataclass(frozen=True)
class RoundInfo:
    """The round a bucket is reduced in.

    Attributes:
        step: the optimizer step whose gradients the round carries (the scheduler's counter when
            the round opened; identical on every rank).
        tag: suffix of the round's collective names (``bucket3:fc.w@r17``), so rounds in flight
            at the same time have distinct names (docs/wrapper.md#wrapper-skeleton, docs/wrapper.md#async-buffers); None keeps the bucket names.
    """

    step: int = 0
    tag: str | None = None

    def wire(self, bucket: Bucket) -> str:
        """The name of ``bucket``'s collective in this round."""
        return bucket.name if self.tag is None else f"{bucket.name}@{self.tag}"


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
    """A started reduction: the reducer's own record (a small dataclass per reducer) plus the
    handles it waits on."""

    name: str
    state: Any
    handles: tuple = ()
    # set by a finish that decided the result's finiteness cheaply (None: settle checks); on the
    # device route a 0-d bool tensor that settle reads once (docs/selection.md#device-route)
    finite: Any = None
    # (indices, values) set by a finish whose result is +0 everywhere else: the values the result
    # holds at those positions, repeated where an index is (docs/wrapper.md#sparse-update)
    support: Any = None

    @property
    def bytes_sent(self) -> int:
        return sum(h.bytes_sent for h in self.handles)

    @property
    def bytes_received(self) -> int:
        return sum(h.bytes_received for h in self.handles)


class Reducer(abc.ABC):
    """How a bucket is reduced. Subclasses: dense allreduce, sparse allgather, gTop-k.

    Attributes:
        name: short name for reports.
        sparse: True when buckets are sparsified (the fusion planner then uses OMGS's model).
        compressor: what the payload is made of (a compressor, or a sparse reducer's selector);
            shared by the copies :meth:`fresh` makes. None for a reducer without one.
    """

    name: str = "abstract"
    sparse: bool = False
    compressor: Any = None

    @abc.abstractmethod
    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        """Begin reducing ``flat`` (the bucket's packed gradient; the reducer may overwrite it)."""

    @abc.abstractmethod
    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        """Wait and return the reduced flat tensor (same length and dtype as the input)."""

    def reduce(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Any:
        """``finish(start(...))`` then :meth:`settle`: a blocking reduction."""
        pending = self.start(bucket, rnd, flat, ctx)
        out = self.finish(pending, ctx)
        self.settle(bucket, rnd, out, ctx, pending)
        return out

    def settle(self, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
               pending: Pending | None = None, flags: tuple[bool, ...] | None = None) -> bool:
        """Called with the reduced result ``out`` of a finished round and its finished ``pending``
        (the engine does it): a reducer with a memory rolls it back when ``out`` is not finite
        (docs/wrapper.md#nonfinite); ``pending.finite``, when ``finish`` set it, is that verdict.
        ``flags``: the host values of :meth:`device_flags`, when the engine read them with the
        step's other buckets' (docs/selection.md#one-read-per-step); None: settle reads them itself.
        Returns False when the bucket was rolled back (True: finite, or no memory to roll back)."""
        return True

    def device_flags(self, bucket: Bucket, rnd: RoundInfo, pending: Pending) -> tuple[Any, ...] | None:
        """The 0-d device flags (the device route's NaN/Inf verdict) that :meth:`settle` would read
        for this finished round, so that the engine reads every bucket's in ONE host read per step
        and hands their values to ``settle(..., flags=...)`` (docs/selection.md#one-read-per-step).
        None (the default): no flag to read, settle decides by itself."""
        return None

    def rollback(self, bucket: Bucket, rnd: RoundInfo, ctx: ReduceContext) -> None:
        """A *finite* bucket's round is skipped because another bucket of the same step was not
        finite (a loss scaler then skips the whole step): its memory goes back to the snapshot
        too, so the skipped step leaves no trace anywhere (docs/wrapper.md#nonfinite-step)."""

    def reads_parts(self, bucket: Bucket, ops: TensorOps) -> bool:
        """Whether :meth:`start` may be handed ``bucket``'s gradients unpacked, where they are
        (:class:`~hvd_commopt.select.grad_parts.GradParts`; docs/selection.md#grad-parts): no,
        unless a reducer's selection reads them in its own pass."""
        return False

    def bind_host(self, host: ScheduleHost, names: list[str]) -> Any:
        """The wrapped optimizer (``host``, with the registered tensor ``names``) is attached: a
        reducer whose memory applies the momentum itself (momentum correction) takes the
        optimizer's and returns the host's hyper-parameter override that runs the optimizer
        without it (docs/dgc.md#optimizer-momentum). None: nothing to override (the default)."""
        return None

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        """The bucket layout changed from ``old`` to ``new`` between steps (a re-plan): per-bucket
        state follows its tensors into the new buckets (docs/lags-omgs.md#replan-residuals).
        Nothing to move by default (a reducer without state)."""

    def keeps_dense(self, spec: Any) -> bool:
        """Whether tensor ``spec`` (a :class:`~hvd_commopt.buckets.TensorSpec`) leaves its fusion
        group for a bucket sent uncompressed (docs/topk.md#dense-1d): never, for dense reducers."""
        return False

    def config(self) -> dict:
        """The configuration as plain values (kind, compressor, density, seed, ...): ranks must
        agree on it, and the engines of the TensorFlow adapter are cached by it."""
        return {"reducer": self.name}

    def price(self, cost: Any, select_s: float | None = None, select_c0: float = 0.0) -> Pricing:
        """What one bucket costs under ``cost`` (a fitted :class:`~hvd_commopt.fusion.cost_model.
        CostModel`), for the fusion planners: a dense allreduce unless overridden."""
        return dense_pricing(cost, 1.0, "dense allreduce")

    @property
    def density(self) -> float | None:
        """One density for every bucket (sparse reducers), None when dense or per-layer."""
        return None

    def fresh(self) -> Reducer:
        """A reducer with this one's configuration, the same compressor object, and none of its
        per-bucket state: for a second engine built from the same object
        (docs/cross-rank-check.md#shared-compression). The state lives in
        :class:`~hvd_commopt.memory.error_feedback.TensorStore` objects, which start empty;
        anything else is deep-copied as it is now (a reducer keeping per-bucket state elsewhere
        overrides this)."""
        memo: dict[int, Any] = {}
        seen: set[int] = set()

        def walk(obj: Any) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if isinstance(obj, TensorStore):
                memo[id(obj)] = TensorStore(obj.what)
            elif isinstance(obj, (list, tuple)):
                for x in obj:
                    walk(x)
            elif isinstance(obj, dict):
                for x in obj.values():
                    walk(x)
            elif hasattr(obj, "__dict__") and not isinstance(obj, type):
                for x in vars(obj).values():
                    walk(x)

        walk(self)
        if self.compressor is not None:
            memo[id(self.compressor)] = self.compressor  # shared: a config (DGC's epoch is set for all)
        return copy.deepcopy(self, memo)

    #: Whether this reducer keeps state that differs from rank to rank (residuals, DGC memory).
    #: Decided by construction, not by content, so that every rank agrees on it before any step
    #: or load (the checkpoint's gather depends on it, docs/wrapper.md#checkpoints).
    holds_rank_state: bool = False

    def state_dict(self) -> dict:
        """State that must survive a checkpoint (error-feedback residuals, ...)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state to load, got keys {sorted(state)}")
