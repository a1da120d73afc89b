"""Horovod's ``horovod.tensorflow.util`` helpers that user code imports."""
from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly() -> bool:
    """True outside ``tf.function`` / graph mode (Horovod's helper of the same name)."""
    return tf.executing_eagerly()
