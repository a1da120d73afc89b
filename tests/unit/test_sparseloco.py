"""SparseLoCo's settings of the quantiser (docs/quantize.md#chunked, docs/quantize.md#ef-decay):
chunk-wise top-k, offsets packed in as few bits as the chunk needs (docs/quantize.md#offsets), and
error feedback with decay; exact values."""
import numpy as np
import pytest

from hvd_commopt import Compression, run_ranks
from hvd_commopt.buckets import Bucket, TensorSpec
from hvd_commopt.compress.chunked import (ChunkLayout, chunk_plan, chunk_starts, chunked_topk, offset_bits,
                                         offset_bytes, pack_offsets, unpack_offsets)
from hvd_commopt.compress.quantize import encoded_bytes
from hvd_commopt.errors import ConfigError
from hvd_commopt.memory.error_feedback import ErrorFeedback
from hvd_commopt.reduce import QuantizedAllreduce, ReduceContext, RoundInfo
from tests.unit.schedule_helpers import OPS
from tests.unit.test_quantize import reference_encode

# a bucket of three tensors: 3000 elements (chunks 1024, 1024, 952), 50x30 = 1500 (1024, 476), 7
BUCKET = Bucket.of(0, [TensorSpec("a", (3000,), "float32"), TensorSpec("b", (50, 30), "float32"),
                       TensorSpec("c", (7,), "float32")], name="g")
N = BUCKET.numel


def vec(rank, n=N, seed=0):
    return (np.random.RandomState(seed * 100 + rank).randn(n) * (1 + rank)).astype(np.float32)


def reference_chunked(x, plan):
    """Per chunk, the k largest |x| (stable: ties to the lower index), ascending positions."""
    out = []
    for s, e, k in plan:
        out.append(s + np.sort(np.argsort(-np.abs(x[s:e]), kind="stable")[:k]))
    return np.concatenate(out).astype(np.int64)


def test_chunk_plan_cuts_inside_each_tensor_and_keeps_ceil_density_per_chunk():
    plan = chunk_plan([3000, 1500, 7], 1024, 0.01)
    assert plan == [(0, 1024, 11), (1024, 2048, 11), (2048, 3000, 10), (3000, 4024, 11), (4024, 4500, 5),
                    (4500, 4507, 1)]
    assert chunk_plan([8], 4, 1.0) == [(0, 4, 4), (4, 8, 4)]  # density 1: every element
    assert chunk_starts([(0, 4, 2), (4, 6, 1)]).tolist() == [0, 0, 4]


def test_chunked_topk_picks_exactly_k_per_chunk_the_largest_of_each():
    x = vec(0)
    x[100:140] = 0.5  # ties inside a chunk: the lower indices win
    x[3000:4024] *= 1e-3  # a chunk of small values still sends its k
    plan = chunk_plan([3000, 1500, 7], 1024, 0.01)
    idx, local = chunked_topk(OPS, x, plan)
    np.testing.assert_array_equal(idx, reference_chunked(x, plan))
    np.testing.assert_array_equal(idx - local, chunk_starts(plan))
    for s, e, k in plan:
        inside = idx[(idx >= s) & (idx < e)]
        assert inside.size == k
        assert np.abs(x[inside]).min() >= np.abs(np.delete(x[s:e], inside - s)).max(initial=0)


@pytest.mark.parametrize("P", [1, 2, 3])
def test_chunked_reducer_sums_each_ranks_quantised_chunk_topk_exactly(P):
    rho, chunk = 0.01, 1024

    def body(comm):
        red = Compression.quantize(2, density=rho, chunk=chunk, block=16)
        ctx = ReduceContext(comm, OPS, prescale=1.0, postscale=1.0)
        out = red.reduce(BUCKET, RoundInfo(0), vec(comm.rank), ctx)
        return out, red.memory.residual(OPS, "g", out)
    outs = run_ranks(P, body)
    plan = chunk_plan([3000, 1500, 7], chunk, rho)
    want = np.zeros(N, np.float32)
    for r in range(P):
        x = vec(r)
        idx = reference_chunked(x, plan)
        _, dec = reference_encode(x[idx], 2, 16)
        want[idx] += dec
        # sent + residual == input, bit for bit
        sent = np.zeros(N, np.float32)
        sent[idx] = dec
        np.testing.assert_array_equal(sent + outs[r][1], x)
    for out, _ in outs:
        np.testing.assert_array_equal(out, want)


def reference_pack(offs, bits):
    """The packing's specification in plain Python: ``bits`` <= 8 one little-endian bit stream
    (offset i at bit i*bits); above 8 the low bytes, then the high ``bits - 8`` bits as such a stream."""
    def stream(vals, b):
        acc = 0
        for i, v in enumerate(vals):
            acc |= int(v) << (i * b)
        return acc.to_bytes((len(vals) * b + 7) // 8, "little")
    if bits <= 8:
        return stream(offs, bits)
    return bytes(int(v) & 255 for v in offs) + stream([int(v) >> 8 for v in offs], bits - 8)


@pytest.mark.parametrize("bits", range(0, 17))
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5, 7, 8, 9, 41, 1000, 1001])
def test_pack_offsets_round_trips_every_width_and_count_in_exactly_ceil_k_bits_bytes(bits, k):
    rng = np.random.RandomState(bits * 1000 + k)
    offs = rng.randint(0, 1 << bits, size=k).astype(np.int64)
    if k >= 2:  # both edges of the range
        offs[0], offs[-1] = 0, (1 << bits) - 1
    keep = offs.copy()
    buf = pack_offsets(OPS, offs, bits)
    np.testing.assert_array_equal(offs, keep)  # the input is left intact
    assert buf.dtype == np.uint8 and buf.size == offset_bytes(k, bits) == -(-k * bits // 8)
    assert buf.tobytes() == reference_pack(offs, bits)
    back = unpack_offsets(OPS, buf, k, bits, like=offs)
    assert back.dtype == np.int64
    np.testing.assert_array_equal(back, offs)


def test_offset_bits_is_the_bit_length_of_the_longest_chunks_last_offset():
    assert offset_bits(chunk_plan([10_000], 4096, 0.01)) == 12
    assert offset_bits(chunk_plan([4096], 4096, 0.01)) == 12
    assert offset_bits(chunk_plan([4097], 4096, 0.01)) == 12
    assert offset_bits(chunk_plan([3000, 1500, 7], 1024, 0.01)) == 10
    assert offset_bits(chunk_plan([64, 30], 4096, 0.01)) == 6  # tensors shorter than a chunk
    assert offset_bits(chunk_plan([65], 4096, 0.01)) == 7
    assert offset_bits(chunk_plan([256, 3], 4096, 0.5)) == 8
    assert offset_bits(chunk_plan([257], 4096, 0.5)) == 9
    assert offset_bits(chunk_plan([5, 3], 1, 1.0)) == 0  # chunks of one element: the offset is always 0
    assert offset_bits(chunk_plan([2], 1, 1.0)) == 0
    assert offset_bits(chunk_plan([2], 2, 1.0)) == 1
    assert offset_bits(chunk_plan([1 << 15], 1 << 15, 0.01)) == 15
    assert offset_bits([]) == 0


def test_chunked_wire_bytes_are_packed_offsets_then_the_codes():
    """Per rank and round: ceil(k*b/8) bytes of offsets (b = 10 bits for chunks of 1024), then the
    scales and the codes, nothing else; without chunks 4 bytes per index."""
    rho = 0.01

    def body(comm, chunk):
        red = QuantizedAllreduce(2, density=rho, chunk=chunk, block=16)
        ctx = ReduceContext(comm, OPS)
        before = comm.traffic.bytes_sent
        red.reduce(BUCKET, RoundInfo(0), vec(comm.rank), ctx)
        return comm.traffic.bytes_sent - before
    k = sum(c for _, _, c in chunk_plan([3000, 1500, 7], 1024, rho))
    assert k == 49
    chunked_bytes = run_ranks(2, body, 1024)[0]
    whole = run_ranks(2, body, None)[0]
    kw = int(np.ceil(rho * N))
    assert chunked_bytes == 62 + encoded_bytes(k, 2, 16) == (49 * 10 + 7) // 8 + encoded_bytes(k, 2, 16)
    assert whole == 4 * kw + encoded_bytes(kw, 2, 16)


@pytest.mark.parametrize("P", [1, 2, 3])
def test_sparseloco_wire_at_chunk_4096_is_12_bits_per_offset(P):
    """SparseLoCo's setting: 1.5 bytes per offset, 2-bit codes, a scale per 256; the bytes a rank
    sends per round, exactly: its message to each of the P - 1 others (the allgather)."""
    bucket = Bucket.of(0, [TensorSpec("w", (5000,), "float32"), TensorSpec("b", (300,), "float32")], name="g")
    plan = chunk_plan([5000, 300], 4096, 0.01)
    k = sum(c for _, _, c in plan)
    assert (k, offset_bits(plan)) == (41 + 10 + 3, 12)

    def body(comm):
        red = Compression.quantize(2, density=0.01, chunk=4096, ef_decay=0.95)
        before = comm.traffic.bytes_sent
        red.reduce(bucket, RoundInfo(0), vec(comm.rank, bucket.numel), ReduceContext(comm, OPS))
        return comm.traffic.bytes_sent - before
    per_rank = 81 + encoded_bytes(k, 2, 256)
    assert per_rank == 81 + 4 + 14
    for sent in run_ranks(P, body):
        assert sent == (P - 1) * per_rank


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("chunk, rho", [(1024, 0.01), (4096, 0.03), (1, 1.0), (2, 0.5), (300, 1.0)])
def test_packed_offsets_give_the_int16_wires_results_bit_for_bit(P, chunk, rho, monkeypatch):
    """The packing is lossless: over several rounds (error feedback carried) the results and the
    residuals equal those of 16-bit offsets (the int16 wire's width) bit for bit, at every width."""
    def body(comm):
        red = QuantizedAllreduce(2, density=rho, chunk=chunk, block=16, ef_decay=0.95)
        ctx = ReduceContext(comm, OPS, postscale=1.0 / comm.size)
        outs = []
        for t in range(3):
            x = vec(comm.rank, seed=t)
            outs.append(red.reduce(BUCKET, RoundInfo(t), x.copy(), ctx).copy())
            outs.append(red.memory.residual(OPS, "g", x).copy())
        return outs
    packed = run_ranks(P, body)
    monkeypatch.setattr("hvd_commopt.compress.chunked.offset_bits", lambda plan: 16)
    wide = run_ranks(P, body)
    for a, b in zip(packed, wide):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [None, 1024])
@pytest.mark.parametrize("post", ["average", 1.0])
def test_mean_over_senders_divides_each_coordinate_by_the_ranks_that_sent_it(P, chunk, post):
    """SparseLoCo's rule: the sum of the decoded contributions at a coordinate, times
    float32(postscale * P / c), c the number of ranks that selected it (0 where none did); for an
    average (postscale 1/P) the mean over the senders. The residuals are the sender's own: the
    rule changes what is received, not what is sent."""
    rho = 0.05
    scale = 1.0 / P if post == "average" else post

    def body(comm, rule):
        red = QuantizedAllreduce(2, density=rho, chunk=chunk, block=16, mean_over=rule)
        ctx = ReduceContext(comm, OPS, postscale=scale)
        x = vec(comm.rank)
        out = red.reduce(BUCKET, RoundInfo(0), x.copy(), ctx)
        return out, red.memory.residual(OPS, "g", x).copy()
    got = run_ranks(P, body, "senders")
    plain = run_ranks(P, body, "ranks")
    total = np.zeros(N, np.float32)
    count = np.zeros(N, np.int64)
    for r in range(P):
        x = vec(r)
        if chunk is None:
            k = int(np.ceil(rho * N))
            idx = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
        else:
            idx = reference_chunked(x, chunk_plan([3000, 1500, 7], chunk, rho))
        _, dec = reference_encode(x[idx], 2, 16)
        total[idx] += dec
        count[idx] += 1
    factor = np.zeros(N, np.float32)
    factor[count > 0] = (scale * P / count[count > 0]).astype(np.float32)
    want = total * factor
    if P == 1:  # one rank: its own decoded selection, scaled as the op asks
        want = total * np.float32(scale) if scale != 1.0 else total
    for (out, res), (_, res_plain) in zip(got, plain):
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(res, res_plain)
    if P > 1:
        assert (count == P).sum() < (count > 0).sum()  # some coordinates were sent by fewer than P ranks


def test_mean_over_is_in_the_config_and_the_repr():
    red = Compression.quantize(2, density=0.01, chunk=4096, mean_over="senders")
    assert red.config()["mean_over"] == "senders" and "mean_over='senders'" in repr(red)
    plain = Compression.quantize(2, density=0.01)
    assert plain.config()["mean_over"] == "ranks" and "mean_over" not in repr(plain)


def per_chunk_topk(ops, x, plan):
    """The chunk-wise top-k as it was built first: one ``topk_abs`` per chunk (the batched
    selection's reference, bit for bit)."""
    offs = [ops.topk_abs(ops.slice(x, s, e), k)[1] if k < e - s else ops.arange(e - s, like=x) for s, e, k in plan]
    local = offs[0] if len(offs) == 1 else ops.cat(offs)
    return ops.add(ops.from_numpy(chunk_starts(plan), like=local), local), local


LAYOUTS = [  # (tensor sizes, chunk, density): tails, tensors shorter than a chunk, one-element chunks
    ([3000, 1500, 7], 1024, 0.01), ([4096, 4096], 4096, 0.01), ([10000, 64, 64, 300, 1], 4096, 0.01),
    ([5, 3, 9], 1, 1.0), ([33, 17], 8, 0.5), ([2048, 100, 2048], 1024, 0.03), ([1000], 4096, 1.0), ([7, 1, 2], 2, 0.3),
]


def awkward(n, seed):
    """Values with ties (repeated magnitudes of both signs), +0 and -0, and a spread of scales."""
    rng = np.random.RandomState(seed)
    x = (rng.randn(n) * 10.0 ** rng.randint(-3, 3, size=n)).astype(np.float32)
    x[rng.randint(0, n, size=n // 5)] = 0.5
    x[rng.randint(0, n, size=n // 5)] = -0.5
    x[rng.randint(0, n, size=n // 7)] = 0.0
    x[rng.randint(0, n, size=n // 7)] = -0.0
    return x


@pytest.mark.parametrize("sizes, chunk, rho", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_chunk_topk_equals_one_topk_per_chunk_bit_for_bit(sizes, chunk, rho, seed):
    plan = chunk_plan(sizes, chunk, rho)
    x = awkward(sum(sizes), seed)
    layout = ChunkLayout(plan)
    want_idx, want_local = per_chunk_topk(OPS, x, plan)
    for _ in range(2):  # the second call reuses the layout's maps
        idx, local = layout.select(OPS, x)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(local, want_local)
        assert idx.dtype == local.dtype == np.int64
    np.testing.assert_array_equal(idx, reference_chunked(x, plan))
    assert layout.k == idx.size and layout.bits == offset_bits(plan)


def test_batched_chunk_topk_groups_rows_by_width_and_never_selects_a_pad():
    """A chunk of zeros beside pads: its k entries are its own first positions (a pad ranks after a
    zero); the groups are the full chunks and the power-of-two widths of the short ones."""
    plan = chunk_plan([4096, 4096, 3000, 64, 5], 4096, 0.01)
    layout = ChunkLayout(plan)
    assert [(g.full, g.width, len(g.rows)) for g in layout.groups] == [(False, 8, 1), (False, 64, 1),
                                                                       (False, 4096, 1), (True, 4096, 2)]
    assert layout.groups[-1].runs == [(0, 8192)]  # two full chunks of one buffer: one slice
    x = np.zeros(sum([4096, 4096, 3000, 64, 5]), np.float32)
    idx, _ = layout.select(OPS, x)
    np.testing.assert_array_equal(idx, reference_chunked(x, plan))
    assert idx[-1] == 4096 * 2 + 3000 + 64  # the 5-element tensor's first entry, not a pad


def test_the_reducer_plans_each_bucket_layout_once(monkeypatch):
    calls = []
    real = chunk_plan
    monkeypatch.setattr("hvd_commopt.reduce.quantized.chunk_plan", lambda *a: calls.append(a) or real(*a))
    red = QuantizedAllreduce(2, density=0.01, chunk=1024, block=16)

    def body(comm):
        for t in range(3):
            red.reduce(BUCKET, RoundInfo(t), vec(0, seed=t), ReduceContext(comm, OPS))
    run_ranks(1, body)
    assert len(calls) == 1


def test_error_feedback_decay_scales_the_residual_exactly():
    """acc = flat + float32(beta * r): the residual decays by beta before it is added."""
    beta = np.float32(0.95)

    def body(comm):
        red = QuantizedAllreduce(2, density=0.05, chunk=256, block=8, ef_decay=0.95)
        ctx = ReduceContext(comm, OPS)
        x1, x2, x3 = vec(1), vec(2), vec(3)
        out1 = red.reduce(BUCKET, RoundInfo(0), x1.copy(), ctx)
        r1 = red.memory.residual(OPS, "g", x1).copy()
        np.testing.assert_array_equal(out1 + r1, x1)  # nothing to decay in the first round
        out2 = red.reduce(BUCKET, RoundInfo(1), x2.copy(), ctx)
        r2 = red.memory.residual(OPS, "g", x2).copy()
        np.testing.assert_array_equal(out2 + r2, x2 + (r1 * beta).astype(np.float32))
        out3 = red.reduce(BUCKET, RoundInfo(2), x3.copy(), ctx)
        np.testing.assert_array_equal(out3 + red.memory.residual(OPS, "g", x3), x3 + r2 * beta)
    run_ranks(1, body)


def test_decay_one_is_the_plain_error_feedback_bit_for_bit():
    def body(comm, kw):
        red = QuantizedAllreduce(4, density=0.05, block=8, **kw)
        ctx = ReduceContext(comm, OPS)
        return [red.reduce(BUCKET, RoundInfo(t), vec(comm.rank, seed=t), ctx) for t in range(4)]
    for a, b in zip(run_ranks(2, body, {"ef_decay": 1.0})[0], run_ranks(2, body, {})[0]):
        np.testing.assert_array_equal(a, b)
    plain = QuantizedAllreduce(4, density=0.05)
    assert plain.memory.decay == 1.0 and "ef_decay" not in repr(plain)


def test_fused_compensate_select_decays_like_compensate():
    """The sparse reducers' fused path (compensate + select + update) with a decay gives what
    compensate, a selection and update give."""
    beta, n = 0.9, 64
    r0 = vec(0, n)

    def select(acc, addend, out=None):  # the top 8 of acc + addend
        s = acc + addend if addend is not None else acc
        idx = np.sort(np.argsort(-np.abs(s), kind="stable")[:8])
        return s[idx], idx, s
    fused, split = ErrorFeedback(decay=beta), ErrorFeedback(decay=beta)
    for m in (fused, split):
        m.load_state_dict({"residuals": {"g": r0.copy()}})
    g = vec(1, n)
    vals, idx = fused.compensate_select(OPS, "g", g.copy(), select)
    acc = split.compensate(OPS, "g", g.copy())
    np.testing.assert_array_equal(acc, g + (r0 * np.float32(beta)).astype(np.float32))
    split.update(OPS, "g", acc, idx)
    np.testing.assert_array_equal(vals, acc[idx])
    np.testing.assert_array_equal(fused.residual(OPS, "g", g), split.residual(OPS, "g", g))


@pytest.mark.parametrize("make, match", [
    (lambda: Compression.quantize(2, density=0.01, chunk=0), "chunk must be"),
    (lambda: Compression.quantize(2, density=0.01, chunk=40000), "15 bits"),
    (lambda: Compression.quantize(2, density=0.01, chunk=True), "chunk must be"),
    (lambda: Compression.quantize(2, chunk=4096), "needs a density"),
    (lambda: Compression.quantize(2, density=0.01, ef_decay=0), r"\(0, 1\]"),
    (lambda: Compression.quantize(2, density=0.01, ef_decay=1.5), "0.95"),
    (lambda: ErrorFeedback(decay=True), "decay"),
    (lambda: Compression.quantize(2, density=0.01, mean_over="all"), "'ranks'.*'senders'"),
    (lambda: Compression.quantize(2, mean_over="senders"), "needs a density"),
])
def test_bad_sparseloco_settings_get_one_clear_error(make, match):
    with pytest.raises(ConfigError, match=match):
        make()
