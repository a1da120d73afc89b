"""Tensor collectives with Horovod's semantics, written once for both adapters.

The adapters' ``allreduce`` / ``allgather`` / ``broadcast`` / ``broadcast_parameters`` only
flatten their framework's tensors, call these, and reshape the result (and, in TensorFlow, wrap
the call for ``tf.function``). So both frameworks give the same answers, the same errors, and
the same compression rules: ``allreduce(t, compression=fp16)`` goes through the same
:class:`~hvd_commopt.reduce.dense.DenseAllreduce` as the gradients, which divides by P before
the half-precision sum so it cannot overflow.

Every collective first checks its metadata across ranks (:mod:`hvd_commopt.negotiate`), so a
shape, dtype or root that differs raises :class:`~hvd_commopt.negotiate.TensorMismatchError` on
every rank instead of crashing the backend. Each has an ``_async`` form that returns a
:class:`Work` once its communication is queued (Horovod's ``*_async`` + ``synchronize``); the
plain form waits for it.

All tensors here are flat (1-D) framework tensors handled through the adapter's
:class:`~hvd_commopt.tensor_ops.TensorOps`; ``shape`` gives the user's shape for the checks.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from .buckets import Bucket, TensorSpec
from .comm.communicator import Communicator
from .comm.handle import Handle
from .compress.base import Compressor
from .compress.user import UserCompressor, as_user_compressor
from .engine.specs import verify_same_tensors
from .errors import ConfigError
from .matching import matcher
from .negotiate import Request
from .reduce.base import Adasum, Average, Max, Min, Product, ReduceContext, RoundInfo, Sum, check_tensor_op
from .reduce.dense import DenseAllreduce
from .tensor_ops import TensorOps

__all__ = ["Work", "deferred", "allreduce", "allreduce_async", "allgather", "allgather_async", "broadcast", "broadcast_async",
           "broadcast_tensors", "grouped_allreduce_async", "grouped_allgather_async", "barrier", "allgather_object",
           "resolve_op"]

Tensor = Any

_FLOATING = ("float64", "float32", "float16", "bfloat16")
_HALF = ("float16", "bfloat16")
_SMALL_INT = ("int8", "uint8", "int16")
_BACKEND_OP = {Min: "min", Max: "max", Product: "prod"}


class Work:
    """A started collective: :meth:`wait` gives its result (computed once), :meth:`done` polls
    (``ready``, when given, instead of the handles)."""

    def __init__(self, finish: Callable[[], Any], handles: Sequence[Any] = (), ready: Callable[[], bool] | None = None):
        self._finish, self._handles, self._ready = finish, tuple(handles), ready
        self._result, self._finished = None, False

    def done(self) -> bool:
        if self._finished:
            return True
        return self._ready() if self._ready is not None else all(h.poll() for h in self._handles)

    def wait(self) -> Any:
        if not self._finished:
            self._result, self._finished = self._finish(), True
            self._finish = None
        return self._result


def deferred(comm: Communicator, req: Request, payload: Callable[[], Work]) -> Work:
    """Submit ``req`` for matching by name (:mod:`hvd_commopt.matching`) and return at once: once
    every rank has submitted it, its check runs and then ``payload()`` starts the transfer, on the
    progress thread in this call's place in the order, so the caller gets its Work before any
    peer reached the same call (Horovod's ``*_async``, docs/horovod_api.md#async). A size-1
    communicator runs the payload here."""
    if comm.size == 1:
        return payload()
    m = matcher(comm)
    entry = m.submit(req, payload)
    handle = comm.defer(req.kind, req.name, lambda: m.run_until(entry))

    def ready() -> bool:
        if not handle.poll():
            return False
        try:
            return handle.wait(0).done()
        except Exception:  # noqa: BLE001 - failed: done, and wait() raises it
            return True
    return Work(lambda: comm.wait(handle).wait(), (handle,), ready)


def resolve_op(average: bool | None, op: str | None) -> str:
    """The op of an adapter's collective from Horovod's two arguments: ``op`` (``hco.Average``,
    ``hco.Sum``, ...), or the old ``average`` flag (True: Average, False: Sum), Average when
    neither is given. Both given is refused, as Horovod refuses it."""
    if op is None:
        return Average if average is None or average else Sum
    if average is not None:
        raise ConfigError("give either average= (Horovod's old flag) or op=, not both")
    return op


def _shape(ops: TensorOps, flat: Tensor, shape: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(int(d) for d in shape) if shape is not None else (ops.numel(flat),)


def _compressor(compression: Any) -> Compressor | None:
    if compression is None or isinstance(compression, Compressor):
        return compression
    user = as_user_compressor(compression)
    if user is not None:
        return user
    raise ConfigError(f"the tensor allreduce takes a dense compression (Compression.none/fp16/bf16, or an object "
                      f"with Horovod's compress(tensor)/decompress(tensor, ctx)), got {compression!r}; sparse "
                      f"compression is for DistributedOptimizer's gradients")


def _int_scale(ops: TensorOps, t: Tensor, factor: float, dtype: str) -> Tensor:
    """Scale an integer tensor as Horovod does: in float64, then truncated back to ``dtype``."""
    return ops.cast(ops.scale(ops.cast(t, "float64"), float(factor)), dtype) if factor != 1.0 else t


def allreduce_async(comm: Communicator, ops: TensorOps, flat: Tensor, *, shape: Sequence[int] | None = None,
                    op: str = Average, compression: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, name: str = "allreduce") -> Work:
    """Start the reduction of ``flat`` over all ranks (``flat`` may be overwritten).

    op: Average (default), Sum, Min, Max, Product, Adasum. Integer tensors are summed exactly,
    averaged by division rounded toward zero, and scaled in float64 then truncated back (Horovod's rule);
    uint16 sums as an integer (modulo 2**16); bool reduces in int32 and is cast back;
    float16/bfloat16 Min/Max/Product go through float32.
    """
    op = check_tensor_op(op)
    comp = _compressor(compression)
    dtype = ops.dtype_name(flat)
    req = Request("allreduce", name, dtype, _shape(ops, flat, shape), op=op,
                  args=(float(prescale_factor), float(postscale_factor), _picklable(comp)))

    def start() -> Work:
        return _allreduce_payload(comm, ops, flat, dtype, op, comp, float(prescale_factor), float(postscale_factor),
                                  name)
    return deferred(comm, req, start)


def _picklable(comp: Compressor | None) -> Any:
    """What a joined rank needs to mirror the compression: our compressors; a user's is not
    sent (it may not pickle; a joined rank then takes part uncompressed)."""
    return None if isinstance(comp, UserCompressor) else comp


def _allreduce_payload(comm: Communicator, ops: TensorOps, flat: Tensor, dtype: str, op: str,
                       comp: Compressor | None, pre: float, post: float, name: str) -> Work:
    if op == Adasum:
        return _adasum(comm, ops, flat, dtype, comp, pre, post, name)
    if dtype in ("uint16", "bool") or (dtype in _SMALL_INT and comm.buffer_kind == "native"):
        # uint16: a real one, not bfloat16 bits (which the host backends carry as uint16): reduce
        # exactly in int32 and wrap back. bool: MPI has no arithmetic on it; in int32, Sum/Max
        # give "any" and Min/Product "all" once cast back. Gloo reduces no 8/16-bit integers.
        inner = _allreduce_payload(comm, ops, ops.cast(flat, "int32"), "int32", op, None, pre, post, name)
        return Work(lambda: ops.cast(inner.wait(), dtype), inner._handles)
    if op in _BACKEND_OP:
        if dtype in _HALF:  # the backends' half-precision path only sums; min/max exact in float32
            inner = _allreduce_payload(comm, ops, ops.cast(flat, "float32"), "float32", op, None, pre, post, name)
            return Work(lambda: ops.cast(inner.wait(), dtype), inner._handles)
        floating = dtype in _FLOATING
        flat = (ops.scale(flat, pre) if pre != 1.0 else flat) if floating else _int_scale(ops, flat, pre, dtype)
        handles: tuple[Handle, ...]
        if comm.size == 1:
            handles, get = (), (lambda: flat)
        else:
            h = comm.allreduce_tensor_async(ops, flat, _BACKEND_OP[op], name)
            handles, get = (h,), (lambda: comm.wait(h))

        def finish_elementwise() -> Tensor:
            out = get()
            return (ops.scale(out, post) if post != 1.0 else out) if floating else _int_scale(ops, out, post, dtype)
        return Work(finish_elementwise, handles)
    if dtype not in _FLOATING:
        flat = _int_scale(ops, flat, pre, dtype)
        if comm.size == 1:
            handles, get = (), (lambda: flat)
        else:
            h = comm.allreduce_tensor_async(ops, flat, "sum", name)
            handles, get = (h,), (lambda: comm.wait(h))

        def finish_int() -> Tensor:
            out = get()
            if op == Average and comm.size > 1:
                out = ops.trunc_divide(out, comm.size)
            return _int_scale(ops, out, post, dtype)
        return Work(finish_int, handles)
    if dtype in _HALF and (pre != 1.0 or post != 1.0):  # the user's factors in float32, as Horovod on CPU
        flat = _half_scale(ops, flat, pre, dtype)
        inner = _allreduce_payload(comm, ops, flat, dtype, op, comp, 1.0, 1.0, name)
        return Work(lambda: _half_scale(ops, inner.wait(), post, dtype), inner._handles)
    scale_after = post / comm.size if op == Average else post
    ctx = ReduceContext(comm, ops, prescale=pre, postscale=scale_after)
    reducer = DenseAllreduce(comp)
    pending = reducer.start(Bucket.single(name, ops.numel(flat), dtype), RoundInfo(), flat, ctx)
    return Work(lambda: reducer.finish(pending, ctx), pending.handles)


def _half_scale(ops: TensorOps, t: Tensor, factor: float, dtype: str) -> Tensor:
    """Scale a float16/bfloat16 tensor in float32 and round back once (Horovod's CPU rule)."""
    return ops.cast(ops.scale(ops.cast(t, "float32"), float(factor)), dtype) if factor != 1.0 else t


def _adasum(comm: Communicator, ops: TensorOps, flat: Tensor, dtype: str, comp: Compressor | None, pre: float,
            post: float, name: str) -> Work:
    """op=Adasum: the Adasum reducer (reduce/adasum.py) on this one tensor."""
    try:
        from .reduce.adasum import make_adasum_reducer  # noqa: PLC0415 - optional module
    except ImportError as e:
        raise ConfigError(f"op=Adasum is not available in this build ({e})") from e
    if dtype not in _FLOATING:
        raise ConfigError(f"op=Adasum combines floating tensors, got {dtype} (use op=Sum for integers)")
    ctx = ReduceContext(comm, ops, prescale=pre, postscale=post)
    reducer = make_adasum_reducer(comp)
    pending = reducer.start(Bucket.single(name, ops.numel(flat), dtype), RoundInfo(), flat, ctx)
    return Work(lambda: reducer.finish(pending, ctx), pending.handles)


def allreduce(comm: Communicator, ops: TensorOps, flat: Tensor, **kw: Any) -> Tensor:
    """:func:`allreduce_async` and wait."""
    return allreduce_async(comm, ops, flat, **kw).wait()


def grouped_allreduce_async(comm: Communicator, ops: TensorOps, flats: Sequence[Tensor],
                            shapes: Sequence[Sequence[int]], *, op: str = Average, compression: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            name: str = "grouped_allreduce") -> Work:
    """Allreduce of several tensors as one operation: one check, one fused reduction per dtype;
    ``wait()`` gives the reduced flats in the order given."""
    op = check_tensor_op(op)
    comp = _compressor(compression)
    dtypes = tuple(ops.dtype_name(f) for f in flats)
    req = Request("grouped_allreduce", name, dtypes, tuple(tuple(s) for s in shapes), op=op,
                  args=(float(prescale_factor), float(postscale_factor), _picklable(comp)))

    def start() -> Work:
        return _grouped_payload(comm, ops, list(flats), dtypes, op, comp, float(prescale_factor),
                                float(postscale_factor), name)
    return deferred(comm, req, start)


def _grouped_payload(comm: Communicator, ops: TensorOps, flats: list, dtypes: tuple, op: str,
                     comp: Compressor | None, pre: float, post: float, name: str) -> Work:
    groups: dict[str, list[int]] = {}
    for i, d in enumerate(dtypes):
        groups.setdefault(d, []).append(i)
    works = []
    for dtype, idx in sorted(groups.items()):
        fused = ops.cat([flats[i] for i in idx])
        works.append((idx, _allreduce_payload(comm, ops, fused, dtype, op, comp, pre, post, f"{name}.{dtype}")))

    def finish() -> list:
        out: list = [None] * len(flats)
        for idx, w in works:
            red, off = w.wait(), 0
            for i in idx:
                n = ops.numel(flats[i])
                out[i] = ops.slice(red, off, off + n)
                off += n
        return out
    return Work(finish, [h for _, w in works for h in w._handles])


def allgather_async(comm: Communicator, ops: TensorOps, flat: Tensor, rest: tuple[int, ...],
                    name: str = "allgather") -> Work:
    """Start gathering every rank's ``flat`` in rank order. ``flat`` holds a tensor of shape
    ``(d0,) + rest``; ``d0`` may differ across ranks, ``rest`` and the dtype may not (else
    TensorMismatchError on every rank). ``wait()`` gives (the flat concatenation, per-rank d0)."""
    dtype = ops.dtype_name(flat)
    row = math.prod(rest)
    d0 = ops.numel(flat) // row if row else 0
    if comm.size == 1:
        return Work(lambda: (flat, [d0]))

    def start() -> Work:
        h = comm.allgather_tensor_async(ops, flat, name)

        def finish() -> tuple[Tensor, list[int]]:
            out, counts = comm.wait(h)
            return out, [c // row if row else 0 for c in counts]
        return Work(finish, (h,))
    return deferred(comm, Request("allgather", name, dtype, (d0,) + tuple(rest)), start)


def allgather(comm: Communicator, ops: TensorOps, flat: Tensor, rest: tuple[int, ...], name: str = "allgather") -> Tensor:
    """Every rank's ``flat`` concatenated in rank order (see :func:`allgather_async`)."""
    return allgather_async(comm, ops, flat, rest, name).wait()[0]


def grouped_allgather_async(comm: Communicator, ops: TensorOps, flats: Sequence[Tensor],
                            rests: Sequence[tuple[int, ...]], name: str = "grouped_allgather") -> Work:
    """Allgather of several tensors with one check; ``wait()`` gives a list of (the flat
    concatenation, per-rank d0) per tensor."""
    dtypes = tuple(ops.dtype_name(f) for f in flats)
    rows = [max(math.prod(r), 1) for r in rests]
    shapes = tuple((ops.numel(f) // n,) + tuple(r) for f, r, n in zip(flats, rests, rows))
    if comm.size == 1:
        return Work(lambda: [(f, [s[0]]) for f, s in zip(flats, shapes)])

    def start() -> Work:
        hs = [comm.allgather_tensor_async(ops, f, f"{name}.{i}") for i, f in enumerate(flats)]

        def finish() -> list:
            out = []
            for h, n in zip(hs, rows):
                flat, counts = comm.wait(h)
                out.append((flat, [c // n for c in counts]))
            return out
        return Work(finish, hs)
    return deferred(comm, Request("grouped_allgather", name, dtypes, shapes), start)


def broadcast_async(comm: Communicator, ops: TensorOps, flat: Tensor, root: int = 0, name: str = "broadcast",
                    shape: Sequence[int] | None = None) -> Work:
    """Start overwriting ``flat`` with root's (``flat`` may be overwritten); ranks must agree on
    the shape, dtype and root."""
    comm.check_rank(root, "root")
    if comm.size == 1:
        return Work(lambda: flat)
    req = Request("broadcast", name, ops.dtype_name(flat), _shape(ops, flat, shape), root=root)

    def start() -> Work:
        h = comm.broadcast_tensor_async(ops, flat, root, name)
        return Work(lambda: comm.wait(h), (h,))
    return deferred(comm, req, start)


def broadcast(comm: Communicator, ops: TensorOps, flat: Tensor, root: int = 0, name: str = "broadcast",
              shape: Sequence[int] | None = None) -> Tensor:
    """Root's ``flat`` on every rank (``flat`` may be overwritten)."""
    return broadcast_async(comm, ops, flat, root, name, shape).wait()


def barrier(comm: Communicator) -> None:
    """Wait until every rank (of ``comm``) calls barrier; the negotiation round is the barrier."""
    deferred(comm, Request("barrier", "barrier"), lambda: Work(lambda: None)).wait()


def allgather_object(comm: Communicator, obj: Any, name: str = "allgather_object") -> list[Any]:
    """Every rank's picklable ``obj`` in rank order (checked like the tensor collectives, so it
    fails cleanly against a different collective or a joined rank)."""
    def payload() -> Work:
        out = comm.allgather_object(obj, name)
        return Work(lambda: out)
    return deferred(comm, Request("allgather_object", name), payload).wait()


def broadcast_tensors(comm: Communicator, ops: TensorOps, specs: Sequence[TensorSpec], flats: Sequence[Tensor],
                      root: int = 0, what: str = "set of tensors to broadcast", label: str = "broadcast") -> list[Tensor]:
    """Root's values of many tensors, one fused broadcast per (dtype, device); flat results in
    the order given. The names, shapes and dtypes are checked across ranks first, so a model
    that differs fails with a clear :class:`~hvd_commopt.errors.RankMismatchError` instead of a
    mismatched broadcast."""
    verify_same_tensors(comm, list(specs), what=what)
    comm.check_rank(root, "root")
    if comm.size == 1:
        return list(flats)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, f in enumerate(flats):
        groups.setdefault((ops.dtype_name(f), ops.device_name(f)), []).append(i)
    out: list[Tensor] = [None] * len(flats)
    for (dtype, _dev), idx in sorted(groups.items()):
        fused = ops.cat([flats[i] for i in idx])
        fused = comm.wait(comm.broadcast_tensor_async(ops, fused, root, f"{label}.{dtype}"))
        off = 0
        for i in idx:
            n = ops.numel(flats[i])
            out[i] = ops.slice(fused, off, off + n)
            off += n
    return out
