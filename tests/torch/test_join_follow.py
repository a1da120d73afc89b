"""join()'s follower on torch.distributed (torch_plugin/join_follow.py, docs/horovod_api.md#join):
what a collective's mark describes, and how a joined rank takes part in each kind. The real-rank
runs are in tests/parallel/test_join_async_mpi.py."""
import pytest

torch = pytest.importorskip("torch")

from torch_plugin.join_follow import described, take_part  # noqa: E402


class Recorder:
    """The TorchDistBackend methods a joined rank calls, recorded."""

    size = 2

    def __init__(self):
        import datetime
        self._timeout = datetime.timedelta(seconds=5)
        self.calls = []

    def allreduce_(self, buf, op, name, deadline):
        self.calls.append(("allreduce", buf, op, name))

    def allgather(self, buf, name, deadline):
        self.calls.append(("allgather", buf, name))

    def allgather_equal(self, buf, name, deadline):
        self.calls.append(("allgather_equal", buf, name))

    def allgather_host(self, data, name, deadline):
        self.calls.append(("allgather_host", bytes(data), name))

    def broadcast_(self, buf, root, name, deadline):
        self.calls.append(("broadcast", buf, root, name))

    def alltoall(self, buf, counts, name, deadline):
        self.calls.append(("alltoall", buf, counts, name))

    def barrier(self, name, deadline):
        self.calls.append(("barrier", name))


def test_a_mark_describes_dtype_size_detail_and_device():
    assert described(torch.zeros(2, 3, dtype=torch.bfloat16), "sum") == ("bfloat16", 6, "sum", "cpu")
    assert described(torch.zeros(5, dtype=torch.int64), True) == ("int64", 5, True, "cpu")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64"])
def test_a_joined_rank_takes_part_with_zeros_of_the_marked_dtype_and_size(dtype):
    be = Recorder()
    take_part(be, "allreduce", "b0", (dtype, 7, "sum", "cpu"), b"")
    take_part(be, "allgather", "g", (dtype, 7, True, "cpu"), b"")  # equal sizes: zeros
    take_part(be, "allgather", "v", (dtype, 7, False, "cpu"), b"")  # any sizes: an empty part
    take_part(be, "broadcast", "p", (dtype, 3, 1, "cpu"), b"")
    take_part(be, "alltoall", "a", (dtype, 9, None, "cpu"), b"")
    take_part(be, "allgather_object", "negotiate", None, b"join!")
    take_part(be, "barrier", "join", (), b"")
    (k0, r, op, _), (k1, g, _), (k2, v, _), (k3, p, root, _), (k4, a, counts, _), obj, bar = be.calls
    want = getattr(torch, dtype)
    assert (k0, op, r.dtype, r.numel(), bool(r.eq(0).all())) == ("allreduce", "sum", want, 7, True)
    assert (k1, g.dtype, g.numel(), bool(g.eq(0).all())) == ("allgather_equal", want, 7, True)
    assert (k2, v.dtype, v.numel()) == ("allgather", want, 0)
    assert (k3, root, p.dtype, p.numel()) == ("broadcast", 1, want, 3)
    assert (k4, a.numel(), counts) == ("alltoall", 0, [0, 0])
    assert obj == ("allgather_host", b"join!", "negotiate") and bar == ("barrier", "join")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL's zeros live on it)")
def test_zeros_for_a_cuda_collective_are_on_the_current_cuda_device():
    be = Recorder()
    take_part(be, "allreduce", "b0", ("float32", 4, "sum", "cuda"), b"")
    assert be.calls[0][1].device == torch.device("cuda", torch.cuda.current_device())


def test_overlapping_marks_on_the_control_plane_report_the_oldest_open_collective():
    """Direct starts overlap (docs/backends.md#direct-start): a peer must see the first collective
    still open, numbered in the stream, and the count must advance once per collective."""
    pytest.importorskip("mpi4py")
    from hvd_commopt.comm.mpi import MPIBackend

    control = MPIBackend()
    try:
        control.enter("allreduce", "b0", ("float32", 4, "sum", "cpu"))
        control.enter("allgather", "b1", ("float32", 2, True, "cpu"))
        assert control._where[:3] == (0, "allreduce", "b0")
        control.leave()
        assert control._where[:3] == (1, "allgather", "b1") and control._seq == 1
        control.leave()
        assert control._where is None and control._seq == 2 and control._last[:3] == (1, "allgather", "b1")
    finally:
        control.close()
