#!/usr/bin/env bash
# Reproduce every figure under benchmarks/results/ on one machine (about 60 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p $out
python benchmarks/peers.py --out $out/peers | tee $out/peers.txt   # needs the bench extra (llama-cpp-python, gguf)
python benchmarks/model_bench.py --threads 1 --out $out/model_bench.json | tee $out/model_bench.txt
python benchmarks/models_table.py --out $out/models_table
port=8100
LINSTREAM_MAX_KV_SESSIONS=2 linstream serve -m linear -m performer -m retnet -m gla -m rwkv -m mamba -m hybrid -m softmax \
    --port $port --threads 1 --store memory \
    --log-level warning &
srv=$!
trap 'kill $srv' EXIT
until curl -sf http://127.0.0.1:$port/healthz >/dev/null; do sleep 0.5; done
linstream bench latency --url http://127.0.0.1:$port --threads 1 --models linear,mamba,softmax --out $out/latency \
    | tee $out/latency.txt
linstream bench latency --url http://127.0.0.1:$port --threads 1 --contexts 128,4096,32768 --tokens 32 \
    --out $out/latency_mixers
linstream loadtest --url http://127.0.0.1:$port --model linear --concurrency 1,8,64,256 --duration 20 \
    --out $out/loadtest | tee $out/loadtest.txt
python benchmarks/soak.py --concurrency 256 --duration 60 --out $out/soak.json
python benchmarks/soak.py --concurrency 256 --duration 60 --allocator jemalloc --out $out/soak_jemalloc.json
python benchmarks/faults.py --concurrency 256 --duration 30 --signal term
python benchmarks/faults.py --concurrency 256 --duration 30 --signal kill
python benchmarks/history_append.py --out $out/history_append.json
python benchmarks/fuzz_api.py --examples 100 --out $out/fuzz_api.json
