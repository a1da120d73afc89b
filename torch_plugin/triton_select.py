"""Exact top-k by magnitude of a float32 CUDA tensor in Triton: a radix select that reads the data
twice, with no host synchronisation (docs/selection.md#triton-select).

The order is the torch route's (``TorchOps.topk_abs_ranked``, docs/selection.md#order): the key of
an element is its magnitude's bits (``bits & 0x7FFFFFFF``, every NaN one key above +Inf), ties go
to the lower index, so the k selected positions are one well-defined set and this module returns
exactly the torch route's set, ties included. Anchors: the AIR top-k of RAFT/CUB (a histogram of
the top digits, then the candidates of the k-th's bucket compacted into a buffer).

1. **Histogram** (pass 1, one read): the top 11 bits of every key (2048 bins; per program a
   ``tl.histogram``, then one atomic add per non-empty bin). Torch ops on the 2048 counts (no
   host read) find the bin ``b`` of the k-th largest key, ``above`` (the count of larger bins) and
   ``rem = k - above``.
2. **Split** (pass 2, one read): keys in bins above ``b`` are selected for sure and their indices
   and keys written to k slots (one atomic per program reserves the slots, ``tl.cumsum`` places
   them); keys in bin ``b`` are the candidates, compacted with their keys into a buffer of fixed
   capacity :func:`capacity` (a few times k).
3. **Fix-up** (torch ops over the fixed sizes): the k largest composite keys
   ``(key << 32) | (0xFFFFFFFF - index)`` of the sure slots and the candidate buffer, unused
   slots -1: one unsorted ``torch.topk`` over k + capacity entries, exact, ties by index.
4. **Overflow** (more candidates than the capacity: a few distinct magnitudes, e.g. many zeros at
   the k-th): kernels gated by a device flag (every program returns at once when it is clear, so
   the usual step pays their launches only) finish the radix select on the data: the next 11 and
   the last 9 bits give the exact k-th key ``K``, then the keys equal to ``K`` are taken in index
   order (per-program counts, their exclusive sum, a rank within the program). Six reads then.

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

__all__ = ["AVAILABLE", "MIN_N", "capacity", "threshold_reuse", "topk_abs_index", "topk_abs_ranked"]

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


def _bin_of_kth(hist: torch.Tensor, k: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bin of the k-th largest, count in the bins above it) of a histogram (device tensors, 1 element)."""
    h = hist.to(torch.int64)
    at_least = torch.flip(torch.cumsum(torch.flip(h, (0,)), 0), (0,))  # count with digit >= b
    # at least 0: a gated histogram that did not run is all zeros (its result is not used)
    b = torch.clamp(torch.sub(torch.sum(torch.ge(at_least, k), dtype=torch.int64), 1), min=0).reshape(1)
    above = torch.sub(at_least.gather(0, b), h.gather(0, b))
    return b, above


def _grid(n: int) -> tuple[int]:
    return (-(-n // BLOCK),)


def kernels() -> Any:
    """The kernels' module (imports Triton on the first call)."""
    from . import triton_kernels
    return triton_kernels


def topk_abs_index(t: torch.Tensor, k: int) -> torch.Tensor:
    """The k positions of the largest magnitudes of the float32 tensor ``t`` (ties: the lower
    index; NaN above +Inf), ascending, int64: ``TorchOps.topk_abs_index``'s set, bit for bit."""
    return torch.sort(_select(t, k)).values


def topk_abs_ranked(t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``TorchOps.topk_abs_ranked``: (positions, magnitude keys) of the k largest, ranked (key
    descending, then index ascending), int64: the selected set ordered by its composite key."""
    idx = _select(t, k)
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
    bits = t.reshape(-1).view(torch.int32)
    n, k = bits.numel(), int(k)
    cap = min(max(hi_c, 2), n)
    thr, age = prev
    i32 = dict(dtype=torch.int32, device=bits.device)
    buf, ctr = torch.zeros(cap, **i32), torch.zeros(1, **i32)
    kernels().above_threshold[_grid(n)](bits, n, thr.to(torch.int32), buf, ctr, cap, BLOCK=BLOCK)
    cnt = ctr.to(torch.int64)
    accept = torch.logical_and(torch.lt(age, tau), torch.logical_and(torch.ge(cnt, lo_c), torch.le(cnt, hi_c)))
    redo = torch.logical_not(accept)
    exact = torch.where(redo, _select(t, k, gate=redo), 0)  # gated: 0 where accepted
    kth = torch.amin(_keys64(bits.index_select(0, exact))).reshape(1)
    slots = torch.arange(cap, dtype=torch.int64, device=bits.device)
    if cap > k:
        exact = torch.cat([exact, torch.zeros(cap - k, dtype=torch.int64, device=bits.device)])
    top = torch.where(accept, buf.to(torch.int64), exact)
    valid = torch.where(accept, torch.lt(slots, cnt), torch.lt(slots, k))
    return top, valid, (torch.where(accept, thr, kth), torch.where(accept, torch.add(age, 1), 0))


def _select(t: torch.Tensor, k: int, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The k selected positions (int64, in no particular order); see the module docstring. ``gate``
    (a device bool): the kernels run only where it is set (else the result is meaningless)."""
    if not AVAILABLE:
        raise RuntimeError("triton is not installed: use TorchOps.topk_abs_index (the torch-op route)")
    K = kernels()
    bits = t.reshape(-1).view(torch.int32)
    n, k = bits.numel(), int(k)
    if t.dtype != torch.float32 or not 0 < k < n or n >= 1 << 31:
        raise ValueError(f"the Triton select takes float32 tensors of < 2^31 elements and 0 < k < n, "
                         f"got {t.dtype}, n={n}, k={k}")
    dev, grid = bits.device, _grid(n)
    i32 = dict(dtype=torch.int32, device=dev)
    one = torch.ones(1, **i32)
    on = one if gate is None else gate.to(torch.int32).reshape(1)
    hist = torch.zeros(2048, **i32)
    K.histogram[grid](bits, n, hist, on, one, PREFIX_SHIFT=31, DIGIT_SHIFT=20, BINS=2048, BLOCK=BLOCK)
    b1, above1 = _bin_of_kth(hist, k)
    rem1 = torch.rsub(above1, k)
    cap = capacity(n, k)
    out, out_key = torch.empty(k + 1, **i32), torch.empty(k, **i32)  # out's slot k: a spare
    cand_idx, cand_key = torch.empty(cap, **i32), torch.empty(cap, **i32)
    ctr = torch.zeros(3, **i32)
    K.split[grid](bits, n, b1.to(torch.int32), out, out_key, cand_idx, cand_key, ctr, on, CAP=cap,
                   BLOCK=BLOCK)
    found = ctr[1:2].to(torch.int64)
    overflow = torch.logical_and(torch.gt(found, cap), torch.ne(on, 0))
    # 3. the fix-up: the k largest composite keys of the sure entries and the candidates (all of
    # the bin's while they fit): one unsorted topk over k + cap slots, unused slots -1
    sure = _composite(out[:k], out_key, above1)
    comp = torch.topk(torch.cat([sure, _composite(cand_idx, cand_key, found)]), k, sorted=False).values
    fixed = torch.rsub(torch.bitwise_and(comp, _LOW32), _LOW32)
    # 4. overflow: the radix select finished on the data, gated by the flag, into out
    _overflow(K, bits, n, overflow, b1, above1, rem1, out, ctr, grid)
    return torch.where(overflow, out[:k].to(torch.int64), fixed)


def _composite(idx: torch.Tensor, key: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """``(key << 32) | (0xFFFFFFFF - idx)`` in the first ``used`` slots (a device count), -1 after."""
    slots = torch.arange(idx.numel(), dtype=torch.int64, device=idx.device)
    comp = torch.bitwise_or(torch.bitwise_left_shift(key.to(torch.int64), 32), torch.rsub(idx.to(torch.int64), _LOW32))
    return torch.where(torch.lt(slots, used), comp, -1)


def _overflow(K: Any, bits, n, overflow, b1, above1, rem1, out, ctr, grid) -> None:
    i32 = dict(dtype=torch.int32, device=bits.device)
    gate = overflow.to(torch.int32)
    hist2 = torch.zeros(2048, **i32)
    K.histogram[grid](bits, n, hist2, gate, b1.to(torch.int32), PREFIX_SHIFT=20, DIGIT_SHIFT=9, BINS=2048,
                     BLOCK=BLOCK)
    b2, above2 = _bin_of_kth(hist2, torch.clamp(rem1, min=1))
    rem2 = torch.sub(rem1, above2)
    hist3 = torch.zeros(512, **i32)
    prefix = torch.bitwise_or(torch.bitwise_left_shift(b1, 11), b2)
    K.histogram[grid](bits, n, hist3, gate, prefix.to(torch.int32), PREFIX_SHIFT=9, DIGIT_SHIFT=0, BINS=512,
                     BLOCK=BLOCK)
    b3, above3 = _bin_of_kth(hist3, torch.clamp(rem2, min=1))
    rem3 = torch.sub(rem2, above3)  # how many of the keys equal to the k-th are taken
    kth = torch.bitwise_or(torch.bitwise_left_shift(prefix, 9), b3)
    counts = torch.zeros(grid[0], **i32)
    K.count_equal[grid](bits, n, gate, kth.to(torch.int32), counts, BLOCK=BLOCK)
    starts = torch.sub(torch.cumsum(counts, 0, dtype=torch.int32), counts)
    # state: bin, k-th key, first slot of the keys above it, first slot of the equal ones, how many
    state = torch.cat([b1, kth, above1, torch.add(above1, torch.sub(rem1, rem3)), rem3]).to(torch.int32)
    K.write_overflow[grid](bits, n, gate, state, starts, out, ctr, BLOCK=BLOCK)
