"""What the engine communicates, as data: tensor specs and buckets (fusion-buffer layouts).

A :class:`Bucket` is a group of tensors packed into one flat buffer and reduced together. It
is passed to reducers and schedulers as a value: its ``name`` keys every per-bucket state
(error-feedback residuals, DGC memories, the ternary residual of CD-SGD) and names its
collectives, so no layer parses names to find out which bucket a collective belongs to.

:meth:`Bucket.pack` and :meth:`Bucket.views` are the one implementation of "model tensors <->
flat buffer" that both the engine (gradients) and the model-averaging schedules (weights) use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .dtypes import DTYPE_BYTES
from .errors import ConfigError

__all__ = ["TensorSpec", "Bucket", "build_buckets"]

Tensor = Any


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the engine reduces: name, shape and dtype name ("float32", ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"tensor {self.name!r} has dtype {self.dtype!r}, which hvd_commopt cannot "
                              f"communicate; supported: {sorted(DTYPE_BYTES)}")
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Bucket:
    """One fusion buffer's layout (the buffers themselves belong to rounds, engine/rounds.py).

    Attributes:
        index: position in the launch order (identical on every rank).
        name: the bucket's identity: per-bucket state is keyed by it and its collectives are
            named after it (``bucket{index}:{first tensor}[+{more}]`` for engine buckets).
        names: member tensors, in backward order; ``offsets[i]`` is where ``names[i]`` starts.
        shapes: the members' shapes.
        numel: total elements; dtype: the members' common dtype.
        dense: sparse reducers send this bucket whole, uncompressed (its members are the 1-D
            tensors of a group, docs/topk.md#dense-1d); dense reducers ignore it.
    """

    index: int
    name: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: str
    dense: bool = False

    @classmethod
    def of(cls, index: int, members: Sequence[TensorSpec], name: str | None = None,
           dense: bool = False) -> Bucket:
        """A bucket of ``members`` (in that order), named like the engine's buckets by default."""
        if not members:
            raise ConfigError("internal: a bucket needs at least one tensor")
        offsets, off = [], 0
        for s in members:
            offsets.append(off)
            off += s.numel
        if name is None:
            name = f"bucket{index}:{members[0].name}" + (f"+{len(members) - 1}" if len(members) > 1 else "")
        return cls(index, name, tuple(s.name for s in members), tuple(tuple(s.shape) for s in members),
                   tuple(offsets), off, members[0].dtype, bool(dense))

    @classmethod
    def single(cls, name: str, numel: int, dtype: str) -> Bucket:
        """A one-tensor, flat bucket named ``name`` (tensor collectives, tests, benchmarks)."""
        return cls.of(0, [TensorSpec(name, (int(numel),), dtype)], name=name)

    @property
    def first(self) -> str:
        """The first member's name (with one bucket per layer: the layer's tensor)."""
        return self.names[0]

    def member_numel(self, i: int) -> int:
        n = 1
        for d in self.shapes[i]:
            n *= int(d)
        return n

    def pack(self, ops: Any, tensors: Mapping[str, Tensor], flat: Tensor | None = None,
             like: Tensor | None = None) -> Tensor:
        """Copy the members of ``tensors`` into one flat buffer (``flat`` when given, else a new one
        placed like ``like``, default the first member). Returns the buffer (use the result)."""
        if flat is None:
            flat = ops.empty(self.numel, self.dtype, like=tensors[self.first] if like is None else like)
        for name, off in zip(self.names, self.offsets):
            flat = ops.copy_into(flat, off, tensors[name])
        return flat

    def views(self, ops: Any, flat: Tensor) -> dict[str, Tensor]:
        """Per-member views of ``flat`` with the members' original shapes."""
        out = {}
        for i, (name, shape, off) in enumerate(zip(self.names, self.shapes, self.offsets)):
            out[name] = ops.reshape(ops.slice(flat, off, off + self.member_numel(i)), shape)
        return out


# dense (1-D) parts of consecutive plan groups share one bucket up to this size: they are small,
# and one collective per layer's bias costs more than it overlaps (docs/topk.md#dense-1d)
DENSE_MERGE_BYTES = 1 << 20


def build_buckets(specs_backward: Sequence[TensorSpec], plan: Sequence[Sequence[int]],
                  keeps_dense: Callable[[TensorSpec], bool] | None = None) -> list[Bucket]:
    """Turn a plan (groups of positions in backward order) into buckets.

    A group whose members have different dtypes is split at each dtype change, because one
    flat buffer holds one dtype; the split keeps the order, so every rank splits identically.
    With ``keeps_dense`` (a sparse reducer's :meth:`~hvd_commopt.reduce.base.Reducer.keeps_dense`),
    the members it names leave their group for a bucket marked ``dense``: 1-D tensors sent
    uncompressed instead of sharing one selection with the matrices (docs/topk.md#dense-1d). The
    dense parts of consecutive groups share one bucket up to ``DENSE_MERGE_BYTES``. Buckets are
    ordered by their last gradient's arrival (the engine launches them in index order); every
    bucket keeps its members' backward order.
    """
    parts: list[tuple[list[int], bool]] = []
    if keeps_dense is None:
        parts = [(list(group), False) for group in plan]
    else:
        run: list[int] = []
        run_bytes = 0
        for group in plan:
            is_dense = {pos: keeps_dense(specs_backward[pos]) for pos in group}
            dense = [pos for pos in group if is_dense[pos]]
            sparse = [pos for pos in group if not is_dense[pos]]
            if sparse:
                parts.append((sparse, False))
            nbytes = sum(specs_backward[pos].nbytes for pos in dense)
            if run and run_bytes + nbytes > DENSE_MERGE_BYTES:
                parts.append((run, True))
                run, run_bytes = [], 0
            run += dense
            run_bytes += nbytes
        if run:
            parts.append((run, True))
        parts.sort(key=lambda part: max(part[0]))  # stable: ties cannot occur (disjoint positions)
    buckets: list[Bucket] = []
    for part, dense_part in parts:
        run_specs: list[TensorSpec] = []
        for pos in part:
            s = specs_backward[pos]
            if run_specs and run_specs[-1].dtype != s.dtype:
                buckets.append(Bucket.of(len(buckets), run_specs, dense=dense_part))
                run_specs = []
            run_specs.append(s)
        if run_specs:
            buckets.append(Bucket.of(len(buckets), run_specs, dense=dense_part))
    if sum(len(b.names) for b in buckets) != len(specs_backward):
        raise ConfigError("internal: the plan does not cover every tensor exactly once")
    return buckets
