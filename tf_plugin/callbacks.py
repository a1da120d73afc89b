"""Keras 3 callbacks with Horovod's names and semantics (``horovod.tensorflow.keras.callbacks``).

* :class:`BroadcastGlobalVariablesCallback`: root's model and optimizer variables on every rank.
* :class:`MetricAverageCallback`: epoch metrics averaged over ranks (put it before callbacks that
  read the logs: checkpointing, early stopping, the progress bar's history).
* :class:`LearningRateScheduleCallback`, :class:`LearningRateWarmupCallback`: Horovod's
  multiplier schedule and the gradual warm-up of Goyal et al. (lr/size -> lr over N epochs).

The learning rate and the momentum correction act on *variables* (the optimizer's learning-rate
variable and momentum slots), never on Python attributes, so they reach the ``train_step`` that
Keras traced once.
"""
from __future__ import annotations

from typing import Callable

import keras
import numpy as np

from hvd_commopt import runtime

from ._compat import learning_rate_variable
from .functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` to all ranks.

    Keras 3 builds the model and the optimizer before ``on_train_begin``, so the broadcast happens
    there and every rank starts the first step from identical weights and optimizer state
    (Horovod broadcast after the first batch, when TF1/Keras 2 optimizers created their slots; we
    fall back to that when the model is not built at ``on_train_begin``).
    """

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def _broadcast(self) -> bool:
        model = self.model
        if not getattr(model, "built", False):
            return False
        broadcast_variables(model.variables, root_rank=self.root_rank, name="broadcast_model_variables")
        opt = getattr(model, "optimizer", None)
        if opt is not None and getattr(opt, "built", False):
            broadcast_variables(opt.variables, root_rank=self.root_rank, name="broadcast_optimizer_variables")
        self.broadcast_done = True
        return True

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Average every numeric value of the epoch logs (metrics and validation metrics) over ranks.

    One fused allreduce per epoch, in sorted key order (identical on every rank).
    """

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        comm = runtime.communicator()
        keys = sorted(k for k, v in logs.items() if np.isscalar(v) or np.ndim(np.asarray(v)) == 0)
        keys = [k for k in keys if np.issubdtype(np.asarray(logs[k]).dtype, np.number)]
        if comm.size == 1 or not keys:
            return
        all_keys = comm.allgather_object(keys, name="metric_average.keys")
        if any(k != keys for k in all_keys):
            raise ValueError(f"MetricAverageCallback: ranks report different metrics: {all_keys}")
        vals = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        vals = comm.allreduce_(vals, "sum", "metric_average") / comm.size
        for k, v in zip(keys, vals):
            logs[k] = float(v)


def _lr_variable(optimizer):
    lr = learning_rate_variable(optimizer)
    if lr is None:
        raise ValueError("the learning-rate callbacks need an optimizer created with a float learning_rate "
                         "(a Keras variable), not a LearningRateSchedule")
    return lr


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``.

    Args:
        initial_lr: the reference learning rate (usually the base lr times ``hco.size()``).
        multiplier: a constant, or a function of the epoch (fractional when not ``staircase``).
        start_epoch, end_epoch: the half-open epoch range where the schedule applies.
        staircase: adjust once per epoch (True) or every batch with a fractional epoch (False).
        momentum_correction: when the lr changes, scale the momentum of SGD by new/old for that
            step (Goyal et al.); done by rescaling the velocity slots, which is the same update
            for SGD (exact without Nesterov) and reaches the traced train_step.
        steps_per_epoch: batches per epoch; default: from ``fit``'s parameters.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda _epoch, m=float(multiplier): m)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError("steps_per_epoch could not be inferred from fit(); pass steps_per_epoch=")

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        opt = self.model.optimizer
        var = _lr_variable(opt)
        old = float(np.asarray(var.numpy() if hasattr(var, "numpy") else var))
        new = self.initial_lr * float(self.multiplier(epoch))
        var.assign(new)
        if self.momentum_correction and old > 0 and new != old and float(getattr(opt, "momentum", 0.0) or 0.0) > 0:
            for m in getattr(opt, "momentums", []) or []:
                m.assign(m * (new / old))

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self._active(self.current_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(self.current_epoch)
        else:
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(_lr_variable(self.model.optimizer).numpy()))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up (Goyal et al., 2017): lr goes from ``initial_lr / size`` to ``initial_lr``
    over ``warmup_epochs`` epochs, adjusted every batch (Horovod's ``LearningRateWarmupCallback``).

    ``multiplier(epoch) = (e * (size - 1) / warmup_epochs + 1) / size`` with
    ``e = epoch + 1/steps_per_epoch`` (so the last warm-up batch runs at ``initial_lr``).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        def multiplier(epoch: float) -> float:
            # Horovod's shift: the last batch of the warm-up reaches initial_lr exactly.
            epoch += 1.0 / self.steps_per_epoch
            size = runtime.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime.rank() == 0:
            lr = float(np.asarray(_lr_variable(self.model.optimizer).numpy()))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")
