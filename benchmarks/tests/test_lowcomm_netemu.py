"""benchmarks/lowcomm_netemu.py's pure parts: the curves of several runs and the time to S-SGD's loss."""
import json

import pytest

from benchmarks.lowcomm_netemu import curves_from, steps_to_loss, summarise, time_to_loss


def _run(path, steps, results):
    path.write_text(json.dumps({"args": {"steps": steps}, "results": {
        n: {"curve": [{"step": s, "val_loss": v} for s, v in c]} for n, c in results.items()}}))
    return str(path)


def test_time_to_loss_is_the_first_eval_at_or_below_the_target_times_the_step_time():
    curve = [{"step": 0, "val_loss": 3.0}, {"step": 50, "val_loss": 2.0}, {"step": 100, "val_loss": 1.5}]
    assert time_to_loss(curve, 2.0, 0.5) == 25.0
    assert time_to_loss(curve, 1.0, 0.5) is None


def test_curves_take_ddps_final_loss_and_each_variants_longest_run(tmp_path):
    short = _run(tmp_path / "a.json", 100, {"ddp": [(0, 3.0), (100, 1.5)], "diloco_h50": [(0, 3.0), (100, 1.6)]})
    long = _run(tmp_path / "b.json", 200, {"diloco_h50": [(0, 3.0), (100, 1.7), (150, 1.5), (200, 1.4)]})
    target, curves = curves_from([short, long])
    assert target == 1.5
    assert curves["diloco_h50"]["steps"] == 200 and curves["diloco_h50"]["file"] == long
    assert curves_from([long, short])[1]["diloco_h50"]["steps"] == 200  # order does not matter
    results = {"ddp": {"step_s": 0.2}, "diloco_h50": {"step_s": 0.01}, "compute": {"step_s": 0.008}}
    out = summarise(results, target, curves)
    assert out["comm_over_compute_ddp"] == pytest.approx((0.2 - 0.008) / 0.008)
    assert results["ddp"]["time_to_ddp_loss_s"] == pytest.approx(20.0)
    assert results["diloco_h50"]["steps_to_ddp_loss"] == 150 and results["diloco_h50"]["run_steps"] == 200
    assert results["diloco_h50"]["time_to_ddp_loss_s"] == pytest.approx(1.5)
    assert results["diloco_h50"]["time_to_loss_speedup_vs_ddp"] == pytest.approx(20.0 / 1.5)
    assert results["compute"]["time_to_ddp_loss_s"] is None and results["compute"]["time_to_loss_speedup_vs_ddp"] is None


def test_curves_without_a_ddp_run_say_so(tmp_path):
    with pytest.raises(SystemExit, match="ddp"):
        curves_from([_run(tmp_path / "a.json", 10, {"diloco_h50": [(10, 2.0)]})])


def test_summary_keeps_the_curves_and_counts_against_torch_ddp_when_measured(tmp_path):
    run = _run(tmp_path / "a.json", 100, {"ddp": [(0, 3.0), (50, 2.0), (100, 1.5)],
                                          "ddp_bf16": [(0, 3.0), (50, 2.0), (100, 1.5)],
                                          "diloco_h50": [(0, 3.0), (50, 1.8), (100, 1.5)]})
    results = {"torch_ddp": {"step_s": 0.1}, "torch_ddp_bf16": {"step_s": 0.05}, "ddp": {"step_s": 0.2},
               "diloco_h50": {"step_s": 0.01}, "compute": {"step_s": 0.008}}
    out = summarise(results, *curves_from([run]))
    assert out["baseline"] == "torch_ddp"
    assert set(out["curves"]) == {"torch_ddp", "torch_ddp_bf16", "ddp", "diloco_h50"}  # DDP's take ddp / ddp_bf16
    assert out["curves"]["diloco_h50"][1] == {"step": 50, "tokens": None, "val_loss": 1.8}
    assert results["torch_ddp_bf16"]["time_to_ddp_loss_s"] == pytest.approx(5.0)
    assert results["ddp"]["time_to_loss_speedup_vs_ddp"] == pytest.approx(0.5)  # against torch DDP's 10 s
    assert results["diloco_h50"]["time_to_loss_speedup_vs_ddp"] == pytest.approx(10.0)
    assert out["comm_over_compute_ddp"] == pytest.approx((0.1 - 0.008) / 0.008)


def test_a_given_target_replaces_ddps_final_loss_and_the_summary_says_so(tmp_path):
    from benchmarks.lowcomm_netemu import target_and_curves
    run = _run(tmp_path / "a.json", 200, {"ddp": [(0, 3.0), (100, 1.6), (200, 1.4)],
                                          "diloco_h50": [(0, 3.0), (100, 1.8), (200, 1.55)]})
    target, curves, which = target_and_curves([run])
    assert (target, which) == (1.4, {"target_from": "ddp_final"})
    assert steps_to_loss(curves["diloco_h50"]["curve"], target) is None  # never reaches S-SGD's final loss
    target, curves, which = target_and_curves([run], 1.55)
    assert (target, which) == (1.55, {"target_from": "given", "ddp_final_loss": 1.4})
    results = {"ddp": {"step_s": 0.2}, "diloco_h50": {"step_s": 0.05}}
    out = summarise(results, target, curves)
    assert out["target"] == 1.55
    assert results["ddp"]["steps_to_ddp_loss"] == 200 and results["diloco_h50"]["steps_to_ddp_loss"] == 200
    assert results["diloco_h50"]["time_to_loss_speedup_vs_ddp"] == pytest.approx(4.0)


def test_the_summary_written_after_each_run_holds_the_medians_of_the_runs_so_far(tmp_path):
    import argparse

    from benchmarks.lowcomm_netemu import write_summary
    curves = _run(tmp_path / "c.json", 100, {"ddp": [(0, 3.0), (100, 1.5)], "diloco_h50": [(0, 3.0), (100, 1.5)]})
    args = argparse.Namespace(net="100mbit", variants="ddp,diloco_h50,compute", curves=curves, target=None, worker=False)

    def run(step_s):
        return {"variant": "v", "steps": 100, "ranks": [{"step_s": step_s, "link_bytes": 0}], "step_s": step_s,
                "at": "10:45:00"}
    runs = {"ddp": [run(0.3), run(0.1), run(0.2)], "diloco_h50": [run(0.05)], "compute": []}  # cut off here
    write_summary(runs, "netns-100mbit", args, tmp_path, final=False)
    summary = json.loads((tmp_path / "netemu_summary.json").read_text())
    assert set(summary["results"]) == {"ddp", "diloco_h50"}  # compute has not run yet
    assert summary["results"]["ddp"]["step_s"] == 0.2 and len(summary["results"]["ddp"]["repeats"]) == 3
    assert summary["results"]["diloco_h50"]["time_to_loss_speedup_vs_ddp"] == pytest.approx(4.0)
    assert summary["target"] == 1.5 and summary["target_from"] == "ddp_final"
