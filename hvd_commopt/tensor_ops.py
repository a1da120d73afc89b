"""The small tensor-ops interface every algorithm in the core is written against.

Each adapter implements it with its framework's native ops (``torch.topk``, ``tf.math.top_k``);
:class:`hvd_commopt.numpy_ops.NumpyOps` implements it for host arrays and is what the unit tests
and the in-process backend use. Tensor primitives only: the selection's own operations live behind
:class:`hvd_commopt.select.kernels.SelectionKernels`, which runs on an adapter's ``host_view``
(host memory) or on its primitives (``abs_keys``, ``compare``, ``nonzero``, ``kth_smallest``).

Design choice: every method is *functional* — it returns its result, and callers always use the
returned value. PyTorch implementations may work in place and return their argument (cheap);
TensorFlow tensors are immutable and return new tensors. Writing the core this way is what lets
one algorithm serve both frameworks without a per-framework copy.

Dtypes are named by strings ("float32", "float16", "bfloat16", "int32", "int64", "int8", ...),
never by framework objects, so the core can reason about them (:mod:`hvd_commopt.dtypes`).

Bit-exactness: ``axpy_`` must be the framework's own fused ``y + alpha*x`` kernel (PyTorch's
``add_(x, alpha=...)``), because that is what ``torch.optim.SGD`` uses: the delayed schedules'
local optimizer then performs the very same floating-point operations as the wrapped optimizer
(docs/od-sgd.md#t-od-1).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from .dtypes import DTYPE_BYTES

__all__ = ["TensorOps", "DTYPE_BYTES", "register_ops", "ops_for"]

Tensor = Any


@runtime_checkable
class TensorOps(Protocol):
    """Native tensor operations the core needs. All tensors handled here are 1-D unless stated."""

    name: str  # "torch", "tensorflow", "numpy"
    slices_are_views: bool  # slice() shares memory: what is written into a slice lands in the buffer

    # -- description -------------------------------------------------------------------------
    def numel(self, t: Tensor) -> int: ...
    def dtype_name(self, t: Tensor) -> str: ...
    def shape(self, t: Tensor) -> tuple[int, ...]: ...
    def device_name(self, t: Tensor) -> str: ...  # "cpu", "cuda:0", ...
    def on_device(self, t: Tensor) -> bool: ...  # t lives in device memory, not host memory (a cheap check)

    # -- creation and layout -----------------------------------------------------------------
    def empty(self, n: int, dtype: str, like: Tensor) -> Tensor: ...  # 1-D, on like's device
    def zeros(self, n: int, dtype: str, like: Tensor) -> Tensor: ...
    def flatten(self, t: Tensor) -> Tensor: ...  # 1-D view where possible
    def reshape(self, t: Tensor, shape: Sequence[int]) -> Tensor: ...
    def slice(self, t: Tensor, start: int, stop: int) -> Tensor: ...  # view where possible
    def cat(self, ts: Sequence[Tensor]) -> Tensor: ...
    def copy_into(self, dst: Tensor, offset: int, src: Tensor) -> Tensor: ...  # dst[offset:offset+n] = flat(src)
    def clone(self, t: Tensor) -> Tensor: ...
    # True when nothing but ``t`` refers to its memory (no view of it is alive anywhere), so writing
    # into it changes no tensor someone else holds; False where the framework cannot tell
    # (docs/wrapper.md#grad-views)
    def exclusive(self, t: Tensor) -> bool: ...
    def zero_(self, t: Tensor) -> Tensor: ...  # zeros shaped like t (in place allowed: no allocation)
    def cast(self, t: Tensor, dtype: str) -> Tensor: ...
    # Raw bytes (docs/topk.md#one-message): ``as_bytes`` gives the bytes of the 1-D tensor ``t`` as
    # a 1-D uint8 tensor (a view where the framework allows), ``from_bytes`` reinterprets such a
    # buffer (length a multiple of the width) as a 1-D tensor of ``dtype``; bit-exact both ways,
    # so several parts of different dtypes can travel as one message.
    def as_bytes(self, t: Tensor) -> Tensor: ...
    def from_bytes(self, b: Tensor, dtype: str) -> Tensor: ...

    # -- arithmetic --------------------------------------------------------------------------
    def scale(self, t: Tensor, factor: float) -> Tensor: ...  # t * factor (in place allowed)
    def scale_into(self, dst: Tensor, t: Tensor, factor: float) -> Tensor: ...  # t * factor into dst (t intact)
    def add(self, a: Tensor, b: Tensor) -> Tensor: ...  # a + b (in place into a allowed)
    # t * factor + g into dst (dst may be t, not g): scale_into then add, bit for bit (two
    # roundings, never an FMA); one pass on host memory (docs/selection.md#native-sweep). The
    # momentum's u = mu*u + g (DGC's memory, and the selection's addend)
    def scale_add_into(self, dst: Tensor, t: Tensor, factor: float, g: Tensor) -> Tensor: ...
    def sub(self, a: Tensor, b: Tensor) -> Tensor: ...
    def mul(self, a: Tensor, b: Tensor) -> Tensor: ...  # a new tensor a*b (element-wise)
    def trunc_divide(self, t: Tensor, d: int) -> Tensor: ...  # integer t / d rounded toward zero (in place allowed)
    def copy_(self, dst: Tensor, src: Tensor) -> Tensor: ...  # dst[...] = src (any shape); returns dst
    # dst[...] = src converted to dst's dtype (bfloat16 as the adapter carries it): a cast with no new
    # buffer where the framework writes in place (returns dst; TF: a new tensor)
    def cast_into(self, dst: Tensor, src: Tensor) -> Tensor: ...
    def axpy_(self, y: Tensor, alpha: float, x: Tensor) -> Tensor:
        """``y + alpha*x`` with the framework's fused kernel (in place into y allowed)."""
        ...
    def axpy_into(self, dst: Tensor, y: Tensor, alpha: float, x: Tensor) -> Tensor:
        """``y + alpha*x`` into dst (y and x intact): what ``axpy_(copy_(dst, y), alpha, x)``
        gives, bit for bit, in one pass (the delayed schedules' local step from the replica)."""
        ...
    def ternary(self, t: Tensor, theta: float, dtype: str) -> Tensor:
        """Signs of the ternary quantizer: +1 where ``t >= theta``, -1 where ``t <= -theta``, else
        0, as integers of ``dtype`` (MXNet's 2-bit quantizer, docs/cd-sgd.md#update-rule)."""
        ...

    # -- sparse ------------------------------------------------------------------------------
    def topk_abs(self, t: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """(values, int64 indices) of the k largest |t|; ties broken towards the lower index;
        indices in ascending order (the canonical form, identical on every rank)."""
        ...
    def gather(self, t: Tensor, idx: Tensor) -> Tensor: ...
    def scatter_add(self, dst: Tensor, idx: Tensor, vals: Tensor) -> Tensor: ...  # duplicates summed
    def index_fill(self, t: Tensor, idx: Tensor, value: float) -> Tensor: ...
    def index_copy(self, t: Tensor, idx: Tensor, vals: Tensor) -> Tensor: ...  # t[idx] = vals (in place allowed; repeated indices carry equal values)
    def arange(self, n: int, like: Tensor) -> Tensor: ...  # int64
    def shift(self, idx: Tensor, offset: int) -> Tensor: ...  # a new int64 tensor idx + offset

    # -- sparse merging and selection (top-k, gTop-k, DGC) -------------------------------------
    def unique_sum(self, idx: Tensor, vals: Tensor) -> tuple[Tensor, Tensor]:
        """(sorted unique int64 indices, the sum of the values at each index). Values at equal
        indices are summed in their order of appearance (for two operands a + b, which IEEE
        addition makes order-free). gTop-k's merge operator (docs/gtopk.md#merge-robust)."""
        ...
    def isin(self, elements: Tensor, test: Tensor, invert: bool = False) -> Tensor:
        """bool tensor, True where ``elements[i]`` occurs in ``test`` (False with ``invert``);
        gTop-k's survival masks."""
        ...
    def nonzero(self, mask: Tensor, sparse: bool = False) -> Tensor:
        """int64 positions where the bool ``mask`` is True, ascending; ``sparse``: few are
        expected (the adapter may scan such a mask faster)."""
        ...
    def abs_ge(self, t: Tensor, threshold: float) -> Tensor:
        """bool tensor ``|t| >= threshold``."""
        ...

    # -- fixed-capacity merging (the device route: output shapes never depend on the data) -----
    def argsort(self, t: Tensor, descending: bool = False) -> Tensor:
        """int64 positions that sort ``t`` (ascending, or descending), **stable**: equal values
        keep their order of position (gTop-k's device merge, docs/gtopk.md#merge-fixed)."""
        ...
    def searchsorted(self, sorted_seq: Tensor, values: Tensor) -> Tensor:
        """int64, for each of ``values`` the first position ``p`` of the ascending ``sorted_seq``
        with ``sorted_seq[p] >= value`` (numel(sorted_seq) when none)."""
        ...
    def equal(self, a: Tensor, b: Tensor) -> Tensor:
        """bool tensor ``a == b`` element-wise (two tensors of one length)."""
        ...
    def cumsum(self, t: Tensor) -> Tensor:
        """Inclusive running sum of the integer tensor ``t``, as int64 (Ok-Topk's device route:
        histograms' prefix counts and slot offsets, docs/oktopk.md#device-route)."""
        ...

    # -- magnitude keys (docs/selection.md#order): the selection's portable kernels -------------
    # A float's magnitude key is the bit pattern of |x| read as a signed integer of its width:
    # +0 == -0 < denormals < normals < +Inf < NaN, monotone in the value.
    def abs_keys(self, t: Tensor) -> Tensor:
        """The keys of ``|t|`` (float16/bfloat16/float32/float64) as an integer tensor."""
        ...
    def abs_key(self, value: float, like: Tensor) -> int:
        """The key of ``|value|`` rounded to ``like``'s float dtype, as that dtype's cast rounds."""
        ...
    def compare(self, t: Tensor, op: str, value: int) -> Tensor:
        """bool tensor ``t op value`` for ``op`` in "ge" "gt" "le" "lt" (integer keys; ``value`` an
        int, or a 1-element tensor of t's kind on the device route)."""
        ...
    def kth_smallest(self, t: Tensor, k: int) -> int:
        """The k-th smallest (1-based) of the integer tensor ``t``, as a Python int."""
        ...

    # -- the device route (docs/selection.md#device-route): fixed sizes, flags kept as tensors ---
    def topk_abs_index(self, t: Tensor, k: int) -> Tensor:
        """int64 positions of the k largest ``|t|`` in the magnitude order (+0 == -0 < ... < +Inf <
        NaN, every NaN equal), ties towards the lower index, ascending: ``topk_abs``'s indices with
        NaN ranked, of a size fixed by k and with no host synchronisation where the framework
        allows (torch: a composite-key ``topk``)."""
        ...
    def threshold_reuse(self, t: Tensor, k: int, lo_c: int, hi_c: int, tau: int,
                        prev: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]] | None:
        """Threshold reuse's candidates from a native kernel (the torch adapter's Triton one on CUDA,
        docs/selection.md#triton-reuse): what select/device.py ``reuse_candidates`` returns,
        ``(positions, valid, (threshold key, age))``, bit for bit; None where the adapter has no
        kernel for ``t`` (then the device route runs ``reuse_candidates`` on the primitives)."""

    def add_topk_abs_index(self, t: Tensor, addend: Tensor, out: Tensor | None, k: int) -> tuple[Tensor, Tensor] | None:
        """``(acc, topk_abs_index(acc, k))`` with ``acc = t + addend`` written into ``out`` (into
        ``t`` when None) by the selection's own read of both (the torch adapter's Triton kernels on
        CUDA, docs/selection.md#triton-fused-ef): the bits of ``add`` then :meth:`topk_abs_index`;
        None where the adapter has no such kernel for these tensors (then the caller adds first)."""

    def add_threshold_reuse(self, t: Tensor, addend: Tensor, out: Tensor | None, k: int, lo_c: int, hi_c: int,
                            tau: int, prev: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple] | None:
        """``(acc, threshold_reuse(acc, ...))`` with ``acc = t + addend`` made as in
        :meth:`add_topk_abs_index`, in the reused step's one read; None where the adapter has no
        such kernel (then the caller adds first and asks :meth:`threshold_reuse`)."""

    def topk_abs_ranked(self, t: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """(int64 positions, int64 canonical magnitude keys at them) of the k largest ``|t|``,
        largest first, equal keys lower index first (every NaN one key above +Inf's): the
        ranked form of :meth:`topk_abs_index` (threshold reuse's fixed capacity), no host sync."""
        ...
    def count_true(self, mask: Tensor) -> Tensor:
        """A 1-element int64 tensor (on mask's device): how many of the bool ``mask`` are True."""
        ...
    def sort(self, t: Tensor) -> Tensor:
        """The integer tensor ``t`` in ascending order (a new tensor)."""
        ...
    def finite_flag(self, t: Tensor, how: str = "all") -> Tensor:
        """A 0-d bool tensor (on t's device): every element of t is finite (``how="all"``), or at
        least one is (``"any"``); no host sync."""
        ...
    def where(self, flag: Tensor, a: Tensor, b: Tensor) -> Tensor:
        """``a`` where the bool ``flag`` (0-d, 1-element, or shaped like a) is True, else ``b`` (a
        tensor like a, or a Python number), element-wise, as a new tensor on the device: a
        data-dependent choice without a host decision (the fixed-capacity merges use it with a
        mask shaped like a)."""
        ...
    def read_flags(self, flags: Sequence[Tensor]) -> tuple[bool, ...]:
        """The values of 0-d bool tensors on the host, read in ONE synchronisation (the device
        route's one NaN/Inf decision per bucket, as ``torch.amp.GradScaler`` makes)."""
        ...

    def norm(self, t: Tensor) -> float:
        """L2 norm of t as a Python float, accumulated in at least float32 (DGC's clipping)."""
        ...
    def clip_to_norm_(self, t: Tensor, max_norm: float, eps: float) -> Tensor:
        """DGC's local clipping with no host read (docs/dgc.md#clip-on-device): ``t`` scaled by
        ``c = max_norm / (norm(t) + eps)`` (float64 arithmetic on :meth:`norm`'s value, as the
        host route's Python floats) where ``c < 1``, ``c`` rounded as :meth:`scale` rounds a
        factor; else ``t``'s values unchanged. In place allowed; the choice is made on the device."""
        ...
    def all_finite(self, t: Tensor) -> bool:
        """True when no element of t is NaN or +-Inf (docs/wrapper.md#nonfinite)."""
        ...

    # -- low-bit quantisation (docs/quantize.md#encoding): one specification, bit-exact everywhere --
    def quantize_blocks(self, t: Tensor, bits: int, block: int) -> tuple[Tensor, Tensor, Tensor]:
        """(scales, codes, decoded) of the 1-D float32 ``t`` (n elements) cut into blocks of
        ``block``, the last one zero-padded; ``q = 2**(bits-1) - 1``. ``scales``: float32, one per
        block, ``max|x| / q`` in float32; ``codes``: uint8 (n,), ``clip(round(x / s'), -q, q) + q``
        with ``s' = s`` where ``s > 0`` else 1, the division in float32, rounding half to even;
        ``decoded``: float32 (n,), ``(codes - q) * s`` in float32. On t's device."""
        ...
    def dequantize_blocks(self, scales: Tensor, codes: Tensor, bits: int, block: int) -> Tensor:
        """float32 ``(codes - q) * s`` of uint8 ``codes`` (n,) and float32 ``scales`` (one per block
        of ``block``): :meth:`quantize_blocks`'s decoded values from what was sent."""
        ...
    def pack_bits(self, codes: Tensor, bits: int) -> Tensor:
        """uint8 codes (each < 2**bits) as a stream of ``bits`` bits each, least significant bit
        first, code i at bit ``i*bits``; ``ceil(n*bits/8)`` uint8 bytes, the last zero-padded (8
        bits: the codes themselves)."""
        ...
    def unpack_bits(self, buf: Tensor, n: int, bits: int) -> Tensor:
        """The n uint8 codes of a :meth:`pack_bits` stream."""
        ...
    def topk_abs_rows(self, t: Tensor, width: int, k: int) -> Tensor:
        """The float32 ``t`` read as rows of ``width`` elements: for every row the column positions
        (int64, 0..width-1) of its k largest ``|t|``, ranked (largest first; equal magnitudes
        lower column first; +0 == -0, every NaN one key above +Inf), ``rows * k`` values, row by
        row: the chunk-wise top-k's one batched call (docs/quantize.md#batched-topk)."""
        ...

    # -- host exchange (communicators that need host buffers) ---------------------------------
    def host_view(self, t: Tensor):
        """``t``'s values as a flat NumPy array without a copy (a view of a contiguous CPU
        tensor's memory, detached from autograd) where the framework allows, else None: what the
        selection's host kernels run on (:mod:`hvd_commopt.select.host`). Written in place only
        where ``slices_are_views`` (mutable tensors)."""
        ...
    def to_numpy(self, t: Tensor):
        """A NumPy array with t's contents; a zero-copy view for contiguous CPU tensors."""
        ...
    def from_numpy(self, a, like: Tensor) -> Tensor:
        """A tensor with a's contents on like's device (zero-copy where the framework allows)."""
        ...


# Which TensorOps handles a given framework tensor: adapters register theirs at import, so a core
# object called the way Horovod's user code calls it (``Compression.fp16.compress(tensor)``,
# without ops) can still find the framework's ops. The core never imports a framework.
_REGISTRY: list[tuple[type, Any]] = []


def register_ops(tensor_type: type, ops: Any) -> None:
    """Make ``ops`` the TensorOps for instances of ``tensor_type`` (adapters call it at import)."""
    if all(t is not tensor_type for t, _ in _REGISTRY):
        _REGISTRY.append((tensor_type, ops))


def ops_for(t: Tensor) -> Any:
    """The registered TensorOps for tensor ``t``; TypeError when no adapter handles its type."""
    for typ, ops in _REGISTRY:
        if isinstance(t, typ):
            return ops
    raise TypeError(f"no TensorOps registered for {type(t).__name__}: import torch_plugin or tf_plugin "
                    f"(or pass the ops explicitly: compress(ops, flat))")
