"""The TensorFlow face of the core's cross-rank errors.

Horovod's TensorFlow ops fail with ``tf.errors.FailedPreconditionError`` when ranks pass
mismatched tensors (shapes, dtypes, root ranks) to a collective; code written for Horovod
catches that class. :class:`CollectiveMismatchError` is both the core's
:class:`~hvd_commopt.errors.RankMismatchError` and that TF error, and :func:`tf_errors` converts
the core's error into it at the adapter's boundary. Likewise a bad argument of a collective
(the core's :class:`~hvd_commopt.errors.ConfigError`, e.g. alltoall splits that do not add up)
becomes :class:`CollectiveArgumentError`, also a ``tf.errors.InvalidArgumentError`` as in Horovod.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf

from hvd_commopt.errors import ConfigError, RankMismatchError
from hvd_commopt.negotiate import TensorMismatchError

__all__ = ["CollectiveMismatchError", "CollectiveArgumentError", "tf_errors"]


class CollectiveMismatchError(TensorMismatchError, tf.errors.FailedPreconditionError):
    """Ranks passed mismatched tensors to a collective: the core's TensorMismatchError (a
    RankMismatchError and a ConfigError) and ``tf.errors.FailedPreconditionError``."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __str__(self) -> str:
        return self.message


class CollectiveArgumentError(ConfigError, tf.errors.InvalidArgumentError):
    """A bad argument of a collective (``tf.errors.InvalidArgumentError``)."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def tf_errors() -> Iterator[None]:
    """Re-raise the core's RankMismatchError as :class:`CollectiveMismatchError` and its
    ConfigError as :class:`CollectiveArgumentError`."""
    try:
        yield
    except (CollectiveMismatchError, CollectiveArgumentError):
        raise
    except RankMismatchError as e:
        raise CollectiveMismatchError(str(e)) from e
    except ConfigError as e:
        raise CollectiveArgumentError(str(e)) from e
