#!/usr/bin/env bash
# The GPU checks as one run, for a machine with a CUDA device and a CUDA build of torch; run from
# the repository root (results under $OUT, default /tmp/gpu_check):
#   bash benchmarks/model/gpu_check.sh
# the CUDA test cases (graph capture and replay against the eager step, checkpoints on the GPU
# against the CPU, a GPU snapshot continued on the CPU), then benchmarks/model/gpu_decode.py.
# Python packages the machine lacks can be put as wheels in .whl/ beside this checkout. Where
# linstream is not installed, a sitecustomize makes the checkout importable as the package it
# installs (its folders model/, server/, clients/ as linstream.model, .server, .clients).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if ! python3 -c "import linstream.model" 2>/dev/null; then
  shim=$(mktemp -d /tmp/linstream-shim.XXXXXX)
  printf 'import linstream\nlinstream.__path__.append(%s)\n' "'$PWD'" > "$shim/sitecustomize.py"
  export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/model/test_graphs.py tests/model/test_hf.py \
  -k "cuda or graph" -rs 2>&1 | tee "$OUT/tests.txt"
python3 -m benchmarks.model.gpu_decode --shipped --out "$OUT/gpu_decode.json" 2>&1 | tee "$OUT/bench.txt"
