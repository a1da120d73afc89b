"""Exact top-k by magnitude of a float32 CUDA tensor in Triton: a radix select that reads the data
twice, with no host synchronisation (docs/selection.md#triton-select), error feedback's add fused
into its first read (docs/selection.md#triton-fused-ef).

The order is the torch route's (``TorchOps.topk_abs_ranked``, docs/selection.md#order): the key of
an element is its magnitude's bits (``bits & 0x7FFFFFFF``, every NaN one key above +Inf), ties go
to the lower index, so the k selected positions are one well-defined set and this module returns
exactly the torch route's set, ties included. Anchors: the AIR top-k of RAFT/CUB (a histogram of
the top digits, then the candidates of the k-th's bucket compacted into a buffer).

1. **Histogram** (pass 1, one read): the top 11 bits of every key (2048 bins; per program a
   ``tl.histogram``, then one atomic add per non-empty bin). A one-program kernel (``find_bin``)
   finds the bin ``b`` of the k-th largest key, ``above`` (the count of larger bins) and
   ``rem = k - above`` and writes them to a device state tensor that the later kernels read.
2. **Split** (pass 2, one read): keys in bins above ``b`` are selected for sure and their indices
   written to k slots (one atomic per program reserves the slots, ``tl.cumsum`` places them);
   keys in bin ``b`` are the candidates, compacted with their keys into a buffer of fixed
   capacity :func:`capacity` (a few times k).
3. **Fix-up** in the candidate buffer (kernels over its slots, gated by "they fit"): the
   candidates' next 11 and last 9 bits give the exact k-th key ``K``; when no tie straddles the
   k-th, every candidate ``>= K`` follows the sure entries.
4. **On the data** (more candidates than the capacity: a few distinct magnitudes, e.g. many zeros
   at the k-th; or a tie straddling the k-th, which the buffer cannot order by index): gated
   kernels finish the radix select on the data, then the keys equal to ``K`` are taken in index
   order (per-program counts, their exclusive sum, a rank within the program). Six reads then.

Every kernel after the first is gated by device flags (a program returns at once when its path
is not taken). With error feedback the first kernel reads ``t`` and the addend and writes their
sum, which every later kernel reads (:func:`add_topk_abs_index`, docs/selection.md#triton-fused-ef).

The k indices come out in no order and are sorted ascending (``torch.sort`` of k elements).
:func:`topk_abs_index` is what ``TorchOps.topk_abs_index`` calls on CUDA float32 tensors of at
least :data:`MIN_N` elements when ``triton`` imports; otherwise the torch-op route runs (the
tested fallback). The kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors, which is how
tests/torch/test_triton_select.py checks the set against the torch route without a GPU.

:func:`threshold_reuse` is threshold reuse's reused step (docs/selection.md#triton-reuse): one
read compacts the indices of ``key >= thr`` (the carried threshold, a device tensor) into the
band's capacity and counts them; the exact select above runs gated by "not accepted" (its
kernels return at once otherwise), so an accepted step reads the data once.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = ["AVAILABLE", "MIN_N", "add_threshold_reuse", "add_topk_abs_index", "adds", "capacity", "threshold_reuse",
           "topk_abs_index", "topk_abs_ranked"]

#: whether Triton is installed (CPU builds of torch come without it: the torch-op route runs);
#: the kernels (torch_plugin/triton_kernels.py) are imported on the first selection
AVAILABLE = importlib.util.find_spec("triton") is not None
#: below this size the torch route's topk is cheap enough and the launches would dominate
MIN_N = 1 << 20
BLOCK = 4096
NAN_KEY = 0x7F800001  # every NaN: one key above +Inf (0x7F800000)
_LOW32 = 0xFFFFFFFF


def capacity(n: int, k: int) -> int:
    """The candidate buffer's size: 4k + 4096 (the k-th's bin of 1/8 of an octave holds well under
    k elements on gradient-like data), at most n."""
    return min(n, 4 * k + 4096)


def _grid(n: int) -> tuple[int]:
    return (-(-n // BLOCK),)


def kernels() -> Any:
    """The kernels' module (imports Triton on the first call)."""
    from . import triton_kernels
    return triton_kernels


def topk_abs_index(t: torch.Tensor, k: int) -> torch.Tensor:
    """The k positions of the largest magnitudes of the float32 tensor ``t`` (ties: the lower
    index; NaN above +Inf), ascending, int64: ``TorchOps.topk_abs_index``'s set, bit for bit."""
    return torch.sort(_select(t, k)[0]).values


def adds(t: torch.Tensor, addend: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether the add can be fused (docs/selection.md#triton-fused-ef): ``t``, ``addend`` and
    ``out`` (None: into t) flat, contiguous, of one size and dtype on one device."""
    return t.dim() == 1 and all(x.dim() == 1 and x.is_contiguous() and x.dtype == t.dtype and x.device == t.device
                                and x.numel() == t.numel() for x in (t, addend, t if out is None else out))


def add_topk_abs_index(t: torch.Tensor, addend: torch.Tensor, out: torch.Tensor | None,
                       k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``TorchOps.add_topk_abs_index``: ``(acc, positions)``, ``acc = t + addend`` written into
    ``out`` (into ``t`` when None) by the first kernel's read of both, and :func:`topk_abs_index`
    of it, which reads ``acc`` (docs/selection.md#triton-fused-ef): the bits of ``t + addend``
    and of the torch route's selection of it."""
    acc = t if out is None else out  # the caller's tensor, as the torch route's add_ returns it
    idx = _select(t.detach(), k, addend=addend.detach(), dst=acc.detach())[0]
    return acc, torch.sort(idx).values


def topk_abs_ranked(t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``TorchOps.topk_abs_ranked``: (positions, magnitude keys) of the k largest, ranked (key
    descending, then index ascending), int64: the selected set ordered by its composite key."""
    idx = _select(t, k)[0]
    keys = _keys64(t.reshape(-1).view(torch.int32).index_select(0, idx))
    comp = torch.sort(torch.bitwise_or(torch.bitwise_left_shift(keys, 32), torch.rsub(idx, _LOW32)),
                      descending=True).values
    return torch.rsub(torch.bitwise_and(comp, _LOW32), _LOW32), torch.bitwise_right_shift(comp, 32)


def _keys64(bits: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.bitwise_and(bits, 0x7FFFFFFF), max=NAN_KEY).to(torch.int64)


def threshold_reuse(t: torch.Tensor, k: int, lo_c: int, hi_c: int, tau: int,
                    prev: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``TorchOps.threshold_reuse`` with a previous threshold: ``(positions, valid, (threshold
    key, age))`` in ``cap = min(max(hi_c, 2), n)`` slots, the set of select/device.py
    reuse_candidates bit for bit: accepted (``age < tau``, ``lo_c <= count <= hi_c``) the
    positions of ``key >= thr``, else the exact top-k and its k-th key as the new threshold."""
    return _reuse(t, k, lo_c, hi_c, tau, prev)


def add_threshold_reuse(t: torch.Tensor, addend: torch.Tensor, out: torch.Tensor | None, k: int, lo_c: int,
                        hi_c: int, tau: int, prev: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """``TorchOps.add_threshold_reuse``: ``(acc, candidates)``, ``acc = t + addend`` written into
    ``out`` (``t`` when None) by the one read of both, the candidates :func:`threshold_reuse`'s
    of ``acc`` (docs/selection.md#triton-fused-ef)."""
    acc = t if out is None else out
    return acc, _reuse(t.detach(), k, lo_c, hi_c, tau, prev, addend.detach(), acc.detach())


def _reuse(t, k, lo_c, hi_c, tau, prev, addend=None, dst=None):
    n, k = t.numel(), int(k)
    cap = min(max(hi_c, 2), n)
    thr, age = prev
    i32 = dict(dtype=torch.int32, device=t.device)
    ws = torch.zeros(cap + 1, **i32)  # the slots (unused: index 0), then the counter
    buf, ctr = ws[:cap], ws[cap:]
    if addend is None:
        src = t.reshape(-1)
        kernels().above_threshold[_grid(n)](src.view(torch.int32), n, thr.to(torch.int32), buf, ctr, cap, BLOCK=BLOCK)
    else:
        src = dst.reshape(-1)
        kernels().add_above_threshold[_grid(n)](t.reshape(-1), addend.reshape(-1), src, n, thr.to(torch.int32), buf,
                                                ctr, cap, BLOCK=BLOCK)
    cnt = ctr.to(torch.int64)
    accept = torch.logical_and(torch.lt(age, tau), torch.logical_and(torch.ge(cnt, lo_c), torch.le(cnt, hi_c)))
    # not accepted: the exact select, every kernel of it gated by the flag (docs/selection.md#triton-reuse)
    exact, kth = _select(src, k, gate=torch.logical_not(accept))
    slots = torch.arange(cap, dtype=torch.int64, device=t.device)
    if cap > k:
        exact = torch.cat([exact, torch.zeros(cap - k, dtype=torch.int64, device=t.device)])
    top = torch.where(accept, buf.to(torch.int64), exact)
    valid = torch.where(accept, torch.lt(slots, cnt), torch.lt(slots, k))
    return top, valid, (torch.where(accept, thr, kth), torch.where(accept, torch.add(age, 1), 0))


def _select(t: torch.Tensor, k: int, gate: torch.Tensor | None = None, addend: torch.Tensor | None = None,
            dst: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the k selected positions, int64 in no particular order; the k-th key, int64 (1,)); see the
    module docstring. ``gate`` (a device bool): the kernels run only where it is set (else the
    result is meaningless). ``addend``: select ``t + addend``, written into ``dst`` by the first
    kernel, which every later one reads."""
    if not AVAILABLE:
        raise RuntimeError("triton is not installed: use TorchOps.topk_abs_index (the torch-op route)")
    K = kernels()
    n, k = t.numel(), int(k)
    if t.dtype != torch.float32 or not 0 < k < n or n >= 1 << 31:
        raise ValueError(f"the Triton select takes float32 tensors of < 2^31 elements and 0 < k < n, "
                         f"got {t.dtype}, n={n}, k={k}")
    if addend is not None and not all(x.dtype == t.dtype and x.numel() == n and x.is_contiguous()
                                      and x.device == t.device for x in (t, addend, dst)):
        raise ValueError("the fused add takes contiguous float32 tensors of one size on one device")
    dev, grid, cap = t.device, _grid(n), capacity(n, k)
    cgrid = _grid(cap)
    i32 = dict(dtype=torch.int32, device=dev)
    S = K.STATE
    # one zeroed workspace: the state, the counters (sure, candidates, fix-up), five histograms
    # (level 1; levels 2 and 3 in the candidate buffer, then on the data), per-program counts
    ws = torch.zeros(S + 3 + 3 * 2048 + 2 * 512 + grid[0], **i32)
    state, ctr = ws[:S], ws[S:S + 3]
    h1, h2c, h2d = (ws[S + 3 + i * 2048:S + 3 + (i + 1) * 2048] for i in range(3))
    h3c, h3d = ws[S + 3 + 3 * 2048:S + 3 + 3 * 2048 + 512], ws[S + 3 + 3 * 2048 + 512:S + 3 + 3 * 2048 + 1024]
    counts = ws[S + 3 + 3 * 2048 + 1024:]
    on = torch.ones(1, **i32) if gate is None else gate.to(torch.int32).reshape(1)
    common = (on, state, ctr, cap)
    # 1. the histogram of the top 11 bits (with the add: of t + addend, the sum written to dst)
    if addend is None:
        bits = t.reshape(-1).view(torch.int32)
        K.histogram[grid](bits, n, h1, *common, LEVEL=1, BINS=2048, MODE=K.ALWAYS, BLOCK=BLOCK)
    else:
        K.add_histogram[grid](t.reshape(-1), addend.reshape(-1), dst.reshape(-1), n, h1, BLOCK=BLOCK)
        bits = dst.reshape(-1).view(torch.int32)
    K.find_bin[(1,)](h1, state, on, ctr, cap, k, LEVEL=1, BINS=2048, MODE=K.ALWAYS)
    # 2. the split: the sure entries to out, the k-th's bin to the candidate buffer
    out = torch.empty(k + 1, **i32)  # out's slot k: a spare
    cand_idx, cand_key = torch.empty(cap, **i32), torch.empty(cap, **i32)
    K.split[grid](bits, n, state, out, cand_idx, cand_key, ctr, on, CAP=cap, BLOCK=BLOCK)
    # 3. the fix-up in the candidate buffer (gated: they fit): the next 11 and the last 9 bits
    # give the k-th key; every candidate >= it is taken unless a tie straddles the k-th
    K.cand_histogram[cgrid](cand_key, h2c, *common, LEVEL=2, BINS=2048, BLOCK=BLOCK)
    K.find_bin[(1,)](h2c, state, on, ctr, cap, 0, LEVEL=2, BINS=2048, MODE=K.FITS)
    K.cand_histogram[cgrid](cand_key, h3c, *common, LEVEL=3, BINS=512, BLOCK=BLOCK)
    K.find_bin[(1,)](h3c, state, on, ctr, cap, 0, LEVEL=3, BINS=512, MODE=K.FITS)
    K.cand_write[cgrid](cand_idx, cand_key, *common, out, BLOCK=BLOCK)
    # 4. on the data (gated: the candidates overflowed, or a tie straddles the k-th): the same
    # radix levels over the data, then the ties in index order
    K.histogram[grid](bits, n, h2d, *common, LEVEL=2, BINS=2048, MODE=K.ON_DATA, BLOCK=BLOCK)
    K.find_bin[(1,)](h2d, state, on, ctr, cap, 0, LEVEL=2, BINS=2048, MODE=K.ON_DATA)
    K.histogram[grid](bits, n, h3d, *common, LEVEL=3, BINS=512, MODE=K.ON_DATA, BLOCK=BLOCK)
    K.find_bin[(1,)](h3d, state, on, ctr, cap, 0, LEVEL=3, BINS=512, MODE=K.ON_DATA)
    K.count_equal[grid](bits, n, *common, counts, BLOCK=BLOCK)
    starts = torch.sub(torch.cumsum(counts, 0, dtype=torch.int32), counts)
    K.write_overflow[grid](bits, n, *common, starts, out, BLOCK=BLOCK)
    return out[:k].to(torch.int64), state[K.S_KTH.value:K.S_KTH.value + 1].to(torch.int64)
