"""TensorFlow side of the step: the :class:`~hvd_commopt.host.ScheduleHost` of the Keras wrapper
(see :mod:`hvd_commopt.host` for the division of labour; this mirrors ``torch_plugin.host``).

The host's one substantial primitive is :meth:`KerasScheduleHost.apply_optimizer`: "run the
user's wrapped Keras optimizer once on these weights with these gradients".

* On the **model's own weights** the run is *deferred*: the host records the gradients, and the
  wrapper applies them with the wrapped optimizer right after the core's step returns, inside the
  traced ``train_step`` when ``model.fit`` traced it (one in-graph ``apply``, as fast as the plain
  optimizer). Anything later in the same step that reads or writes the weights (model
  averaging, a replica update) first flushes the recorded update eagerly, so the order of
  operations is exactly the scheduler's.
* On the **global replica** (delayed schedules) it assigns the replica's values into the model's
  variables for the duration of the wrapped ``apply``, reads the result back into the replica and
  restores the model's values. The optimizer's slots (momentum, Adam moments), keyed by
  variable, are therefore the replica's optimizer state, exactly as in the PyTorch host. TF
  variables cannot swap buffers as ``p.data`` does, so this costs two copies of the weights.

All of it runs eagerly: from eager code, or inside the one ``tf.py_function`` per step that the
Keras wrapper inserts into a traced ``train_step`` (see :mod:`tf_plugin.bridge`); the replica,
the local optimizer's buffers and the step counter live in the core's scheduler, never in values
captured at trace time.
"""
from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from hvd_commopt.host import ADAPTIVE

from ._compat import learning_rate_variable
from .pack_buffer import value_of as _t

__all__ = ["KerasScheduleHost", "adaptive_optimizers"]


def adaptive_optimizers() -> tuple[type, ...]:
    """Keras' optimizers that divide by a per-coordinate second moment (AdamW is an Adam)."""
    o = keras.optimizers
    return (o.Adam, o.AdamW, o.Nadam, o.Adamax, o.Adagrad, o.RMSprop, o.Adadelta, o.Adafactor)


def _snapshot(v) -> tf.Tensor:
    """The value of a tf.Variable or a Keras 3 Variable (which has no ``read_value``)."""
    return tf.identity(tf.convert_to_tensor(v))


class KerasScheduleHost:
    """A wrapped Keras optimizer and its named variables, as the core schedulers see them.

    Args:
        optimizer: the wrapped optimizer (its ``_hco_base.apply`` is U_g).
        names: registered names, aligned with ``variables``.
        variables: the model variables the optimizer updates.
    """

    holds_weights = True

    def __init__(self, optimizer: Any, names: Sequence[str], variables: Sequence[Any]):
        self.opt = optimizer
        self.names = list(names)
        self.vars = dict(zip(self.names, variables))
        self._grads: dict[str, Any] = {n: None for n in self.names}
        self._deferred: dict[str, Any] | None = None  # a model update to apply after the step

    # -- the deferred model update ------------------------------------------------------------
    def take_deferred(self) -> dict[str, Any] | None:
        """The model update recorded in this step (gradients by name), or None; the wrapper
        applies it with the wrapped optimizer."""
        out, self._deferred = self._deferred, None
        return out

    def _flush(self) -> None:
        if self._deferred is not None:
            grads, self._deferred = self._deferred, None
            self._apply(grads, None, None)

    # -- ScheduleHost ------------------------------------------------------------------------
    def set_grads(self, grads: dict[str, Any]) -> None:
        """This step's local gradients g_i(t) (called by the wrapper before the step)."""
        self._grads = dict(grads)

    def grads(self) -> dict[str, Any]:
        return dict(self._grads)

    def weights(self) -> dict[str, tf.Tensor]:
        self._flush()
        return {n: tf.convert_to_tensor(v) for n, v in self.vars.items()}

    def assign(self, name: str, value: Any) -> None:
        self._flush()
        v = self.vars[name]
        if value is v:
            return
        v.assign(tf.reshape(tf.cast(_t(value), v.dtype), v.shape))

    def swap_weights(self, new: dict[str, Any]) -> dict[str, Any]:
        self._flush()
        old = {n: _snapshot(v) for n, v in self.vars.items()}
        for n, v in self.vars.items():
            v.assign(tf.reshape(tf.cast(_t(new[n]), v.dtype), v.shape))
        return old

    def _lr_var(self):
        return learning_rate_variable(self.opt)

    def hyper(self) -> dict:
        lr = self._lr_var()
        return {} if lr is None else {"learning_rate": float(np.asarray(lr.numpy()))}

    def optimizer_family(self) -> str:
        """:data:`~hvd_commopt.host.ADAPTIVE` for Keras' optimizers with a per-coordinate second
        moment (docs/adaptive-optimizers.md), "sgd" for ``keras.optimizers.SGD``, else "other"."""
        if isinstance(self.opt, adaptive_optimizers()):
            return ADAPTIVE
        return "sgd" if isinstance(self.opt, keras.optimizers.SGD) else "other"

    def param_hyper(self, name: str, key: str, default: float | None = None) -> float | None:
        if key == "lr":
            return float(np.asarray(tf.convert_to_tensor(self.opt.learning_rate).numpy()))
        if key == "momentum":
            return float(getattr(self.opt, "momentum", default or 0.0) or 0.0)
        if key == "nesterov":
            return bool(getattr(self.opt, "nesterov", default or False))
        # Keras' weight_decay is decoupled (w -= lr*wd*w inside apply) while the core's local
        # update adds L2 to the gradient (torch's convention): not the same update, so the
        # local update does not take it; set the schedule's local_weight_decay= explicitly.
        return default

    def apply_optimizer(self, grads: dict | None = None, weights: dict | None = None, hyper: Any = None,
                        closure=None) -> None:
        if closure is not None:
            raise ValueError("Keras optimizers take no closure")
        use = grads if grads is not None else self._grads
        if weights is None and not hyper:  # the model's own update: deferred (module docstring)
            self._flush()
            self._deferred = dict(use)
            return None
        self._flush()
        self._apply(use, weights, hyper)
        return None

    def _apply(self, use: dict, weights: dict | None, hyper: Any) -> None:
        names, opt = self.names, self.opt
        variables = [self.vars[n] for n in names]
        g = [None if use.get(n) is None else tf.reshape(tf.cast(_t(use[n]), self.vars[n].dtype), self.vars[n].shape)
             for n in names]
        saved = None
        saved_lr = None
        lr = self._lr_var()
        try:
            if weights is not None:
                saved = [_snapshot(v) for v in variables]
                for n, v in zip(names, variables):
                    v.assign(tf.reshape(tf.cast(_t(weights[n]), v.dtype), v.shape))
            if hyper and lr is not None and "learning_rate" in hyper:
                saved_lr = _snapshot(lr)
                lr.assign(hyper["learning_rate"])
            opt._hco_base.apply(opt, g, variables)
            if weights is not None:
                for n, v in zip(names, variables):
                    weights[n] = _snapshot(v)  # the replica dict is updated "in place"
        finally:
            if saved_lr is not None:
                lr.assign(saved_lr)
            if saved is not None:
                for v, s in zip(variables, saved):
                    v.assign(s)
