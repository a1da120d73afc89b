"""Tensor collectives and broadcasts for TensorFlow (Horovod's names and argument names).

Each works eagerly and inside ``tf.function`` (as one ``tf.py_function``; see
:mod:`tf_plugin.bridge`). Collectives go through the process communicator that ``init()`` made;
with the MPI backend the tensors cross to host memory (``TFOps.to_numpy``/``from_numpy``).
"""
from __future__ import annotations

import pickle
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from hvd_commopt import runtime
from hvd_commopt.engine.specs import TensorSpec, verify_same_tensors
from hvd_commopt.errors import ConfigError

from .bridge import host_call
from .ops import TFOps
from .reducer import Average, Sum

__all__ = ["allreduce", "allgather", "broadcast", "broadcast_variables", "broadcast_object"]

_ops = TFOps()


def _comm(communicator):
    return communicator if communicator is not None else runtime.communicator()


def _to_comm(comm, t):
    return _ops.to_numpy(t) if comm.buffer_kind == "numpy" else t


def _from_comm(comm, buf, like):
    return _ops.from_numpy(buf, like=like) if comm.buffer_kind == "numpy" else buf


def allreduce(tensor, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression=None, op: str | None = None, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, communicator=None) -> tf.Tensor:
    """Average (default) or sum of ``tensor`` over all ranks, as a new tensor.

    Args:
        tensor: a dense tensor or ``tf.IndexedSlices`` (reduced densely).
        average: Horovod's old flag (``op`` wins when both are given).
        compression: ``Compression.fp16``/``bf16`` cast for the wire (dense compressors only).
        op: ``hco.Average`` or ``hco.Sum``.
        prescale_factor, postscale_factor: multiply before / after the sum.
        communicator: a core Communicator (default: the one ``init()`` made); every function
            here takes it, for in-process ranks in tests and for sub-communicators.
    """
    if op is None:
        op = Average if average is None or average else Sum
    if op not in (Average, Sum):
        raise ConfigError(f"op must be hco.Average or hco.Sum, got {op!r}")
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tf.convert_to_tensor(tensor)
    tensor = tf.convert_to_tensor(tensor)
    label = name or "allreduce"

    def run(t):
        comm = _comm(communicator)
        flat = _ops.flatten(t)
        if prescale_factor != 1.0:
            flat = _ops.scale(flat, prescale_factor)
        payload, ctx = (flat, None) if compression is None else compression.compress(_ops, flat)
        if comm.size > 1:
            buf = comm.allreduce_(_to_comm(comm, payload), "sum", label)
            payload = _from_comm(comm, buf, payload)
        out = payload if compression is None else compression.decompress(_ops, payload, ctx)
        post = postscale_factor / (comm.size if op == Average else 1)
        if post != 1.0:
            out = _ops.scale(out, post) if out.dtype.is_floating else out // int(round(1 / post))
        return [tf.reshape(out, tf.shape(t))]

    return host_call(run, [tensor], [tensor.dtype], [tensor.shape], label)[0]


def allgather(tensor, name: str | None = None, communicator=None) -> tf.Tensor:
    """Concatenation of every rank's tensor along dim 0 (dim 0 may differ; the others must not)."""
    tensor = tf.convert_to_tensor(tensor)
    label = name or "allgather"
    if tensor.shape.rank is None:
        raise ConfigError("allgather needs a tensor of known rank")
    rest_static = tensor.shape[1:] if tensor.shape.rank > 0 else tf.TensorShape([])

    def run(t):
        comm = _comm(communicator)
        rest = tuple(int(d) for d in t.shape[1:]) if t.shape.rank > 0 else ()
        if comm.size == 1:
            return [t]
        shapes = comm.allgather_object(rest, name=f"{label}.shape")
        if any(s != rest for s in shapes):
            raise ConfigError(f"allgather: tensors must agree beyond dim 0; got {shapes}")
        out, _ = comm.allgather(_to_comm(comm, _ops.flatten(t)), label)
        out = _from_comm(comm, out, t)
        return [tf.reshape(out, (-1,) + rest) if t.shape.rank > 0 else out]

    out_shape = tf.TensorShape([None]).concatenate(rest_static) if tensor.shape.rank > 0 else tf.TensorShape([None])
    return host_call(run, [tensor], [tensor.dtype], [out_shape], label)[0]


def broadcast(tensor, root_rank: int = 0, name: str | None = None, communicator=None) -> tf.Tensor:
    """Root's ``tensor`` on every rank, as a new tensor."""
    tensor = tf.convert_to_tensor(tensor)
    label = name or "broadcast"

    def run(t):
        comm = _comm(communicator)
        if comm.size == 1:
            return [t]
        buf = comm.broadcast_(_to_comm(comm, _ops.flatten(t)), root_rank, label)
        return [tf.reshape(_from_comm(comm, buf, t), tf.shape(t))]

    return host_call(run, [tensor], [tensor.dtype], [tensor.shape], label)[0]


def _broadcast_values(comm, values: Sequence[Any], root_rank: int, names: Sequence[str], label: str) -> list:
    """Root's values, one fused broadcast per dtype (eager tensors in, eager tensors out)."""
    verify_same_tensors(comm, [TensorSpec(n, tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name)
                               for n, v in zip(names, values)], what="set of variables to broadcast")
    if comm.size == 1:
        return list(values)
    out: list = [None] * len(values)
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(tf.as_dtype(v.dtype).name, []).append(i)
    for dtype, idx in sorted(groups.items()):
        hosts = [_ops.to_numpy(values[i]).reshape(-1) for i in idx]
        flat = np.concatenate(hosts) if hosts else np.zeros(0)
        flat = comm.broadcast_(flat, root_rank, f"{label}.{dtype}")
        off = 0
        for i, h in zip(idx, hosts):
            part = flat[off:off + h.size]
            off += h.size
            t = _ops.from_numpy(np.ascontiguousarray(part), like=values[i])
            out[i] = tf.reshape(t, values[i].shape)
    return out


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int = 0, name: str | None = None,
                        communicator=None):
    """Assign root's values to ``variables`` on every rank (fused per dtype).

    The names, shapes and dtypes are checked across ranks first, so a model that differs fails
    with :class:`~hvd_commopt.errors.RankMismatchError` instead of a mismatched broadcast.
    Eagerly it returns None; inside ``tf.function`` it returns the group of assign ops.
    """
    variables = list(variables)
    label = name or "broadcast_variables"
    names = [f"{i}:{str(getattr(v, 'name', 'v')).split(':')[0]}" for i, v in enumerate(variables)]
    if not variables:
        return None
    values = [tf.convert_to_tensor(v) for v in variables]

    def run(*vals):
        return _broadcast_values(_comm(communicator), vals, root_rank, names, label)

    new = host_call(run, values, [v.dtype for v in values], [v.shape for v in values], label)
    if _comm(communicator).size == 1 and tf.executing_eagerly():
        return None
    assigns = [v.assign(x) for v, x in zip(variables, new)]
    return None if tf.executing_eagerly() else tf.group(assigns)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, communicator=None) -> Any:
    """Root's picklable Python object on every rank (TF tensors are pickled as their values).

    Eager only: a Python object cannot cross a ``tf.function`` boundary.
    """
    if not tf.executing_eagerly():
        raise ConfigError("broadcast_object runs eagerly only; call it outside tf.function")
    comm = _comm(communicator)
    data = pickle.dumps(obj) if comm.rank == root_rank else None
    data = comm.broadcast_object(data, root_rank, name or "broadcast_object")
    return pickle.loads(data)
