#!/usr/bin/env bash
# The one script to run on a lent GPU machine (benchmarks/README.md#gpu): the CUDA tests, then the
# GPU benchmark, in about 8 minutes. It installs nothing and needs no network: the machine's own
# python with torch (CUDA), torchvision and Triton; the repository is imported from this checkout
# (PYTHONPATH), so the C extension is absent and the NumPy host kernels stand in (CPU paths only).
#
#   bash benchmarks/gpu_check.sh            # outputs under $OUT if set, else benchmarks/results/gpu_check/
#
# Steps, each with its own time limit so that one hang cannot eat the rest:
#   1. versions, nvidia-smi                                                    (seconds)
#   2. the CUDA tests: tests/torch/test_cuda_path.py, test_backend_choice.py and every test file
#      that skips without CUDA (pytest when the machine has it), among them the Triton select
#      against the torch route (tests/torch/test_triton_select.py), a process each (<= 60 s each)
#   3. python -m benchmarks.gpu_bench: ResNet-50 and GPT-2 small, one process,
#      every variant interleaved, and the selection passes at 25M/100M, with the
#      Triton select and on the torch-op route (*_torch columns)               (<= 240 s)
#   4. 2 ranks sharing the GPU over Gloo (torchrun): compute, DDP(gloo), ours
#      none/fp16/Top-k/DGC on ResNet-50                                         (<= 120 s)
# Copy gpu_bench*.json into benchmarks/results/ (or pass --gpu-results) for python -m benchmarks.report.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HVD_COMMOPT_TIMEOUT=${HVD_COMMOPT_TIMEOUT:-120}
status=0
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, tee its log, remember a failure
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > >(tee "$DEST/$name.log") 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}

{ date -u; uname -a; nvidia-smi || true
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  $PY -c "import torchvision; print('torchvision', torchvision.__version__)" || true
  $PY -c "import triton; print('triton', triton.__version__)" || true
  $PY -c "import numpy; print('numpy', numpy.__version__)" || true
} 2>&1 | tee "$DEST/versions.log"

if $PY -c "import pytest" 2>/dev/null; then
  tests="tests/torch/test_cuda_path.py tests/torch/test_backend_choice.py"
  for f in $(grep -rlE "skipif\(not torch\.cuda\.is_available\(\)|mark\.cuda" tests benchmarks/tests --include='test_*.py' | sort); do
    case " $tests " in *" $f "*) ;; *) tests="$tests $f" ;; esac
  done
  # one pytest process per file: with Triton importable, torch's dynamo has aborted a whole CPU
  # test process from an in-process rank thread; one file's abort must not hide the others
  for f in $tests; do
    step "cuda_tests_$(basename "$f" .py)" 60 $PY -m pytest -q -rs -p no:randomly -p no:cacheprovider -o addopts="" "$f"
  done
else
  echo "=== cuda_tests: not run: pytest is not installed on this machine" | tee "$DEST/cuda_tests.log"
  status=1
fi

step gpu_bench 240 $PY -m benchmarks.gpu_bench --device cuda --out "$DEST"

if $PY -c "import torch.distributed.run" 2>/dev/null; then
  step gpu_bench_gloo2 120 env HVD_COMMOPT_BACKEND=gloo $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m benchmarks.gpu_bench --device cuda --models resnet50 --no-selection \
    --variants compute,ddp,none,fp16,topk,dgc --out "$DEST"
fi
ls -l "$DEST"
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo 'a step failed: see its log') (outputs in $DEST)"
exit $status
