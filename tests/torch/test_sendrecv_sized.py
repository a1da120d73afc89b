"""torch_plugin/sendrecv_sized.py: a point-to-point exchange whose received length the caller knows
sends no size message and reads nothing on the host (no ``_local_scalar_dense``), where the plain
``sendrecv`` reads the peer's size with ``.item()``; two real Gloo processes."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from torch_plugin.sendrecv_sized import SizedSendrecv  # noqa: E402


class _Reads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


class _Backend(SizedSendrecv):
    _control = None
    name = "gloo"  # the backend kind TorchDistBackend sets; CPU tensors are never staged

    def __init__(self):
        self._pg = dist.group.WORLD

    def _global(self, r):
        return r

    def _wait(self, work, op, name, deadline):
        work.wait()


def _rank(rank: int, path: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        b, peer = _Backend(), 1 - rank
        got = []
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            send = (torch.arange(7) * 10 + rank).to(dtype)
            rec = _Reads()
            with rec:
                r = b.sendrecv_sized(send, peer, peer, 7, "t", 0.0)
            got.append((rec.reads, r.dtype == dtype, r.to(torch.float64).tolist()))
        if rank == 0:  # send only, then receive only
            b.sendrecv_sized(torch.ones(3), 1, -1, 3, "t", 0.0)
        else:
            got.append(b.sendrecv_sized(torch.zeros(0), -1, 0, 3, "t", 0.0).tolist())
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: 10-20 s
def test_sized_sendrecv_reads_nothing_on_the_host(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank in range(2):
        for reads, same_dtype, vals in res[rank][:3]:
            assert reads == 0 and same_dtype and vals == [float(i * 10 + 1 - rank) for i in range(7)]
    assert res[1][3] == [1.0, 1.0, 1.0]
