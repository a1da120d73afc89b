"""Hop-by-hop timing of one dense Gloo allreduce: where does our path lose time against DDP's?

    python -m benchmarks.gloo_hops --net 10gbit --mb 11 --reps 15      (launches 2 emulated hosts)

Each rank times the same float32 allreduce (``--mb`` MB) along several paths, interleaved
repetition by repetition (the machine is shared and noisy), every one right after a compute
burst of ``--burst-ms`` (the end of backward) and, separately, back to back:

* ``plain``: ``dist.all_reduce`` on a fresh Gloo group, called from the main thread;
* ``allgather``: ``dist.all_gather_single`` of the same tensor on that group (what an
  allreduce costs as an allgather and a local sum);
* ``ourpg``: the same call on our backend's own group (``TorchDistBackend._pg``), main thread;
* ``backend``: ``TorchDistBackend.allreduce_`` (async work + ``wait(timeout)``, control-plane
  marks), main thread;
* ``comm``: ``Communicator.allreduce_tensor_async`` + ``wait`` through the progress thread
  (``hvd_commopt.comm.direct.START_ON_CALLER`` off);
* ``ddp``: DDP's backward over one parameter of the same size, minus the same backward without
  DDP (DDP's reducer launches the bucket from the autograd hook, its own Gloo group).

Ranks meet at a barrier on the default group before each timed call, so a figure is the
collective's time, not the peer's lateness. Prints medians per path (rank 0).

``overlap`` (``--overlap-mb``, default 1: DDP's first bucket) times something else: a backward
pass of a 40-layer MLP while an allreduce of that size runs beside it, started before the
backward and waited for after it, by ``plain`` (an async ``dist.all_reduce`` from the main thread,
as DDP's reducer starts a bucket), ``queued`` (our progress thread) or ``direct`` (our
communicator's start on the calling thread, docs/backends.md#direct-start), against ``none`` (no
collective). The figure is the backward's duration: what a bucket sent during backward costs the
backward on these shared vCPUs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

__all__ = ["main"]


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_plugin as hco
    from hvd_commopt.comm import direct
    from torch_plugin.pair_sum import gather_single
    torch.set_num_threads(1)
    comm = hco.init()
    be = comm.backend
    plain = dist.new_group(backend="gloo")
    ddp_group = dist.new_group(backend="gloo")
    n = int(args.mb * 1e6) // 4
    side = int(n ** 0.5)
    lin = nn.Linear(side, side, bias=False)
    ddp = DDP(nn.Linear(side, side, bias=False), process_group=ddp_group, bucket_cap_mb=25)
    x = torch.randn(1, side)
    a = torch.randn(256, 256)
    t = torch.ones(n)

    def burst(ms: float) -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            a @ a

    def sync() -> None:
        dist.barrier()

    def p_plain():
        dist.all_reduce(t, group=plain)

    gathered = torch.empty(comm.size * n)

    def p_allgather():  # one exchange at 2 ranks where the allreduce makes two (then a local sum)
        gather_single(gathered, t, group=plain)

    def p_ourpg():
        dist.all_reduce(t, group=be._pg)

    def p_backend():
        be.allreduce_(t, "sum", "hop", time.monotonic() + 60)

    def p_comm():
        direct.START_ON_CALLER = False
        comm.wait(comm.allreduce_tensor_async(None, t, "sum", "hop"))
        direct.START_ON_CALLER = True

    def p_ddp():
        ddp(x).sum().backward()

    def p_local():
        lin(x).sum().backward()

    paths = {"plain": p_plain, "allgather": p_allgather, "ourpg": p_ourpg, "backend": p_backend, "comm": p_comm,
             "ddp": p_ddp, "local_bwd": p_local}
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in paths} for m in ("burst", "b2b")}
    for rep in range(args.reps + 2):
        names = list(paths)
        names = names[rep % len(names):] + names[:rep % len(names)]  # rotate the order
        for mode in ("burst", "b2b"):
            for k in names:
                sync()
                if mode == "burst":
                    burst(args.burst_ms)
                t0 = time.perf_counter()
                paths[k]()
                dt = time.perf_counter() - t0
                if rep >= 2:
                    times[mode][k].append(dt * 1e3)
    mlp = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(40)])
    xin = torch.randn(64, 256)
    t_over = torch.ones(int(args.overlap_mb * 1e6) // 4)
    over: dict[str, list[float]] = {"none": [], "plain": [], "queued": [], "direct": []}
    for rep in range(3 * args.reps + 2):
        names = list(over)
        for k in names[rep % 4:] + names[:rep % 4]:
            sync()
            work = handle = None
            if k == "plain":
                work = dist.all_reduce(t_over, group=plain, async_op=True)
            elif k in ("queued", "direct"):
                direct.START_ON_CALLER = k == "direct"
                handle = comm.allreduce_tensor_async(None, t_over, "sum", "overlap")
                direct.START_ON_CALLER = True
            t0 = time.perf_counter()
            mlp(xin).square().mean().backward()
            dt = time.perf_counter() - t0
            if work is not None:
                work.wait()
            if handle is not None:
                comm.wait(handle)
            if rep >= 2:
                over[k].append(dt * 1e3)
    times["overlap"] = over
    out = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in times.items()}
    for m in ("burst", "b2b"):
        out[m]["ddp_minus_local"] = out[m]["ddp"] - out[m]["local_bwd"]
    allv = comm.allgather_object(out)
    if comm.rank == 0:
        print("HOPS " + json.dumps({"mb": args.mb, "reps": args.reps, "burst_ms": args.burst_ms,
                                    "overlap_mb": args.overlap_mb, "ranks": allv}))
    hco.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="10gbit")
    ap.add_argument("--mb", type=float, default=11.0)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--burst-ms", type=float, default=17.0)
    ap.add_argument("--overlap-mb", type=float, default=1.0, help="the allreduce beside a backward (overlap)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        _rank_main(args)
        return 0
    import random
    from benchmarks.common import ROOT
    from benchmarks.netemu import EmulatedCluster
    with EmulatedCluster(n=2, rate=args.net) as cl:
        env = {"PYTHONPATH": str(ROOT), "MASTER_ADDR": cl.hosts[0], "MASTER_PORT": str(random.randint(20000, 40000)),
               "GLOO_SOCKET_IFNAME": "veth0" if cl.netns else "lo", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "benchmarks.gloo_hops", "--rank", "--mb", str(args.mb),
               "--reps", str(args.reps), "--burst-ms", str(args.burst_ms), "--overlap-mb", str(args.overlap_mb)]
        res = cl.run_mpi(cmd, env=env, timeout=300)
        for line in res.stdout.splitlines():
            if line.startswith("HOPS "):
                d = json.loads(line[5:])
                print(f"network {res.network}, {d['mb']} MB float32, {d['reps']} reps, burst {d['burst_ms']} ms")
                for mode in ("burst", "b2b", "overlap"):
                    if mode == "overlap":
                        print(f"  overlap: a 40x256 MLP's backward (ms), a {d['overlap_mb']} MB allreduce beside it")
                    for k in d["ranks"][0][mode]:
                        vals = " ".join(f"{r[mode][k]:7.2f}" for r in d["ranks"])
                        print(f"  {mode:5s} {k:16s} ms per rank: {vals}")
                return 0
        print(res.stdout[-4000:])
        return res.returncode or 1


if __name__ == "__main__":
    sys.exit(main())
