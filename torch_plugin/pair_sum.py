"""Small sums on two Gloo ranks exchanged by one allgather and added locally
(docs/backends.md#pair-sum).

At two ranks the allgather moves the ring allreduce's bytes (each rank sends its whole buffer
once) in one exchange where the allreduce makes two, and ``a + b`` with rank 0's part first is the
same correctly rounded addition on both ranks, so the result is the allreduce's, bit for bit. On
the emulated links a 48 KB allgather took 0.55-0.78 ms where Gloo's allreduce took 2.1-2.9 ms; by
1 MB the allreduce is as fast or faster, hence the bound :data:`MAX_BYTES`.

Every rank decides alike: the test reads only the op, dtype, size and group size, which are the
same everywhere.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["MAX_BYTES", "DTYPES", "takes", "start", "gather_single"]

#: the largest sum (bytes per rank) exchanged so; tests and benchmarks set 0 to compare with the
#: allreduce (docs/backends.md#pair-sum)
MAX_BYTES = 64 * 1024
#: dtypes whose ``a + b`` is one rounding on the CPU (halves are summed in float32 by Gloo)
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8)
# newer torch deprecates all_gather_into_tensor in favour of all_gather_single (same call)
gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def takes(buf: torch.Tensor, op: str, group_size: int) -> bool:
    """Whether a Gloo reduction of ``buf`` over ``group_size`` ranks is a small CPU sum that one
    allgather and a local add replace."""
    return (op == "sum" and group_size == 2 and buf.device.type == "cpu" and buf.dtype in DTYPES
            and buf.is_contiguous() and buf.numel() * buf.element_size() <= MAX_BYTES)


def start(buf: torch.Tensor, group) -> tuple[object, Callable[[], torch.Tensor]]:
    """(the allgather's async work, ``done()``: adds the two parts into ``buf`` and returns it)."""
    n, flat = buf.numel(), buf.reshape(-1)
    both = torch.empty(2 * n, dtype=buf.dtype)
    work = gather_single(both, flat, group=group, async_op=True)
    # rank 0's part first on both ranks: the same sum, bit for bit, as the allreduce's
    return work, lambda: (torch.add(both[:n], both[n:], out=flat), buf)[1]
