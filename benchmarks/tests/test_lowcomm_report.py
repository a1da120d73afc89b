"""benchmarks/lowcomm_report.py: the REPORT.md section from lowcomm_bench's merged JSONs."""
import json

from benchmarks.lowcomm_report import section


def test_section_tables_each_summarised_run_and_says_when_there_is_none(tmp_path):
    assert any("No results" in line for line in section(tmp_path))
    args = {"ranks": 2, "steps": 10, "batch": 4, "context": 8, "seed": 1, "layers": 1, "width": 8, "lr": 0.01,
            "cosine": True}
    rows = [{"variant": "ddp", "final_val_loss": 2.0, "loss_vs_ddp": 0.0, "bytes_per_step_per_rank": 100.0,
             "bytes_ratio_vs_ddp": 1.0},
            {"variant": "diloco_h5", "final_val_loss": 2.02, "loss_vs_ddp": 0.01, "bytes_per_step_per_rank": 20.0,
             "bytes_ratio_vs_ddp": 0.2}]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "lowcomm_p2.json").write_text(json.dumps({"args": args, "params": 99, "summary": rows}))
    (tmp_path / "run" / "lowcomm_p4.json").write_text(json.dumps({"args": args, "params": 99, "results": {}}))
    lines = section(tmp_path)
    assert "| diloco_h5 | 2.0200 | +1.00 % | 20 | 0.20000 |" in lines
    assert sum(line.startswith("| variant") for line in lines) == 1  # the unsummarised run is left out


def test_section_tables_the_time_to_ddps_loss_on_the_emulated_link(tmp_path):
    summary = {"net": "100mbit", "args": {"layers": 2, "width": 128, "batch": 4, "context": 64, "repeats": 3},
               "target": 1.5, "comm_over_compute_ddp": 12.0,
               "results": {"ddp": {"step_s": 0.2, "step_speedup_vs_ddp": 1.0, "steps_to_ddp_loss": 100,
                                   "run_steps": 100, "time_to_ddp_loss_s": 20.0, "time_to_loss_speedup_vs_ddp": 1.0},
                           "compute": {"step_s": 0.01, "step_speedup_vs_ddp": 20.0, "steps_to_ddp_loss": None,
                                       "run_steps": None, "time_to_ddp_loss_s": None,
                                       "time_to_loss_speedup_vs_ddp": None}}}
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "netemu_summary.json").write_text(json.dumps(summary))
    (tmp_path / "net2").mkdir()  # a summary without --curves has no target: left out
    (tmp_path / "net2" / "netemu_summary.json").write_text(json.dumps({"net": "1gbit", "results": {}}))
    lines = section(tmp_path)
    assert "| ddp | 200.0 | 1.00 | 100 (100) | 20.0 | 1.00 |" in lines
    assert "| compute | 10.0 | 20.00 | - | - | - |" in lines
    assert sum("communication / compute per step 12.0" in line for line in lines) == 1
    assert not any("No results" in line for line in lines)


def _summary_with_curves(net):
    curve = [{"step": s, "tokens": 512 * s, "val_loss": v} for s, v in ((0, 5.4), (100, 2.0), (200, 1.5))]
    return {"net": net, "args": {"layers": 2, "width": 128, "batch": 4, "context": 64, "hosts": 2}, "target": 1.5,
            "baseline": "torch_ddp",
            "curves": {"torch_ddp": curve, "diloco_h50": curve},
            "results": {"torch_ddp": {"step_s": 0.3}, "diloco_h50": {"step_s": 0.03},
                        "compute": {"step_s": 0.02}}}


def test_plot_draws_loss_against_tokens_and_time_on_the_link_for_each_summary_with_curves(tmp_path):
    from benchmarks.lowcomm_report import PNG, plot, plot_section
    report_dir = tmp_path / "report"
    report_dir.mkdir()
    assert not plot(tmp_path, tmp_path / "none.png") and plot_section(report_dir, tmp_path) == []
    (tmp_path / "old").mkdir()  # a summary from before the curves were kept: not plotted
    (tmp_path / "old" / "netemu_summary.json").write_text(json.dumps({**_summary_with_curves("100mbit"),
                                                                       "curves": {}}))
    assert plot_section(report_dir, tmp_path) == []
    for net in ("100mbit", "1gbit"):
        (tmp_path / net).mkdir()
        (tmp_path / net / "netemu_summary.json").write_text(json.dumps(_summary_with_curves(net)))
    lines = plot_section(report_dir, tmp_path)
    assert lines[-1] == f"![low-communication curves]({PNG})"
    png = (report_dir / PNG).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import struct
    width, height = struct.unpack(">II", png[16:24])
    assert width > height  # two rows of two panels: 13 x 8.4 inches
    assert height > 600
    lines = section(tmp_path)  # the ratios say which DDP they are against
    assert "| variant | ms/step | x DDP per step | steps to S-SGD's loss (run length) | time to it (s) | x DDP |" in lines


def test_a_given_target_is_named_with_ddps_final_loss_beside_it(tmp_path):
    summary = {**_summary_with_curves("100mbit"), "target": 1.55, "target_from": "given", "ddp_final_loss": 1.4}
    summary["results"]["torch_ddp"].update(steps_to_ddp_loss=200, run_steps=200, time_to_ddp_loss_s=60.0)
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "netemu_summary.json").write_text(json.dumps(summary))
    lines = section(tmp_path)
    assert any("the validation loss 1.5500 (given; S-SGD's final loss 1.4000 is not reached by every curve)" in line
               for line in lines)
    assert "| variant | ms/step | x DDP per step | steps to the loss (run length) | time to it (s) | x DDP |" in lines
