"""Local gradient aggregation for the Keras ``DistributedOptimizer``: Horovod's
``backward_passes_per_step`` and ``average_aggregated_gradients``
(docs/horovod_tf.md#keras-aggregation).

Keras calls ``optimizer.apply(grads)`` once per batch. With ``backward_passes_per_step = N``
the wrapper adds each batch's gradients into accumulators (optimizer variables, so they are
checkpointed and traced like the optimizer's own slots) and only every N-th call runs the core's
step on the accumulated gradients (one reduction for N batches: the traffic saving) and applies
the result; the other calls change nothing else (the wrapped optimizer's ``iterations`` counts
applied updates). ``average_aggregated_gradients=True`` divides the accumulated sum by N before
the reduction (Horovod's default is the sum). Every rank takes the same branch: the micro-step
counter advances identically everywhere.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from hvd_commopt.errors import ConfigError

__all__ = ["LocalAggregation"]


class LocalAggregation:
    """Accumulators and the micro-step counter of one optimizer."""

    def __init__(self, steps: int, average: bool):
        if int(steps) < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {steps}")
        self.steps = int(steps)
        self.average = bool(average)
        self.accumulators: list | None = None
        self.counter = None

    def build(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """Create the accumulators (zeros like each variable) and the counter, once."""
        if self.accumulators is not None:
            return
        self.accumulators = [optimizer.add_variable_from_reference(v, name="hco_accumulated_grad") for v in variables]
        self.counter = optimizer.add_variable(shape=(), dtype="int64", initializer="zeros", name="hco_micro_step")

    def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any],
              step: Callable[[list], None]) -> None:
        """Accumulate ``grads``; on every ``steps``-th call run ``step(aggregated grads)``."""
        self.build(optimizer, variables)
        if len(self.accumulators) != len(variables):
            raise ConfigError(f"the optimizer aggregates gradients of {len(self.accumulators)} variables, "
                              f"got {len(variables)}; build one DistributedOptimizer per set of variables")
        present = [g is not None for g in grads]
        for acc, g in zip(self.accumulators, grads):
            if g is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))
        self.counter.assign_add(1)
        boundary = tf.equal(self.counter % self.steps, 0)
        scale = 1.0 / self.steps if self.average else 1.0

        def _step():
            agg = [tf.convert_to_tensor(acc) * tf.cast(scale, acc.dtype) if p else None
                   for acc, p in zip(self.accumulators, present)]
            step(agg)
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        if tf.executing_eagerly():
            if bool(boundary):
                _step()
        else:
            tf.cond(boundary, _step, lambda: tf.constant(False))
