"""Measure the collectives' alpha-beta models on the running job (docs/cost-models.md#fitted-allreduce-model).

Follows MG-WFBP's ``CommunicationProfiler`` / ``_benchmark_communication``: time each collective
over a range of message sizes after warm-up runs, fit ``t = α + β·bytes`` by least squares on
rank 0, and broadcast the fit so that every rank plans with the same numbers (docs/mgwfbp.md#t-mg-6:
the plan must be identical on all ranks).

Choices, and why:

* Each sample is the wall time of one *blocking* call through :class:`Communicator`, started
  right after a barrier. That includes the hand-off to the progress thread, which every bucket
  pays too, so it belongs in ``α``.
* A collective ends when its slowest rank does, so each sample is the maximum over ranks.
* Each size contributes one statistic of its repeats, by default the **minimum** (the ``timeit``
  convention; the reference averages). Interference from other processes is not a function of
  the message size: on a loaded 2-core machine whole runs of repeats were 50x slower (16 ms
  scheduler stalls instead of 0.3 ms), which the mean and even the median passed straight into
  alpha and beta. Choose ``statistic="median"`` (or ``"mean"``) where jitter is a property of the
  network you want the planner to see. For the same reason the sizes are interleaved (repeat r
  of every size, then repeat r+1), so a burst of interference spreads over all sizes instead of
  taking every repeat of one size (Open MPI alone, without this package, showed such bursts of
  10-20 ms per call lasting 15+ consecutive calls on a 2-core VM).
* Default sizes are 8192·i float32 (32 KiB·i) for i = 1, 9, ..., 57: the reference's range
  (i = 1..63) thinned to 8 evenly spaced points, so a run takes seconds on a 2-core machine.
* ``p2p`` (the pairwise exchange of gTop-k's rounds) is timed as a ring ``sendrecv``: every
  rank sends to ``rank+1`` while receiving from ``rank-1``. It is skipped when P = 1.

Command line (prints the fits on rank 0 and writes JSON that ``CostModel.from_dict`` reads)::

    mpirun -np 2 python -m hvd_commopt.calibrate --out cost_model.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from .comm import Communicator
from .errors import ConfigError
from .fusion.cost_model import AlphaBeta, CostModel

__all__ = ["calibrate", "DEFAULT_SIZES", "main"]

DEFAULT_SIZES: tuple[int, ...] = tuple(8192 * 4 * i for i in range(1, 64, 8))
_COLLECTIVES = ("allreduce", "allgather", "p2p")
_STATISTICS: dict[str, Callable[[np.ndarray], float]] = {
    "min": lambda x: float(np.min(x)), "median": lambda x: float(np.median(x)),
    "mean": lambda x: float(np.mean(x))}


def _numpy_buffer(nbytes: int) -> np.ndarray:
    # zeros: repeated in-place sums stay 0 instead of growing like P^calls towards inf
    return np.zeros(nbytes // 4, dtype=np.float32)


def _timed_samples(comm: Communicator, op: Callable[[Any], Any], bufs: Sequence[Any], repeats: int,
                   warmup: int, tag: str) -> list[list[float]]:
    """``out[k][r]``: seconds of repeat r on ``bufs[k]``; sizes interleaved within each repeat."""
    for buf in bufs:
        for _ in range(warmup):
            op(buf)
    out: list[list[float]] = [[] for _ in bufs]
    for _ in range(repeats):
        for k, buf in enumerate(bufs):
            comm.barrier(name=f"calibrate.{tag}.barrier")
            t0 = time.perf_counter()
            op(buf)
            out[k].append(time.perf_counter() - t0)
    return out


def calibrate(comm: Communicator, sizes: Sequence[int] | None = None, repeats: int = 10,
              warmup: int = 5, collectives: Sequence[str] = _COLLECTIVES,
              make_buffer: Callable[[int], Any] | None = None, statistic: str = "min") -> CostModel:
    """Time allreduce, allgather and p2p on ``comm`` and return the same fitted model on every rank.

    Every rank must call this with the same arguments (it runs collectives).

    Args:
        comm: the communicator (e.g. ``hvd_commopt.runtime.init()``).
        sizes: message sizes in bytes (multiples of 4; at least two distinct). Default
            :data:`DEFAULT_SIZES`. For allgather the size is what each rank contributes.
        repeats: timed runs per size.
        warmup: untimed runs per size first.
        collectives: which to measure; ``allreduce`` and ``allgather`` are required by
            :class:`CostModel` (an unmeasured one is stored as ``AlphaBeta(0, 0)``).
        make_buffer: bytes -> buffer of the communicator's kind. Default: float32 NumPy arrays,
            which needs a host-buffer backend (``mpi``, ``inproc``, ``local``).
        statistic: how a size's repeats become one time: ``"min"``, ``"median"`` or ``"mean"``
            (module docstring).

    Returns:
        The :class:`CostModel` fitted on rank 0 and broadcast, with ``ranks = comm.size``.

    Raises:
        ValueError: bad sizes, repeats or collective names, or a native-buffer backend without
            ``make_buffer``.
    """
    sizes = tuple(int(s) for s in (DEFAULT_SIZES if sizes is None else sizes))
    if len(set(sizes)) < 2 or any(s <= 0 or s % 4 for s in sizes):
        raise ConfigError(f"calibrate needs >= 2 distinct positive sizes in bytes, multiples of 4 "
                          f"(float32 buffers); got {list(sizes)}")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if statistic not in _STATISTICS:
        raise ConfigError(f"statistic {statistic!r} unknown; use one of {sorted(_STATISTICS)}")
    unknown = set(collectives) - set(_COLLECTIVES)
    if unknown:
        raise ConfigError(f"unknown collectives {sorted(unknown)}; choose from {_COLLECTIVES}")
    if make_buffer is None:
        if comm.buffer_kind != "numpy":
            raise ConfigError(f"the {comm.backend.name} backend moves framework tensors; pass "
                              f"make_buffer=lambda nbytes: <a float32 tensor of nbytes/4 elements>")
        make_buffer = _numpy_buffer
    p, me = comm.size, comm.rank
    ops: dict[str, Callable[[Any], Any]] = {
        "allreduce": lambda b: comm.allreduce_(b, name="calibrate.allreduce"),
        "allgather": lambda b: comm.allgather(b, name="calibrate.allgather"),
        "p2p": lambda b: comm.sendrecv(b, (me + 1) % p, (me - 1) % p, name="calibrate.p2p"),
    }
    wanted = [c for c in _COLLECTIVES if c in collectives and not (c == "p2p" and p == 1)]
    bufs = [make_buffer(s) for s in sizes]
    local = {c: _timed_samples(comm, ops[c], bufs, repeats, warmup, c) for c in wanted}
    everyone = comm.allgather_object(local, name="calibrate.samples")
    fits: dict[str, Any] | None = None
    if me == 0:
        fits = {}
        for c in wanted:
            # per size: the statistic over repeats of the max over ranks
            stat = _STATISTICS[statistic]
            per = [stat(np.max([r[c][k] for r in everyone], axis=0)) for k in range(len(sizes))]
            fits[c] = AlphaBeta.fit(sizes, per).to_dict()
    fits = comm.broadcast_object(fits, root=0, name="calibrate.fit")
    zero = AlphaBeta(0.0, 0.0)
    return CostModel(
        allreduce=AlphaBeta.from_dict(fits["allreduce"]) if "allreduce" in fits else zero,
        allgather=AlphaBeta.from_dict(fits["allgather"]) if "allgather" in fits else zero,
        p2p=AlphaBeta.from_dict(fits["p2p"]) if "p2p" in fits else None,
        ranks=p,
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hvd_commopt.calibrate",
                                 description="Fit alpha-beta models of allreduce, allgather and p2p "
                                             "on this job (run under mpirun).")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="comma-separated message sizes in bytes (default: 32 KiB x 1,9,..,57)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--statistic", default="min", choices=sorted(_STATISTICS),
                    help="statistic of each size's repeats (default: min)")
    ap.add_argument("--no-p2p", action="store_true", help="skip the point-to-point measurement")
    ap.add_argument("--backend", default=None, help="backend name (default: from the launcher)")
    ap.add_argument("--out", default=None, help="write the model as JSON here (rank 0)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from . import runtime  # late: parsing --help must not start MPI

    owned = not runtime.is_initialized()
    comm = runtime.init(args.backend)
    try:
        colls = ("allreduce", "allgather") if args.no_p2p else _COLLECTIVES
        try:
            model = calibrate(comm, args.sizes, args.repeats, args.warmup, colls, statistic=args.statistic)
        except ConfigError as e:  # raised on every rank alike, before any collective
            if comm.rank == 0:
                print(f"hvd_commopt.calibrate: error: {e}", file=sys.stderr)
            return 2
        if comm.rank == 0:
            print(f"hvd_commopt calibration on {model.ranks} rank(s) ({comm.backend.name} backend):")
            for name in _COLLECTIVES:
                ab = getattr(model, name)
                if ab is None:
                    print(f"  {name:<9} not measured")
                else:
                    print(f"  {name:<9} alpha = {ab.alpha:.3e} s   beta = {ab.beta:.3e} s/byte"
                          f"   ({1 / ab.beta / 1e9 if ab.beta else float('inf'):.2f} GB/s)")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(model.to_dict(), f, indent=2)
                print(f"  written to {args.out}")
        return 0
    finally:
        if owned:
            runtime.shutdown()


if __name__ == "__main__":
    sys.exit(main())
