#!/usr/bin/env bash
# The GPU checks of issue 17 as one run, for a machine with a CUDA device and a CUDA build of
# torch (run from the repository root; results under $OUT, default /tmp/gpu_check):
#   the CUDA test cases (graph capture and replay against the eager step, checkpoints on the GPU
#   against the CPU, a GPU snapshot continued on the CPU), then benchmarks/gpu_bench.py.
# Python packages the machine lacks can be put as wheels in .whl/ beside this checkout.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/model/test_graphs.py tests/model/test_hf.py \
  -k "cuda or graph" -rs 2>&1 | tee "$OUT/tests.txt"
python3 benchmarks/gpu_bench.py --shipped --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/bench.txt"
