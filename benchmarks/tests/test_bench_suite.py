"""Unit tests of the benchmark suite's pieces (benchmarks/suite): refused variants become skips,
the analytic DDP/PowerSGD traffic, and the markdown report, without launching ranks."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from benchmarks.suite import report  # noqa: E402
from benchmarks.suite import variants as V  # noqa: E402


def _ctx() -> V.Ctx:
    return V.Ctx(mode="throughput", rank=0, size=2)


def test_refused_variants_are_skips_with_reasons() -> None:
    from hvd_commopt import run_ranks
    model = torch.nn.Linear(4, 3)

    def body(comm):
        with pytest.raises(V.Skip, match="refused by the library"):
            V._ours("x", model, _ctx(), communicator=comm, schedule="not a schedule")
    run_ranks(1, body)
    with pytest.raises(V.Skip, match="no Gloo process group"):
        V.build("ssgd_gloo", model, _ctx())
    with pytest.raises(KeyError, match="unknown variant"):
        V.build("nope", model, _ctx())
    assert set(V.QUICK) <= set(V.VARIANTS) and set(V.DEFAULT) == set(V.VARIANTS) - {"ssgd_gloo", *V.NATIVE_AB, *V.BACKEND_AB,
                                                                            *V.TRUST_ROWS}


def test_analytic_ddp_and_powersgd_bytes() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 2))
    n = sum(p.numel() for p in m.parameters())
    assert V.ddp_bytes_per_step(m, 2) == 4 * n  # ring, 2 ranks: each rank sends the buffer once
    assert V.ddp_bytes_per_step(m, 4) == int(1.5 * 4 * n)
    # rank 1: 50x100 -> P 50 + Q 100; 2x50 does not compress 2-fold -> sent whole; biases whole
    assert V.ddp_bytes_per_step(m, 2, rank_r=1) == 4 * (150 + 100 + 50 + 2)


def _run() -> dict:
    res = {k: {"step_s": s, "samples_per_s": 16 / s, "bytes_sent_per_step_accounted": a,
               "bytes_per_step_analytic": an, "link_tx_bytes_per_step": [1.05 * (a or [an or 0])[0]] * 2}
           for k, s, a, an in (("compute", 0.1, None, None), ("ddp", 0.3, None, 4000),
                               ("ssgd", 0.28, [4000, 4000], None), ("topk", 0.15, [40, 40], None))}
    tp = {"mode": "throughput", "model": "deep_mlp", "params": 1000, "batch_per_rank": 8, "blocks": 3,
          "steps_per_block": 2, "results": res, "status": {"mgwfbp": "skipped: no fusion= yet", "ssgd": "ok"},
          "backend": "mpi", "mpi_library": "MPICH 5.0.2"}
    tta = {"mode": "tta", "params": 38000, "epochs": 2, "steps_per_epoch": 21, "batch_per_rank": 32, "lr": 0.1,
           "target": 0.9, "density": 0.01, "period": 4, "schedule_warmup_steps": 20, "status": {},
           "results": {"ddp": {"curve": [{"wall_s": 1.0, "test_acc": 0.95}], "final_acc": 0.95,
                               "time_to_target_s": 1.0, "epochs_to_target": 1, "epoch_s": 1.0},
                       "topk": {"curve": [{"wall_s": 1.0, "test_acc": 0.5}], "final_acc": 0.5,
                                "time_to_target_s": None, "epochs_to_target": None, "epoch_s": 1.0}}}
    return {"net": "1gbit", "ranks": 2, "quick": False, "started": "now", "machine": {"torch": "2"},
            "cluster": {"network": "netns-1gbit", "rate": "1gbit", "burst_bytes": 250000, "fallback_reason": None,
                        "launcher_version": "MPICH 5.0.2"}, "jobs": [tp, tta]}


def test_markdown_report() -> None:
    md = report.net_markdown(_run())
    assert "DDP communication-to-computation ratio (DDP step / compute-only step): **3.00**" in md
    assert "| topk | 106.7 | 150.0 | 2.00x | – | 67% | 40 B | 42 B | 1.05 |" in md  # no block times: no pairs
    assert "4 kB (analytic)" in md and "MPICH 5.0.2" in md
    assert "| topk | not reached |" in md and "`mgwfbp`: skipped: no fusion= yet" in md
    summary = report.summary_markdown([_run()])
    assert "| netns-1gbit | deep_mlp | 3.00 |" in summary
    assert "| topk | 2.00x | ssgd | 1.07x | 1.07x |" in summary  # topk missed the TTA target
    assert report.best_ours(_run()["jobs"][0]["results"]) == "topk"
    assert report.fmt_bytes(3.87e9) == "3.87 GB"


def test_paired_ratio_is_the_median_of_same_block_ratios() -> None:
    # each block's ratio is DDP's block time over the variant's in that block; a slow block (the
    # machine's load) slows both sides of its own ratio
    res = {"ddp": {"block_step_s_rank0": [0.30, 0.60, 0.32, 0.31]},
           "ssgd": {"block_step_s_rank0": [0.30, 0.50, 0.40, 0.31]},
           "topk": {"block_step_s_rank0": [0.10, 0.20, 0.10]}}
    assert report.paired_ratio(res, "ssgd") == (1.0 + 1.0) / 2  # ratios 1.0, 1.2, 0.8, 1.0
    assert report.paired_ratio(res, "topk") is None  # blocks that do not pair up
    assert report.paired_ratio(res, "gtopk") is None
    res["ssgd"]["block_step_s_rank0"] = [0.15, 0.2, 0.4]
    res["ddp"]["block_step_s_rank0"] = [0.30, 0.6, 0.4]
    assert report.paired_ratio(res, "ssgd") == 2.0  # odd count: the middle one of 2.0, 3.0, 1.0
    md = report.net_markdown({**_run(), "jobs": [{**_run()["jobs"][0], "results": {
        k: {**v, "block_step_s_rank0": [v["step_s"], 2 * v["step_s"]]} for k, v in _run()["jobs"][0]["results"].items()}}]})
    assert "| topk | 106.7 | 150.0 | 2.00x | 2.00x | 67% |" in md


def test_paired_spread_prints_each_blocks_ratio_in_block_order() -> None:
    res = {"ddp": {"block_step_s_rank0": [0.30, 0.60, 0.32, 0.31]},
           "ssgd": {"block_step_s_rank0": [0.30, 0.50, 0.40, 0.31]},
           "topk": {"block_step_s_rank0": [0.10, 0.20, 0.10]}}
    assert report.paired_ratios(res, "ssgd") == [0.30 / 0.30, 0.60 / 0.50, 0.32 / 0.40, 0.31 / 0.31]
    assert report.paired_spread(res, "ssgd") == "0.80-1.20: 1.00 1.20 0.80 1.00"
    assert report.paired_spread(res, "topk") == "–" and report.paired_ratios(res, "topk") is None
    md = report.net_markdown({**_run(), "jobs": [{**_run()["jobs"][0], "results": {
        k: {**v, "block_step_s_rank0": [v["step_s"], 2 * v["step_s"]]} for k, v in _run()["jobs"][0]["results"].items()}}]})
    assert "| 1.05 | 2.00-2.00: 2.00 2.00 |" in md  # topk's row: DDP's blocks are twice its own


def test_backend_switch_names_our_variants_on_mpi() -> None:
    from benchmarks.run import parse_args
    from hvd_commopt import run_ranks
    a = parse_args(["--variants", "compute,ddp,ssgd,fp16", "--backend", "both", "--no-tta"])
    assert a.variants.split(",") == ["compute", "ddp", "ssgd", "fp16", "ssgd@mpi", "fp16@mpi", "ssgd@gloo", "fp16@gloo"]
    assert V.known("topk@gloo") and not V.known("ddp@mpi") and not V.known("ssgd@nccl")
    assert parse_args(["--variants", "ssgd", "--backend", "mpi"]).backend == "mpi"
    model = torch.nn.Linear(4, 3)
    with pytest.raises(V.Skip, match="no mpi communicator"):
        V.build("ssgd@mpi", model, _ctx())

    def body(comm):  # "<variant>@<backend>" builds the variant on the communicator the job gives
        ctx = V.Ctx(mode="throughput", rank=0, size=1, backend_comm=lambda name: comm)
        r = V.build("ssgd@mpi", torch.nn.Linear(4, 3), ctx)
        assert r.name == "ssgd@mpi" and r.opt.comm_engine.comm is comm
        assert V.describe("ssgd@mpi").endswith(", on mpi")
    run_ranks(1, body)


def test_each_of_our_variants_gets_a_communicator_of_its_own_where_the_job_offers_one() -> None:
    # on Gloo, as each DDP instance has its own group, each of our variants gets its own
    # Communicator (docs/benchmarking.md#block-warmup); "<variant>@<backend>" keeps the one it names
    from hvd_commopt import run_ranks

    def body(comm):
        made = []
        ctx = V.Ctx(mode="throughput", rank=0, size=1, fresh_comm=lambda: made.append(comm) or comm,
                    backend_comm=lambda name: comm)
        for name in ("ssgd", "topk", "topk_ar"):
            assert V.build(name, torch.nn.Linear(4, 3), ctx).opt.comm_engine.comm is comm
        assert len(made) == 3
        V.build("ssgd@mpi", torch.nn.Linear(4, 3), ctx)
        assert len(made) == 3
    run_ranks(1, body)


def test_ddp_baseline_has_ddps_default_buckets_and_ddp_nofirst_has_none() -> None:
    # `ddp` is DDP(model) as a user gets it: a 1 MiB first bucket, then 25 MiB. An explicit
    # bucket_cap_mb=25 makes no first bucket (torch makes it only when bucket_cap_mb is None), which
    # is `ddp_nofirst`. A fresh process: DDP needs a process group of its own (one rank, Gloo).
    import subprocess
    import sys
    from pathlib import Path
    code = (
        "import tempfile, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)\n"
        "from benchmarks.suite import variants as V\n"
        "from benchmarks.models import deep_mlp\n"
        "for name in ('ddp', 'ddp_nofirst'):\n"
        "    torch.manual_seed(0)\n"
        "    r = V.build(name, deep_mlp(depth=48), V.Ctx(mode='throughput', rank=0, size=1, ddp_group=dist.group.WORLD))\n"
        "    for _ in range(2):\n"
        "        r.module(torch.randn(4, 64)).sum().backward()\n"
        "    print(name, [b.buffer().numel() * 4 for b in r.module.reducer._get_zeros_like_grad_buckets()])\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(ln.split(" ", 1) for ln in out.stdout.splitlines())
    assert lines["ddp"] == "[1062952, 11119616]"  # the same buckets as our S-SGD's (docs/wrapper.md#first-bucket)
    assert lines["ddp_nofirst"] == "[12182568]"


def test_blocks_alternate_the_variants_order() -> None:
    """Every other block runs the variants in reverse, so no variant always follows the same one."""
    from benchmarks.common import block_order
    names = ["compute", "ddp", "topk"]
    assert [block_order(names, b) for b in range(3)] == [names, names[::-1], names]
    assert names == ["compute", "ddp", "topk"]  # the caller's list is not reordered in place


def test_the_poll200_ab_switches_the_waiters_pauses_for_its_own_steps() -> None:
    from hvd_commopt.comm import direct
    from benchmarks.suite.worker import timed_step
    library = (direct.PAUSE_MAX_S, direct.LATE_FRACTION)
    assert "ssgd_poll200" in V.VARIANTS and "ssgd_poll200" not in V.DEFAULT  # an opt-in A/B
    model = torch.nn.Linear(4, 5)
    x, y = torch.randn(3, 2, 4), torch.randint(0, 5, (3, 2))
    old = V.Runner("ssgd_poll200", model, torch.optim.SGD(model.parameters(), lr=0.1), model, long_wait_pauses=False)
    new = V.Runner("ssgd", model, torch.optim.SGD(model.parameters(), lr=0.1), model)
    timed_step(old, x, y)
    assert (direct.PAUSE_MAX_S, direct.LATE_FRACTION) == (direct.PAUSE_SHORT_S, 0.0)  # 200 us, however long
    timed_step(new, x, y)
    assert (direct.PAUSE_MAX_S, direct.LATE_FRACTION) == library
