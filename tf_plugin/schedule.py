"""TensorFlow side of the core's schedules (OD/SSD/CD-SGD, CoCoD, local SGD): the update
primitives and the ScheduleHost (see :mod:`hvd_commopt.schedule.base` for the division of labour;
this mirrors ``torch_plugin.schedule``).

The host's one substantial primitive is :meth:`KerasScheduleHost.apply_optimizer`: "run the
user's wrapped Keras optimizer once on these weights with these gradients". To step the *global
replica* instead of the model it assigns the replica's values into the model's variables for the
duration of the wrapped ``apply``, reads the result back into the replica and restores the
model's values. The optimizer's slots (momentum, Adam moments), keyed by variable, are therefore
the replica's optimizer state, exactly as in the PyTorch host, and the global update U_g is the
user's own optimizer whatever it is. TF variables cannot swap buffers as ``p.data`` does, so
this costs two copies of the weights per applied round (assign in, assign back).

All of it runs eagerly: from eager code, or inside the one ``tf.py_function`` per step that the
Keras wrapper inserts into a traced ``train_step`` (see :mod:`tf_plugin.bridge`); the replica,
the local optimizer's buffers and the step counter live in the core's scheduler, never in values
captured at trace time.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from .ops import TF_DTYPES, TFOps, _t

__all__ = ["TFUpdateOps", "KerasScheduleHost"]


def _snapshot(v) -> tf.Tensor:
    """The value of a tf.Variable or a Keras 3 Variable (which has no ``read_value``)."""
    return tf.identity(tf.convert_to_tensor(v))


class TFUpdateOps(TFOps):
    """TFOps plus hvd_commopt.schedule.UpdateOps (functional: new tensors, or assign into a
    ``tf.Variable`` destination)."""

    def copy_(self, dst, src):
        src = _t(src)
        if isinstance(dst, tf.Variable):
            dst.assign(tf.reshape(tf.cast(src, dst.dtype), dst.shape))
            return dst
        dst = _t(dst)
        return tf.identity(tf.reshape(tf.cast(src, dst.dtype), tf.shape(dst)))

    def axpy_(self, y, alpha, x):
        # y + (alpha*x): with alpha = -lr this is bit-identical to Keras SGD's
        # ``variable.assign_sub(lr * g)`` (negation is exact).
        y, x = tf.convert_to_tensor(_t(y)), _t(x)
        return y + tf.constant(alpha, dtype=y.dtype) * x

    def mul(self, a, b):
        return tf.convert_to_tensor(_t(a)) * _t(b)

    def ternarize_(self, r, theta, dtype):
        r = tf.convert_to_tensor(_t(r))
        wire = TF_DTYPES[dtype]
        th = tf.constant(theta, dtype=r.dtype)
        s = tf.cast(r >= th, wire) - tf.cast(r <= -th, wire)
        return r - th * tf.cast(s, r.dtype), s


class KerasScheduleHost:
    """A wrapped Keras optimizer and its named variables, as the core schedulers see them.

    Args:
        optimizer: the wrapped optimizer (its ``_hco_base.apply`` is U_g).
        names: registered names, aligned with ``variables``.
        variables: the model variables the optimizer updates.
    """

    def __init__(self, optimizer: Any, names: Sequence[str], variables: Sequence[Any]):
        self.opt = optimizer
        self.names = list(names)
        self.vars = dict(zip(self.names, variables))
        self._grads: dict[str, Any] = {n: None for n in self.names}

    def set_grads(self, grads: dict[str, Any]) -> None:
        """This step's local gradients g_i(t) (called by the wrapper before ``run_step``)."""
        self._grads = dict(grads)

    # -- ScheduleHost ------------------------------------------------------------------------
    def weights(self) -> dict[str, tf.Tensor]:
        return {n: tf.convert_to_tensor(v) for n, v in self.vars.items()}

    def assign(self, name: str, value: Any) -> None:
        v = self.vars[name]
        if value is v:
            return
        v.assign(tf.reshape(tf.cast(_t(value), v.dtype), v.shape))

    def grads(self) -> dict[str, Any]:
        return dict(self._grads)

    def _lr_var(self):
        lr = getattr(self.opt, "_learning_rate", None)
        return lr if hasattr(lr, "assign") else None

    def hyper(self) -> dict:
        lr = self._lr_var()
        return {} if lr is None else {"learning_rate": float(np.asarray(lr.numpy()))}

    def param_hyper(self, name: str, key: str, default: float | None = None) -> float | None:
        if key == "lr":
            return float(np.asarray(tf.convert_to_tensor(self.opt.learning_rate).numpy()))
        if key == "momentum":
            return float(getattr(self.opt, "momentum", default or 0.0) or 0.0)
        # Keras' weight_decay is decoupled (w -= lr*wd*w inside apply) while the core's local
        # update adds L2 to the gradient (torch's convention): not the same update, so the
        # local update does not take it; set the schedule's local_weight_decay= explicitly.
        return default

    def apply_optimizer(self, grads: dict | None = None, weights: dict | None = None, hyper: Any = None) -> None:
        names, opt = self.names, self.opt
        variables = [self.vars[n] for n in names]
        use = grads if grads is not None else self._grads
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
