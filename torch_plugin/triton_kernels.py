"""The Triton kernels of torch_plugin/triton_select.py (docs/selection.md#triton-select), in a module
of their own so that importing the torch adapter does not import Triton: triton_select loads this
module on its first selection. Keys are the magnitude bits of float32 (``bits & 0x7FFFFFFF``, every
NaN one key above +Inf); the launches and what they compute are described in triton_select.

The radix select keeps its state in a small int32 tensor (the slots ``S_*`` below), written by the
one-program :func:`find_bin` and read by the kernels after it, so no torch op runs between the
launches. Every kernel but the first histogram is gated (``MODE``, :func:`_gate`): a program whose
gate is clear returns at once, so a path not taken costs its launch only."""
import triton
import triton.language as tl

__all__ = ["add_histogram", "histogram", "find_bin", "split", "cand_histogram", "cand_write", "count_equal",
           "write_overflow", "above_threshold", "add_above_threshold"]

# the state's slots: the bin, the count above it and how many more are needed, per radix level
# (level 1: the top 11 bits, 2: the next 11, 3: the last 9), then the k-th key, the count of keys
# equal to it, and whether those straddle the k-th (a tie the candidate buffer cannot order)
# (constexpr: the kernels read them as compile-time constants)
S_B1, S_ABOVE1, S_REM1, S_B2, S_B3 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3), tl.constexpr(6)
S_REM3, S_KTH, S_EQ, S_TIE = tl.constexpr(8), tl.constexpr(9), tl.constexpr(10), tl.constexpr(11)
STATE = 12
# gates (MODE): 0 the caller's gate; 1 the candidates fit their buffer; 2 they fit and no tie
# straddles the k-th (the fix-up in the buffer); 3 they overflow or a tie straddles (the radix
# select finished on the data, ties in index order)
ALWAYS, FITS, FITS_NO_TIE, ON_DATA = 0, 1, 2, 3


@triton.jit
def _key(bits):
    key = bits & 0x7FFFFFFF
    return tl.where(key > 0x7F800000, 0x7F800001, key)


@triton.jit
def _gate(gate_ptr, state_ptr, ctr_ptr, cap, MODE: tl.constexpr):
    on = tl.load(gate_ptr) != 0
    if MODE == 1:
        on = on & (tl.load(ctr_ptr + 1) <= cap)
    if MODE == 2:
        on = on & (tl.load(ctr_ptr + 1) <= cap) & (tl.load(state_ptr + S_TIE) == 0)
    if MODE == 3:
        on = on & ((tl.load(ctr_ptr + 1) > cap) | (tl.load(state_ptr + S_TIE) != 0))
    return on


@triton.jit
def _digit(key, m, state_ptr, LEVEL: tl.constexpr):
    """(the key's digit at radix LEVEL, the mask of the keys under the prefix found so far)."""
    if LEVEL == 1:
        digit = key >> 20
    elif LEVEL == 2:
        digit = (key >> 9) & 2047
        m = m & ((key >> 20) == tl.load(state_ptr + S_B1))
    else:
        digit = key & 511
        m = m & ((key >> 9) == ((tl.load(state_ptr + S_B1) << 11) | tl.load(state_ptr + S_B2)))
    return digit, m


@triton.jit
def _count(digit, m, hist_ptr, BINS: tl.constexpr):
    h = tl.histogram(digit, BINS, mask=m)
    tl.atomic_add(hist_ptr + tl.arange(0, BINS), h, mask=h > 0, sem="relaxed")


@triton.jit
def histogram(bits_ptr, n, hist_ptr, gate_ptr, state_ptr, ctr_ptr, cap, LEVEL: tl.constexpr,
              BINS: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """hist[digit] += 1 over the keys of the data under the prefix found so far (LEVEL), gated."""
    if _gate(gate_ptr, state_ptr, ctr_ptr, cap, MODE):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
        digit, m = _digit(key, m, state_ptr, LEVEL)
        _count(digit, m, hist_ptr, BINS)


@triton.jit
def _sum_key(a_ptr, b_ptr, dst_ptr, offs, m):
    """The key of ``a + b`` (float32, formed in registers), the sum stored to ``dst``: the error
    feedback's add fused into the kernel's read (docs/selection.md#triton-fused-ef). Added as
    ``b + a``, the operand order of ATen's ``a.add_(b)`` (``alpha * b + a``), which decides which
    NaN's payload a sum of two NaNs keeps on the CPU (the interpreter); CUDA returns one NaN."""
    s = tl.load(b_ptr + offs, mask=m, other=0.0) + tl.load(a_ptr + offs, mask=m, other=0.0)
    tl.store(dst_ptr + offs, s, mask=m)
    return _key(s.to(tl.int32, bitcast=True))


@triton.jit
def add_histogram(a_ptr, b_ptr, dst_ptr, n, hist_ptr, BLOCK: tl.constexpr):
    """:func:`histogram` of level 1 over ``a + b``, the sum written to ``dst`` (which may be a)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    key = _sum_key(a_ptr, b_ptr, dst_ptr, offs, m)
    _count(key >> 20, m, hist_ptr, 2048)


@triton.jit
def find_bin(hist_ptr, state_ptr, gate_ptr, ctr_ptr, cap, k, LEVEL: tl.constexpr, BINS: tl.constexpr,
             MODE: tl.constexpr):
    """One program: the bin of the ``need``-th largest key of a histogram (need: k at level 1, else
    the previous level's ``rem``), the count in the bins above it and ``rem = need - above`` into
    the state; at level 3 also the k-th key, the count equal to it and (MODE 1) the tie flag."""
    if _gate(gate_ptr, state_ptr, ctr_ptr, cap, MODE):
        bins = tl.arange(0, BINS)
        h = tl.load(hist_ptr + bins)
        if LEVEL == 1:
            need = k
        else:
            need = tl.load(state_ptr + 3 * LEVEL - 4)  # S_REM1 or S_REM2
        at_least = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # keys with digit >= b
        b = tl.maximum(tl.sum((at_least >= need).to(tl.int32), 0) - 1, 0)
        hb = tl.sum(tl.where(bins == b, h, 0), 0)
        above = tl.sum(tl.where(bins == b, at_least, 0), 0) - hb
        base = state_ptr + 3 * LEVEL - 3
        tl.store(base, b)
        tl.store(base + 1, above)
        tl.store(base + 2, need - above)
        if LEVEL == 3:
            kth = (tl.load(state_ptr + S_B1) << 20) | (tl.load(state_ptr + S_B2) << 9) | b
            tl.store(state_ptr + S_KTH, kth)
            tl.store(state_ptr + S_EQ, hb)
            if MODE == 1:
                tl.store(state_ptr + S_TIE, (hb > need - above).to(tl.int32))


@triton.jit
def split(bits_ptr, n, state_ptr, out_ptr, cand_idx_ptr, cand_key_ptr, ctr_ptr, gate_ptr, CAP: tl.constexpr,
          BLOCK: tl.constexpr):
    """Keys in bins above ``state[S_B1]``: their indices to ``out`` (slots from ``ctr[0]``); keys in
    that bin: (index, key) to the candidate buffer while it has room (``ctr[1]`` counts all); gated."""
    if tl.load(gate_ptr) != 0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
        b = tl.load(state_ptr + S_B1)
        d = key >> 20
        sure = (m & (d > b)).to(tl.int32)
        base = tl.atomic_add(ctr_ptr, tl.sum(sure, 0))
        pos = base + tl.cumsum(sure, 0) - 1
        tl.store(out_ptr + pos, offs.to(tl.int32), mask=sure != 0)
        cand = (m & (d == b)).to(tl.int32)
        cbase = tl.atomic_add(ctr_ptr + 1, tl.sum(cand, 0))
        cpos = cbase + tl.cumsum(cand, 0) - 1
        ok = (cand != 0) & (cpos < CAP)
        tl.store(cand_idx_ptr + cpos, offs.to(tl.int32), mask=ok)
        tl.store(cand_key_ptr + cpos, key, mask=ok)


@triton.jit
def cand_histogram(cand_key_ptr, hist_ptr, gate_ptr, state_ptr, ctr_ptr, cap, LEVEL: tl.constexpr,
                   BINS: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`histogram` (levels 2, 3) over the candidate buffer's ``ctr[1]`` keys, when they fit."""
    if _gate(gate_ptr, state_ptr, ctr_ptr, cap, 1):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < tl.load(ctr_ptr + 1)
        digit, m = _digit(tl.load(cand_key_ptr + offs, mask=m, other=0), m, state_ptr, LEVEL)
        _count(digit, m, hist_ptr, BINS)


@triton.jit
def cand_write(cand_idx_ptr, cand_key_ptr, gate_ptr, state_ptr, ctr_ptr, cap, out_ptr, BLOCK: tl.constexpr):
    """The fix-up in the candidate buffer (no tie straddles the k-th, so every key ``>=`` it is
    taken): their indices to ``out`` from slot ``state[S_ABOVE1]`` (``ctr[2]`` reserves)."""
    if _gate(gate_ptr, state_ptr, ctr_ptr, cap, 2):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < tl.load(ctr_ptr + 1)
        take = (m & (tl.load(cand_key_ptr + offs, mask=m, other=0) >= tl.load(state_ptr + S_KTH))).to(tl.int32)
        base = tl.atomic_add(ctr_ptr + 2, tl.sum(take, 0))
        pos = tl.load(state_ptr + S_ABOVE1) + base + tl.cumsum(take, 0) - 1
        tl.store(out_ptr + pos, tl.load(cand_idx_ptr + offs, mask=take != 0), mask=take != 0)


@triton.jit
def count_equal(bits_ptr, n, gate_ptr, state_ptr, ctr_ptr, cap, counts_ptr, BLOCK: tl.constexpr):
    """Per program: how many keys equal the k-th ``state[S_KTH]`` (gated: on the data)."""
    if _gate(gate_ptr, state_ptr, ctr_ptr, cap, 3):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
        eq = (m & (key == tl.load(state_ptr + S_KTH))).to(tl.int32)
        tl.store(counts_ptr + tl.program_id(0), tl.sum(eq, 0))


@triton.jit
def write_overflow(bits_ptr, n, gate_ptr, state_ptr, ctr_ptr, cap, starts_ptr, out_ptr, BLOCK: tl.constexpr):
    """The candidates' part of the selection finished on the data (gated): keys of the k-th's
    top bin above the exact k-th key from slot ``S_ABOVE1`` on; keys equal to it in index order
    (the program's exclusive start ``starts[pid]``), the first ``S_REM3``, after those."""
    if _gate(gate_ptr, state_ptr, ctr_ptr, cap, 3):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        key = _key(tl.load(bits_ptr + offs, mask=m, other=0))
        b, kth = tl.load(state_ptr + S_B1), tl.load(state_ptr + S_KTH)
        above1, rem1, rem3 = tl.load(state_ptr + S_ABOVE1), tl.load(state_ptr + S_REM1), tl.load(state_ptr + S_REM3)
        gt = (m & ((key >> 20) == b) & (key > kth)).to(tl.int32)
        base = tl.atomic_add(ctr_ptr + 2, tl.sum(gt, 0))
        tl.store(out_ptr + above1 + base + tl.cumsum(gt, 0) - 1, offs.to(tl.int32), mask=gt != 0)
        eq = (m & (key == kth)).to(tl.int32)
        rank = tl.load(starts_ptr + pid) + tl.cumsum(eq, 0) - 1
        take = (eq != 0) & (rank < rem3)
        tl.store(out_ptr + above1 + rem1 - rem3 + rank, offs.to(tl.int32), mask=take)


@triton.jit
def _above(key, m, offs, thr_ptr, out_ptr, ctr_ptr, cap):
    hit = (m & (key >= tl.load(thr_ptr))).to(tl.int32)
    base = tl.atomic_add(ctr_ptr, tl.sum(hit, 0))
    pos = base + tl.cumsum(hit, 0) - 1
    tl.store(out_ptr + pos, offs.to(tl.int32), mask=(hit != 0) & (pos < cap))


@triton.jit
def above_threshold(bits_ptr, n, thr_ptr, out_ptr, ctr_ptr, cap, BLOCK: tl.constexpr):
    """Threshold reuse's one read: the indices of the keys ``>= *thr_ptr`` to ``out`` while it has
    room (``cap`` slots, in no order); ``ctr[0]`` counts them all."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    _above(_key(tl.load(bits_ptr + offs, mask=m, other=0)), m, offs, thr_ptr, out_ptr, ctr_ptr, cap)


@triton.jit
def add_above_threshold(a_ptr, b_ptr, dst_ptr, n, thr_ptr, out_ptr, ctr_ptr, cap, BLOCK: tl.constexpr):
    """:func:`above_threshold` of ``a + b``, the sum written to ``dst`` (which may be a)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    _above(_sum_key(a_ptr, b_ptr, dst_ptr, offs, m), m, offs, thr_ptr, out_ptr, ctr_ptr, cap)
