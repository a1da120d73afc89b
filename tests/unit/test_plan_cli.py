"""``python -m hvd_commopt.plan``: profile format, cost-model options, output."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hvd_commopt import plan as plan_cli
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel

PROFILE = [  # the docs/mgwfbp.md#t-mg-4, in backward order
    {"name": "fc.weight", "bytes": 4 * 63522, "backward_s": 0.81},
    {"name": "mid.weight", "bytes": 4 * 56, "backward_s": 0.27},
    {"name": "conv1.weight", "bytes": 4 * 14199, "backward_s": 0.87},
]


@pytest.fixture
def profile(tmp_path):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(PROFILE))
    return str(p)


def _json(capsys, argv):
    assert plan_cli.main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_strategies_and_best(profile, capsys):
    out = _json(capsys, ["--model-profile", profile, "--alpha", "0.5", "--beta", str(1e-5 / 4)])
    s = out["strategies"]
    assert list(s) == ["per_tensor", "single", "threshold", "mgwfbp", "optimal"]
    assert s["mgwfbp"]["buckets"] == [[0, 1], [2]]
    assert s["optimal"]["buckets"] == [[0], [1, 2]]
    assert s["optimal"]["iteration_s"] == pytest.approx(2.59255)
    assert out["best"] == "optimal"


def test_link_model_with_ranks(profile, capsys):
    out = _json(capsys, ["--model-profile", profile, "--alpha", "1e-3", "--beta", "1e-9", "--ranks", "8"])
    ar = CostModel.from_link(AlphaBeta(1e-3, 1e-9), 8).allreduce
    assert out["cost"]["alpha"] == pytest.approx(ar.alpha) and out["cost"]["beta"] == pytest.approx(ar.beta)


def test_cost_model_file_and_object_profile(tmp_path, capsys):
    cm = tmp_path / "cm.json"
    cm.write_text(json.dumps(CostModel(AlphaBeta(0.5, 1e-5 / 4), AlphaBeta(0.0, 0.0), ranks=4).to_dict()))
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"tensors": PROFILE, "forward_s": 1.0, "update_s": 0.25}))
    out = _json(capsys, ["--model-profile", str(prof), "--cost-model", str(cm)])
    assert out["strategies"]["optimal"]["iteration_s"] == pytest.approx(1.0 + 2.59255 + 0.25)


def test_text_output_lists_buckets_and_names(profile, capsys):
    assert plan_cli.main(["--model-profile", profile, "--alpha", "0.5", "--beta", "2.5e-6", "--names"]) == 0
    text = capsys.readouterr().out
    assert "<- best" in text and "optimal: [0] [1-2]" in text and "mid.weight, conv1.weight" in text


@pytest.mark.parametrize("argv,msg", [
    (["--alpha", "0.5"], "--beta"),
    (["--alpha", "-1", "--beta", "0"], "AlphaBeta.alpha"),
])
def test_errors_are_reported(profile, capsys, argv, msg):
    assert plan_cli.main(["--model-profile", profile] + argv) == 2
    assert msg in capsys.readouterr().err


def test_bad_profile(tmp_path, capsys):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps([{"name": "x", "bytes": 4}]))
    assert plan_cli.main(["--model-profile", str(p), "--alpha", "0", "--beta", "0"]) == 2
    assert "backward_s" in capsys.readouterr().err


def test_module_entry_point(profile):
    r = subprocess.run([sys.executable, "-m", "hvd_commopt.plan", "--model-profile", profile,
                        "--alpha", "0.5", "--beta", "2.5e-6", "--json"], capture_output=True, text=True,
                       check=True)
    assert json.loads(r.stdout)["best"] == "optimal"
    assert "torch" not in r.stderr
