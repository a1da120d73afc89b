"""CommEngine: the one object the adapters talk to.

Wait-free backpropagation with tensor fusion: gradients are copied into their bucket's fusion
buffer as they become ready; a bucket is handed to its reducer the moment it is complete, so its
collective runs on the progress thread while backward continues. Buckets are launched strictly
in plan order (a bucket that completes early waits for its predecessors), which keeps the
sequence of collectives identical on every rank without Horovod's per-cycle negotiation; the
plan follows backward order, so in practice nothing waits.

Adapters call, per step: :meth:`grad_ready` from their gradient hooks, then :meth:`synchronize`,
which returns every tensor's reduced gradient as a view into the reduced buffers.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from .. import env
from ..comm.communicator import Communicator
from ..compress.base import Compressor
from ..errors import ConfigError, HvdCommoptError
from ..fusion.threshold import plan_threshold, validate_plan
from ..reduce.base import Pending, ReduceContext, Reducer
from ..reduce.dense import DenseAllreduce
from ..tensor_ops import TensorOps
from .bucket import Bucket, build_buckets
from .specs import TensorSpec, verify_same_tensors
from .stats import StepStats

__all__ = ["CommEngine", "make_reducer"]

OPS = ("average", "sum")


def make_reducer(compression: Compressor | Reducer | None) -> Reducer:
    """The reducer for a user's ``compression`` argument (a compressor or a ready reducer)."""
    if compression is None:
        return DenseAllreduce()
    if isinstance(compression, Reducer):
        return compression
    if isinstance(compression, Compressor):
        if compression.collective == "allreduce":
            return DenseAllreduce(compression)
        raise ConfigError(f"{compression!r} needs a sparse exchange; pass the reducer built by "
                          f"Compression.* instead of the bare compressor")
    raise ConfigError(f"compression must be a Compression.* value, got {compression!r}")


class CommEngine:
    """Buckets, fusion buffers, reduction and the step counter of the synchronous path.

    Args:
        comm: the communicator.
        ops: the adapter's tensor ops.
        compression: a compressor (Compression.none/fp16/bf16) or a reducer.
        fusion_threshold: bytes per fusion buffer (Horovod's meaning; 0 = one tensor per
            message; None = HVD_COMMOPT_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD / 128 MiB).
        op: "average" (default) or "sum".
        gradient_predivide_factor: with op="average", divide by this before the sum and by
            size/factor after it (Horovod's meaning).
        backward_passes_per_step: gradients of this many backward passes are accumulated
            locally (summed, as Horovod does) before one reduction.
    """

    def __init__(self, comm: Communicator, ops: TensorOps, *, compression: Compressor | Reducer | None = None,
                 fusion_threshold: int | None = None, op: str = "average",
                 gradient_predivide_factor: float = 1.0, backward_passes_per_step: int = 1):
        if op not in OPS:
            raise ConfigError(f"op must be one of {OPS} (hco.Average / hco.Sum), got {op!r}")
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if gradient_predivide_factor <= 0:
            raise ConfigError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        if gradient_predivide_factor != 1.0 and op != "average":
            raise ConfigError("gradient_predivide_factor only applies to op=Average")
        self.comm, self.ops = comm, ops
        self.reducer = make_reducer(compression)
        self.fusion_threshold = env.fusion_threshold_bytes(fusion_threshold)
        self.op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        f = float(gradient_predivide_factor)
        if op == "average":
            self.ctx = ReduceContext(comm, ops, prescale=1.0 / f, postscale=f / comm.size)
        else:
            self.ctx = ReduceContext(comm, ops)
        self.step = 0  # completed synchronizations: the one step counter of the sync path
        self.last_stats = StepStats()
        self.plan: list[list[int]] = []
        self._specs: dict[str, TensorSpec] = {}
        self._backward: list[TensorSpec] = []
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[str, Bucket] = {}
        self._lock = threading.RLock()
        self._reset_step()

    # -- registration -------------------------------------------------------------------------
    def register(self, specs: Sequence[TensorSpec], backward_order: Sequence[str] | None = None,
                 plan: Sequence[Sequence[int]] | None = None) -> None:
        """Declare the tensors (in registration order) and build the buckets.

        Args:
            specs: every tensor to reduce.
            backward_order: names in the order their gradients become ready; default: the
                reverse of ``specs`` (the last layer's gradient is ready first).
            plan: groups of positions in backward order; default: threshold fusion.

        Raises:
            RankMismatchError: the tensors differ across ranks (checked collectively).
        """
        specs = list(specs)
        verify_same_tensors(self.comm, specs)
        by_name = {s.name: s for s in specs}
        order = list(backward_order) if backward_order is not None else [s.name for s in reversed(specs)]
        if sorted(order) != sorted(by_name):
            raise ConfigError("backward_order must list every registered tensor exactly once")
        self._specs = by_name
        self._backward = [by_name[n] for n in order]
        self.set_plan(plan if plan is not None else
                      plan_threshold([s.nbytes for s in self._backward], self.fusion_threshold))

    def set_plan(self, plan: Sequence[Sequence[int]]) -> None:
        """Replace the bucketing (between steps only). The caller makes it identical on all ranks."""
        with self._lock:
            if self.in_flight:
                raise HvdCommoptError("cannot change the fusion plan while gradients are in flight; "
                                      "call it between optimizer steps")
            validate_plan(plan, len(self._backward))
            self.plan = [list(g) for g in plan]
            self._buckets = build_buckets(self._backward, self.plan)
            self._bucket_of = {n: b for b in self._buckets for n in b.names}
            self._reset_step()

    @property
    def tensor_names(self) -> list[str]:
        return [s.name for s in self._backward]

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    # -- per step -----------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._countdown = {n: self.backward_passes_per_step for n in self._specs}
        self._pending: dict[int, Pending] = {}
        self._next_launch = 0
        for b in getattr(self, "_buckets", []):
            b.arrived = set()

    @property
    def in_flight(self) -> bool:
        """True between the first gradient of a step and its synchronize()."""
        return bool(self._pending) or any(b.arrived for b in self._buckets)

    def grad_ready(self, name: str, tensor: Any) -> None:
        """A gradient is ready (called from backward hooks). Packs it; launches full buckets."""
        with self._lock:
            bucket = self._bucket_of.get(name)
            if bucket is None:
                raise ConfigError(f"gradient for unregistered tensor {name!r}")
            if name in bucket.arrived:
                raise HvdCommoptError(
                    f"gradient of {name!r} was computed more than backward_passes_per_step="
                    f"{self.backward_passes_per_step} times before step(); raise "
                    f"backward_passes_per_step to accumulate gradients locally")
            self._countdown[name] -= 1
            if self._countdown[name] > 0:
                return
            self._pack(bucket, name, tensor)
            self._launch_ready()

    def _pack(self, bucket: Bucket, name: str, tensor: Any) -> None:
        ops = self.ops
        if bucket.flat is None:
            bucket.flat = ops.empty(bucket.numel, bucket.dtype, like=tensor)
        i = bucket.names.index(name)
        bucket.flat = ops.copy_into(bucket.flat, bucket.offsets[i], tensor)
        bucket.arrived.add(name)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].complete:
            b = self._buckets[self._next_launch]
            self._pending[b.index] = self.reducer.start(b.name, b.flat, self.ctx)
            self._next_launch += 1

    def missing(self) -> list[str]:
        """Tensors whose gradient has not been handed in this step."""
        return [n for b in self._buckets for n in b.names if n not in b.arrived]

    def synchronize(self, fetch: Callable[[str], Any] | None = None) -> dict[str, Any]:
        """Finish the step's reduction; return {name: reduced gradient (a view, original shape)}.

        Tensors whose gradient never arrived (unused parameters, or fewer backward passes than
        ``backward_passes_per_step``) still take part, as Horovod's do: with ``fetch(name)`` (the
        adapter's current gradient, or None) or zeros.
        """
        with self._lock:
            t0 = time.perf_counter()
            for name in self.missing():
                t = fetch(name) if fetch is not None else None
                bucket = self._bucket_of[name]
                if t is None:
                    like = bucket.flat if bucket.flat is not None else self._any_flat()
                    t = self.ops.zeros(self._specs[name].numel, self._specs[name].dtype, like=like)
                self._countdown[name] = 0
                self._pack(bucket, name, t)
            self._launch_ready()
            out: dict[str, Any] = {}
            stats = StepStats(step=self.step)
            for b in self._buckets:
                pending = self._pending[b.index]
                reduced = self.reducer.finish(pending, self.ctx)
                for name, shape, off in zip(b.names, b.shapes, b.offsets):
                    n = self._specs[name].numel
                    out[name] = self.ops.reshape(self.ops.slice(reduced, off, off + n), shape)
                comm_s = sum(h.comm_seconds for h in pending.handles)
                stats.per_bucket[b.name] = {"bytes_sent": pending.bytes_sent,
                                            "bytes_received": pending.bytes_received,
                                            "comm_seconds": comm_s}
                stats.bytes_sent += pending.bytes_sent
                stats.bytes_received += pending.bytes_received
                stats.comm_seconds += comm_s
            stats.wait_seconds = time.perf_counter() - t0
            self.last_stats = stats
            self.step += 1
            self._reset_step()
            return out

    def _any_flat(self) -> Any:
        for b in self._buckets:
            if b.flat is not None:
                return b.flat
        return None  # no gradient seen yet: ops.zeros must cope with like=None (host default)

    def abandon(self) -> None:
        """Drop this step's packed gradients (e.g. load_state_dict mid-step). Waits for any
        launched collectives first, so every rank's stream of collectives stays aligned."""
        with self._lock:
            for p in self._pending.values():
                self.reducer.finish(p, self.ctx)
            self._reset_step()

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.abandon()
        self.step = int(state.get("step", 0))
        self.reducer.load_state_dict(state.get("reducer", {}))
