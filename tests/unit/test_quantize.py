"""The low-bit quantiser (docs/quantize.md#invariants): encoding, error feedback, the two-quantisation
bound of the reduce-scatter + all-gather exchange, SparseLoCo's top-k + 2-bit, on in-process ranks."""
import numpy as np
import pytest

from hvd_commopt import Compression, Schedule, run_ranks
from hvd_commopt.buckets import Bucket
from hvd_commopt.compress.quantize import decode, encode, encoded_bytes, levels
from hvd_commopt.reduce import QuantizedAllreduce, ReduceContext, RoundInfo
from tests.unit.schedule_helpers import OPS, NumpyHost, init_params, make_engine, one_step

N = 1000


def vec(rank, n=N, seed=0):
    return (np.random.RandomState(seed * 100 + rank).randn(n) * (1 + rank)).astype(np.float32)


def reference_encode(x, bits, block):
    """The encoding as first written (host NumPy, before the tensor-ops kernels): the bytes and
    values every adapter must reproduce exactly."""
    n, q = x.size, levels(bits)
    nb = -(-n // block)
    flat = np.zeros(nb * block, np.float32)
    flat[:n] = x
    xp = flat.reshape(nb, block)
    scale = (np.abs(xp).max(axis=1) / np.float32(q)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.clip(np.rint(xp / safe[:, None]), -q, q)
    dec = (codes * scale[:, None]).astype(np.float32).reshape(-1)[:n]
    c = (codes.reshape(-1)[:n] + q).astype(np.uint8)
    planes = np.unpackbits(c[:, None], axis=1, bitorder="little")[:, :bits]
    packed = c if bits == 8 else np.packbits(planes.reshape(-1), bitorder="little")
    return np.concatenate([scale.view(np.uint8), packed]), dec


def awkward_vec(n, seed=0):
    """Values with exact ties at half steps, zeros, a zero block and a huge block."""
    x = vec(0, n, seed)
    x[:64] = 0.0
    x[64:128] = np.arange(64, dtype=np.float32) * np.float32(0.5) - 16  # ties: half steps of the scale
    x[128:192] *= 1e30
    return x


@pytest.mark.parametrize("n", [0, 1, 7, 1001, 4099])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_numpy_kernels_give_the_reference_bytes_and_values(bits, n):
    x = awkward_vec(max(n, 200))[:n] if n >= 200 else vec(1, n)
    ref_buf, ref_dec = reference_encode(x, bits, 64)
    buf, dec = encode(OPS, x, bits, 64)
    np.testing.assert_array_equal(buf, ref_buf)
    np.testing.assert_array_equal(dec, ref_dec)
    np.testing.assert_array_equal(decode(OPS, buf, n, bits, 64), dec)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_encoding_round_trips_and_error_is_half_a_step(bits):
    x = vec(0, 1001)
    buf, dec = encode(OPS, x, bits, 64)
    assert buf.size == encoded_bytes(x.size, bits, 64)
    np.testing.assert_array_equal(decode(OPS, buf, x.size, bits, 64), dec)
    blocks = np.abs(np.pad(x, (0, -x.size % 64))).reshape(-1, 64).max(1) / levels(bits)
    assert (np.abs(x - dec) <= np.repeat(blocks, 64)[:x.size] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("density", [None, 0.1])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_feedback_keeps_exactly_what_was_not_sent(bits, density):
    """sent + residual == input, bit for bit (one rank: the result is what was sent)."""
    def body(comm):
        red = QuantizedAllreduce(bits, density=density, block=32)
        ctx = ReduceContext(comm, OPS)
        b = Bucket.single("g", N, "float32")
        x = vec(3)
        out = red.reduce(b, RoundInfo(0), x.copy(), ctx)
        r = red.memory.residual(OPS, "g", x)
        np.testing.assert_array_equal(out + r, x)
        x2 = vec(4)  # the next round sends x2 + r
        out2 = red.reduce(b, RoundInfo(1), x2.copy(), ctx)
        np.testing.assert_array_equal(out2 + red.memory.residual(OPS, "g", x2), x2 + r)
    run_ranks(1, body)


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_reduce_scatter_allgather_error_is_two_quantisations(P, bits):
    q = levels(bits)

    def body(comm):
        red = QuantizedAllreduce(bits, error_feedback=False)
        ctx = ReduceContext(comm, OPS, prescale=1.0, postscale=1.0)  # the sum
        return red.reduce(Bucket.single("g", N, "float32"), RoundInfo(0), vec(comm.rank), ctx)
    outs = run_ranks(P, body)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # every rank decodes the same bytes
    xs = [vec(r) for r in range(P)]
    exact = np.sum(xs, axis=0, dtype=np.float64)
    first = sum(np.abs(x).max() for x in xs) / (2 * q)          # each contribution quantised once
    second = (np.abs(exact).max() + first) / (2 * q)             # the owner's sum quantised once more
    err = np.abs(outs[0] - exact).max()
    assert err <= (first + second) * (1 + 1e-5)
    if P >= 3 and bits == 2:
        assert err > 0  # lossy indeed


def test_sparse_top_k_with_two_bits_is_one_quantisation_of_each_contribution():
    """SparseLoCo's one line: Compression.quantize(2, density=...)."""
    P, rho = 3, 0.05

    def body(comm):
        red = Compression.quantize(2, density=rho, block=16)
        ctx = ReduceContext(comm, OPS, prescale=1.0, postscale=1.0)
        return red.reduce(Bucket.single("g", N, "float32"), RoundInfo(0), vec(comm.rank), ctx)
    outs = run_ranks(P, body)
    want = np.zeros(N, np.float32)
    k = int(np.ceil(rho * N))
    for r in range(P):
        x = vec(r)
        idx = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
        _, dec = reference_encode(x[idx], 2, 16)
        want[idx] += dec
    for o in outs:
        np.testing.assert_array_equal(o, want)


def test_traffic_is_bits_over_32_of_the_dense_allreduce():
    def body(comm, comp):
        host = NumpyHost(init_params())
        eng = make_engine(comm, Schedule.sync(), host, compression=comp)
        before = comm.traffic.bytes_sent
        one_step(eng, host, comm.rank, 0)
        return comm.traffic.bytes_sent - before
    dense = run_ranks(2, body, None)[0]
    q4 = run_ranks(2, body, Compression.quantize(4, block=8))[0]
    # 24 floats: 96 bytes -> 12 bytes of codes + 3 scales; half of each goes to the peer, twice
    assert q4 < dense / 3


@pytest.mark.parametrize("sched", [Schedule.sync(), Schedule.ssd(delay=2, warmup_steps=1), Schedule.od(warmup_steps=1)])
def test_int8_on_gradients_tracks_the_uncompressed_run(sched):
    def body(comm, comp):
        host = NumpyHost(init_params(), momentum=0.9)
        eng = make_engine(comm, sched, host, compression=comp)
        for t in range(8):
            one_step(eng, host, comm.rank, t)
        eng.finalize()
        return {k: v.copy() for k, v in host.w.items()}
    ref = run_ranks(2, body, None)
    got = run_ranks(2, body, Compression.quantize(8))
    for a, b in zip(ref, got):
        for k in a:
            np.testing.assert_allclose(b[k], a[k], atol=2e-3)
