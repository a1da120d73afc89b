"""Every private TensorFlow and Keras API tf_plugin uses, each with a public-API fallback
(docs/versions.md#private-apis).

The adapter's other modules call these functions and name no private TF or Keras attribute (one
exception: SyncBatchNormalization overrides Keras' ``_moments``, whose presence
:func:`batch_norm_moments_hook` checks). Each function takes the private route while the running
version has it and otherwise a public one; a private handle is a module-level name here, and the
fallback runs when it is None or the object lacks it, which is how tests/tf/test_compat.py forces
each fallback: by monkeypatching the handle to None.
"""
from __future__ import annotations

import importlib
from typing import Any

import keras
import tensorflow as tf

from hvd_commopt.errors import ConfigError

__all__ = ["batch_norm_moments_hook", "batch_norm_reduction_axes", "built_variables", "in_xla_context",
           "learning_rate_variable"]

# Keras 3 optimizer: the learning rate as given (a variable for a float, else the schedule or callable).
_LEARNING_RATE: str | None = "_learning_rate"
# Keras 3 optimizer: the variables build() was given (what apply(grads) applies to when given none).
_TRAINABLE_VARIABLES: str | None = "_trainable_variables"
# keras.layers.BatchNormalization: the axes its moments reduce over, and the method call() takes
# the training moments from (SyncBatchNormalization overrides it).
_BN_REDUCTION_AXES: str | None = "_reduction_axes"
_BN_MOMENTS: str | None = "_moments"
# GraphOrParentsInXlaContext(graph): is a function being traced for XLA?
_CONTROL_FLOW_UTIL: str | None = "tensorflow.python.ops.control_flow_util"
_MISSING = object()


def learning_rate_variable(optimizer: Any) -> Any | None:
    """The optimizer's learning-rate variable (one that ``assign`` sets), or None when the learning
    rate is a schedule or a callable. Fallback: Keras' public ``learning_rate`` property, which is
    that variable itself when there is one (and a schedule's current value, no variable, else)."""
    name = _LEARNING_RATE
    lr = getattr(optimizer, name, _MISSING) if name is not None else _MISSING
    if lr is _MISSING:
        lr = optimizer.learning_rate
    return lr if hasattr(lr, "assign") else None


def built_variables(optimizer: Any) -> list:
    """The variables ``optimizer.build()`` was given: what Keras' ``optimizer.apply(grads)`` applies
    the gradients to when no variables are passed. Without Keras' private list there is no public
    equivalent, and the error says to pass them (``apply_gradients`` always does)."""
    name = _TRAINABLE_VARIABLES
    variables = getattr(optimizer, name, _MISSING) if name is not None else _MISSING
    if variables is _MISSING:
        raise ConfigError("this Keras optimizer does not say which variables it was built for: pass them, "
                          "optimizer.apply(grads, trainable_variables) or "
                          "optimizer.apply_gradients(zip(grads, variables))")
    return list(variables)


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile. TensorFlow has no public query for it:
    without its private module the answer is False (a collective traced under XLA then fails in
    XLA's compiler instead of raising the ConfigError that names the fix)."""
    name = _CONTROL_FLOW_UTIL
    if name is None:
        return False
    try:
        control_flow_util = importlib.import_module(name)
        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # noqa: BLE001 - the private API moved or changed: assume not
        return False


def batch_norm_reduction_axes(layer: keras.layers.BatchNormalization, inputs: Any) -> list[int]:
    """The axes a built BatchNormalization layer reduces ``inputs`` over: all but ``layer.axis``
    (the fallback computes them so from the public ``axis`` and the inputs' rank)."""
    name = _BN_REDUCTION_AXES
    axes = getattr(layer, name, None) if name is not None else None
    if axes is not None:
        return list(axes)
    axes = list(range(len(inputs.shape)))
    del axes[layer.axis]
    return axes


def batch_norm_moments_hook() -> bool:
    """True when ``keras.layers.BatchNormalization`` takes its training moments from the method
    SyncBatchNormalization overrides; without it SyncBatchNormalization cannot work (it would
    normalise with this rank's moments only), and refuses to be built."""
    name = _BN_MOMENTS
    return name is not None and callable(getattr(keras.layers.BatchNormalization, name, None))
