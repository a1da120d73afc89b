"""One message per sparse bucket (docs/topk.md#one-message): the byte view round-trips every
dtype bit-exactly, a packed allgather returns bit for bit what separate allgathers of values and
indices return (uneven k per rank included), and a Top-k bucket is exactly one collective with the
bytes of the traffic formula."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, run_ranks
from hvd_commopt.dtypes import float32_to_half
from hvd_commopt.errors import RankMismatchError
from hvd_commopt.reduce import ReduceContext
from hvd_commopt.reduce.packed import pack_parts, unpack_gathered
from tests.reducers import start

ops = NumpyOps()
VALUE_DTYPES = ["float32", "float64", "float16", "bfloat16"]
SPECIALS = [0.0, -0.0, 1e-45, -1e-40, 6e-8, np.inf, -np.inf, 3.0e38, -1.5, 65504.0]


def special_values(dtype: str, n: int = 37, seed: int = 0) -> np.ndarray:
    """Normals, signed zeros, denormals, infinities and NaNs with payloads, in ``dtype``'s host form."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 100
    x[:len(SPECIALS)] = SPECIALS
    if dtype == "bfloat16":
        bits = float32_to_half(x, np.uint16)
        bits[-3:] = [0x7FC1, 0xFF81, 0x7F80 | 0x15]  # NaNs with payloads (quiet, negative, signalling)
        return bits
    with np.errstate(over="ignore"):  # 3e38 is +-inf in float16 on purpose
        a = x.astype(dtype)
    nan_bits = {"float16": [0x7E01, 0xFC03], "float32": [0x7FC00001, 0xFF800123],
                "float64": [0x7FF8000000000001, 0xFFF0000000000123]}[dtype]
    a.view(f"uint{a.itemsize * 8}")[-2:] = nan_bits
    return a


@pytest.mark.parametrize("dtype", VALUE_DTYPES + ["int32", "int64", "uint8"])
def test_numpy_byte_view_round_trips_bit_exactly(dtype):
    a = special_values(dtype) if dtype in VALUE_DTYPES else np.arange(-5, 32).astype(dtype)
    b = ops.as_bytes(a)
    assert b.dtype == np.uint8 and b.shape == (a.nbytes,)
    back = ops.from_bytes(b, dtype)
    assert back.dtype == a.dtype and back.tobytes() == a.tobytes()
    assert ops.from_bytes(ops.as_bytes(a[:0]), dtype).size == 0


@pytest.mark.parametrize("vdt", VALUE_DTYPES)
@pytest.mark.parametrize("idt", ["int32", "int64"])
@pytest.mark.parametrize("P", [1, 2, 3])
def test_packed_allgather_equals_two_allgathers(P, vdt, idt):
    ks = [5, 0, 11][:P]  # uneven and empty selections (DGC's k varies by rank)

    def body(comm):
        k = ks[comm.rank]
        vals = special_values(vdt, 37, seed=comm.rank)[:k]
        idx = (np.arange(k) * 7 + comm.rank).astype(idt)
        packed = comm.wait(comm.allgather_tensor_async(ops, pack_parts(ops, (vals, idx)), "packed"))
        got_v, got_i = unpack_gathered(ops, packed[0], packed[1], (ops.dtype_name(vals), idt))
        want_v = comm.wait(comm.allgather_tensor_async(ops, vals, "v"))[0]
        want_i = comm.wait(comm.allgather_tensor_async(ops, idx, "i"))[0]
        return got_v, got_i, want_v, want_i

    for got_v, got_i, want_v, want_i in run_ranks(P, body):
        assert got_v.dtype == want_v.dtype and got_v.tobytes() == want_v.tobytes()
        assert got_i.dtype == want_i.dtype and np.array_equal(got_i, want_i)


def test_unpack_refuses_a_message_of_the_wrong_width():
    with pytest.raises(ValueError, match="disagree on the dtypes"):
        unpack_gathered(ops, np.zeros(10, np.uint8), [10], ("float32", "int32"))


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("P", [2, 3])
def test_a_topk_bucket_is_one_collective(P, index_dtype):
    n, k = 1000, 10

    def body(comm):
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        red = Compression.topk(k / n, index_dtype=index_dtype, min_k=1)
        comm.traffic.reset()
        p = start(red, "b", x, ctx)
        out = red.finish(p, ctx)
        return len(p.handles), comm.traffic.snapshot(), out

    w = 4 + (4 if index_dtype == "int32" else 8)
    for handles, stats, out in run_ranks(P, body):
        assert handles == 1 and stats["collectives"] == 1
        assert stats["bytes_sent"] == (P - 1) * k * w and stats["bytes_received"] == (P - 1) * k * w
        assert np.count_nonzero(out) <= P * k


def test_equal_size_allgather_is_the_general_one_and_checks_its_promise():
    # docs/topk.md#equal-sizes: the in-process backend keeps the promise honest
    def body(comm):
        x = np.arange(6, dtype=np.float32) + comm.rank
        fast = comm.wait(comm.allgather_tensor_async(ops, x, "eq", equal=True))
        slow = comm.wait(comm.allgather_tensor_async(ops, x, "gen"))
        with pytest.raises(RankMismatchError, match="k differs across ranks"):
            comm.wait(comm.allgather_async(x[:comm.rank + 1], "uneven", equal=True))
        return fast, slow

    for (fo, fc), (so, sc) in run_ranks(3, body):
        assert fc == sc == [6, 6, 6] and fo.tobytes() == so.tobytes()


@pytest.mark.parametrize("make, equal", [
    (lambda: Compression.topk(0.01, min_k=1), True),
    (lambda: Compression.dgc(0.01, momentum=0.9, selection="exact"), True),
    (lambda: Compression.topk(0.01, min_k=1, selection="threshold"), False),
    (lambda: Compression.dgc(0.01, momentum=0.9), False),
])
def test_only_the_exact_selection_promises_equal_sizes(make, equal):
    calls = []

    def body(comm):
        backend = comm.backend
        plain, promised = backend.allgather, backend.allgather_equal
        backend.allgather = lambda *a, **kw: (calls.append("general"), plain(*a, **kw))[1]
        backend.allgather_equal = lambda *a, **kw: (calls.append("equal"), promised(*a, **kw))[1]
        x = np.random.default_rng(comm.rank).standard_normal(1000).astype(np.float32)
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        red = make()
        red.finish(start(red, "b", x, ctx), ctx)

    run_ranks(2, body)
    assert calls == ["equal" if equal else "general"] * 2
