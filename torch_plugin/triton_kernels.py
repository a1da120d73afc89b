"""The Triton kernels of torch_plugin/triton_select.py (docs/selection.md#triton-select), in a module
of their own so that importing the torch adapter does not import Triton: triton_select loads this
module on its first selection. Keys are the magnitude bits of float32 (``bits & 0x7FFFFFFF``, every
NaN one key above +Inf); the launches and what they compute are described in triton_select."""
import triton
import triton.language as tl

__all__ = ["above_threshold", "histogram", "split", "count_equal", "write_overflow"]


@triton.jit
def _key(bits):
    key = bits & 0x7FFFFFFF
    return tl.where(key > 0x7F800000, 0x7F800001, key)


@triton.jit
def histogram(bits_ptr, n, hist_ptr, gate_ptr, prefix_ptr, PREFIX_SHIFT: tl.constexpr,
               DIGIT_SHIFT: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """hist[(key >> DIGIT_SHIFT) % BINS] += 1 over the keys whose ``key >> PREFIX_SHIFT`` equals
    ``*prefix_ptr`` (PREFIX_SHIFT 31: every key), while ``*gate_ptr`` is set."""
    if tl.load(gate_ptr) != 0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
        if PREFIX_SHIFT < 31:
            m = m & ((key >> PREFIX_SHIFT) == tl.load(prefix_ptr))
        h = tl.histogram((key >> DIGIT_SHIFT) & (BINS - 1), BINS, mask=m)
        tl.atomic_add(hist_ptr + tl.arange(0, BINS), h, mask=h > 0, sem="relaxed")


@triton.jit
def split(bits_ptr, n, state_ptr, out_ptr, out_key_ptr, cand_idx_ptr, cand_key_ptr, ctr_ptr, gate_ptr,
          CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Keys in bins above ``state[0]``: their indices and keys to ``out``/``out_key`` (slots from ``ctr[0]``); keys
    in that bin: (index, key) to the candidate buffer while it has room (``ctr[1]`` counts all); gated."""
    if tl.load(gate_ptr) != 0:
        _split(bits_ptr, n, state_ptr, out_ptr, out_key_ptr, cand_idx_ptr, cand_key_ptr, ctr_ptr, CAP, BLOCK)


@triton.jit
def _split(bits_ptr, n, state_ptr, out_ptr, out_key_ptr, cand_idx_ptr, cand_key_ptr, ctr_ptr,
           CAP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
    b = tl.load(state_ptr)
    d = key >> 20
    sure = (m & (d > b)).to(tl.int32)
    base = tl.atomic_add(ctr_ptr, tl.sum(sure, 0))
    pos = base + tl.cumsum(sure, 0) - 1
    tl.store(out_ptr + pos, offs.to(tl.int32), mask=sure != 0)
    tl.store(out_key_ptr + pos, key, mask=sure != 0)
    cand = (m & (d == b)).to(tl.int32)
    cbase = tl.atomic_add(ctr_ptr + 1, tl.sum(cand, 0))
    cpos = cbase + tl.cumsum(cand, 0) - 1
    ok = (cand != 0) & (cpos < CAP)
    tl.store(cand_idx_ptr + cpos, offs.to(tl.int32), mask=ok)
    tl.store(cand_key_ptr + cpos, key, mask=ok)


@triton.jit
def count_equal(bits_ptr, n, gate_ptr, kth_ptr, counts_ptr, BLOCK: tl.constexpr):
    """Per program: how many keys equal ``*kth_ptr`` (gated)."""
    if tl.load(gate_ptr) != 0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
        eq = (m & (key == tl.load(kth_ptr))).to(tl.int32)
        tl.store(counts_ptr + tl.program_id(0), tl.sum(eq, 0))


@triton.jit
def write_overflow(bits_ptr, n, gate_ptr, state_ptr, starts_ptr, out_ptr, ctr_ptr, BLOCK: tl.constexpr):
    """The candidates' part of the selection when they overflowed (gated): keys of the k-th's
    top bin above the exact k-th key ``state[1]`` from slot ``state[2]`` on; keys equal to it
    in index order (the program's exclusive start ``starts[pid]``), the first ``state[4]``,
    from slot ``state[3]`` on."""
    if tl.load(gate_ptr) != 0:
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
        b, kth = tl.load(state_ptr), tl.load(state_ptr + 1)
        gt = (m & ((key >> 20) == b) & (key > kth)).to(tl.int32)
        base = tl.atomic_add(ctr_ptr + 2, tl.sum(gt, 0))
        tl.store(out_ptr + tl.load(state_ptr + 2) + base + tl.cumsum(gt, 0) - 1, offs.to(tl.int32), mask=gt != 0)
        eq = (m & (key == kth)).to(tl.int32)
        rank = tl.load(starts_ptr + pid) + tl.cumsum(eq, 0) - 1
        take = (eq != 0) & (rank < tl.load(state_ptr + 4))
        tl.store(out_ptr + tl.load(state_ptr + 3) + rank, offs.to(tl.int32), mask=take)


@triton.jit
def above_threshold(bits_ptr, n, thr_ptr, out_ptr, ctr_ptr, cap, BLOCK: tl.constexpr):
    """Threshold reuse's one read: the indices of the keys ``>= *thr_ptr`` to ``out`` while it has
    room (``cap`` slots, in no order); ``ctr[0]`` counts them all."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
    hit = (m & (key >= tl.load(thr_ptr))).to(tl.int32)
    base = tl.atomic_add(ctr_ptr, tl.sum(hit, 0))
    pos = base + tl.cumsum(hit, 0) - 1
    tl.store(out_ptr + pos, offs.to(tl.int32), mask=(hit != 0) & (pos < cap))
