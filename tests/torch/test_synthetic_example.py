"""examples/pytorch_synthetic_benchmark.py, as Horovod's: on the GPU when there is one, on the
CPU with ``--no-cuda`` (and here, where there is none); torchvision's ResNet-50 when installed,
else the built-in CNN."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--num-iters", "1", "--num-batches-per-iter", "1", "--num-warmup-batches", "1"]


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HVD_COMMOPT_BACKEND", None)
    proc = subprocess.run([sys.executable, "examples/pytorch_synthetic_benchmark.py", *SHORT, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_the_cpu_run_with_the_builtin_model():
    out = _run("--no-cuda", "--model", "resnet18", "--width", "8")
    assert "Model: ResNet-18-shaped" in out and "device cpu" in out and "Img/sec per rank" in out


def test_the_default_model_is_resnet50_exactly_when_torchvision_is_installed():
    has_tv = importlib.util.find_spec("torchvision") is not None
    args = ["--no-cuda", "--batch-size", "2", "--image-size", "64"] + ([] if has_tv else ["--width", "8"])
    out = _run(*args)
    assert ("torchvision ResNet-50" in out) == has_tv and "device cpu" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_gpu_is_used_when_present():
    out = _run("--batch-size", "8")
    assert "device cuda" in out
