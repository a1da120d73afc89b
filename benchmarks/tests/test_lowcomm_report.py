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
